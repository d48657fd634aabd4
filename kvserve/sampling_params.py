"""Per-request sampling parameters with vLLM-compatible semantics and validation."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

# vLLM treats temperatures below this as greedy (division by ~0 would overflow).
GREEDY_TEMPERATURE_EPS = 1e-5
# Same default cap as vLLM's `max_logprobs` and OpenAI's `top_logprobs`.
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0


def _check_int(name: str, value: Any, *, optional: bool = False) -> None:
    """Reject non-integers; bool is an int subclass, but `n=True` is a bug, not a count."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")


def _check_float(name: str, value: Any) -> float:
    """Accept ints and floats (not bools), require a finite value, return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names): exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression,
    one of a list of strings (`choice`) or an EBNF grammar (xgrammar's dialect, GBNF-like).

    Only the shape is checked here; whether the schema, regex or grammar compiles is the
    grammar backend's verdict (kvserve/sampling/structured.py), a ValueError naming the field.
    `disable_any_whitespace`: JSON without free whitespace between its tokens."""

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        _check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            bad = [c for c in self.choice if not isinstance(c, str)]
            if bad:
                raise ValueError(f"structured_outputs.choice must contain only strings, got {bad[0]!r}")
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)

    @property
    def kind(self) -> str:
        """Which constraint: one of KINDS."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (a schema dict as JSON, choices as a JSON list). Keys keep their
        order: a schema's property order is the order the JSON is generated in."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json, ensure_ascii=False)
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        """Equal constraints have equal keys (what compiled grammars are cached by)."""
        return self.kind, self.spec, self.disable_any_whitespace


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs carries (vLLM's names)."""

    CUMULATIVE = "cumulative"  # everything so far, every step (the Python API's default)
    DELTA = "delta"  # only what is new since the previous output (what a stream sends)
    FINAL_ONLY = "final_only"  # one output, when the request finishes (a non-streamed response)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    After construction `stop` and `stop_token_ids` are always lists (possibly empty).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # vLLM's prompt_logprobs: for every prompt token after the first, its logprob and the
    # top-N alternatives (RequestOutput.prompt_logprobs); 0 gives the prompt token's alone.
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to that token's logit before
    # penalties and sampling (reported logprobs stay those of the raw logits, as vLLM's).
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrained decoding (JSON schema, regex, choice, grammar): a per-token mask in the sampler.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_floats()
        self._validate_stops()
        self._validate_logit_bias()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    def _validate_counts(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check_int("seed", self.seed, optional=True)
        _check_int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_int("logprobs", self.logprobs, optional=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check_int("prompt_logprobs", self.prompt_logprobs, optional=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")

    def _validate_floats(self) -> None:
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature:g}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value:g}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty:g}")

    def _validate_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain empty strings")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of int or None, got {type(ids).__name__}"
            )
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"stop_token_ids must contain only ints, got {t!r}")
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        self.stop_token_ids = ids

    def _validate_logit_bias(self) -> None:
        """Token ids >= 0 (the vocabulary's upper bound is the engine's to check) and finite
        values in [-100, 100]; stored as a new dict of int -> float."""
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        out: dict[int, float] = {}
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            value = _check_float("logit_bias", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value:g} for token {token}")
            out[token] = value
        self.logit_bias = out or None

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax (temperature ~ 0, as vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
