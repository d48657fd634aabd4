"""What one request may ask for, set by the operator (`kvserve serve --max-n ...`).

A few hundred bytes of JSON can ask for a lot: 128 samples of 64 prompts, a million stop strings,
a body nested a thousand deep. Each limit here bounds the work or memory a single request can
claim; a request past one gets a 400 naming the field and the limit (not a 429, which clients
retry), before anything is tokenized or queued.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from kvserve.server.errors import APIError

# Defaults, with the flag that changes each (docs: README, "Server").
DEFAULT_MAX_N = 16  # --max-n: samples per prompt (OpenAI allows up to 128)
DEFAULT_MAX_STOP = 16  # --max-stop: stop strings per request
DEFAULT_MAX_STOP_CHARS = 256  # --max-stop-chars: characters per stop string
DEFAULT_MAX_STOP_TOKEN_IDS = 256  # --max-stop-token-ids
DEFAULT_MAX_JSON_DEPTH = 32  # --max-json-depth: nesting of the request body (an OpenAI body needs ~6)
DEFAULT_MAX_REQUEST_SEQS = 256  # --max-request-seqs: prompts x n of one request
DEFAULT_MAX_TOKENS = 1024  # --max-tokens-default: output tokens of a request that names none
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # --request-timeout: from arrival to a forced finish ("length")


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = DEFAULT_MAX_N
    max_stop: int = DEFAULT_MAX_STOP
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_request_seqs: int = DEFAULT_MAX_REQUEST_SEQS
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    # Fields no request model declares: ignored with a warning (False, vLLM's behaviour) or a 400.
    strict_requests: bool = False

    def default_max_tokens(self, max_tokens: int | None, prompt_tokens: int, max_model_len: int,
                           min_tokens: int = 0) -> int:
        """A request's output cap: its own, or the server default (raised to its min_tokens)
        within the room its prompt leaves."""
        if max_tokens is not None:
            return max_tokens
        return max(1, min(max(self.max_tokens_default, min_tokens), max_model_len - prompt_tokens))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "strict_requests":
                if not isinstance(value, bool):
                    raise ValueError(f"strict_requests must be a bool, got {value!r}")
            elif f.name == "request_timeout":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"--request-timeout must be a positive number of seconds, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{f.name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_n > 128:
            raise ValueError(f"--max-n must be at most 128 (OpenAI's limit), got {self.max_n}")

    def check(self, n: int, stop: str | list[str] | None, stop_token_ids: list[int] | None,
              num_prompts: int = 1) -> None:
        """A 400 naming the first field past its limit (checked before any prompt is tokenized)."""
        if n > self.max_n:
            raise _too_large("n", f"n is {n}; this server allows at most {self.max_n} samples per prompt "
                                  f"(--max-n)")
        if num_prompts * n > self.max_request_seqs:
            raise _too_large("prompt", f"{num_prompts} prompts x n {n} = {num_prompts * n} sequences; this server "
                                       f"allows at most {self.max_request_seqs} in one request (--max-request-seqs)")
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > self.max_stop:
            raise _too_large("stop", f"stop has {len(stops)} strings; this server allows at most {self.max_stop} "
                                     f"(--max-stop)")
        for i, s in enumerate(stops):
            if len(s) > self.max_stop_chars:
                param = "stop" if isinstance(stop, str) else f"stop[{i}]"
                raise _too_large(param, f"{param} has {len(s)} characters; this server allows at most "
                                        f"{self.max_stop_chars} per stop string (--max-stop-chars)")
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise _too_large("stop_token_ids", f"stop_token_ids has {len(stop_token_ids)} ids; this server allows "
                                               f"at most {self.max_stop_token_ids} (--max-stop-token-ids)")

    def check_depth(self, obj) -> None:
        """A 400 when the parsed body nests deeper than max_json_depth (iterative: no recursion
        for a hostile body to exhaust)."""
        stack = [(obj, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > self.max_json_depth:
                raise APIError(400, f"request body is nested deeper than {self.max_json_depth} levels "
                                    f"(--max-json-depth)", None, "too_deep")
            children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _too_large(param: str, message: str) -> APIError:
    return APIError(400, message, param, "limit_exceeded")
