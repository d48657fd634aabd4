"""OpenAI request -> SamplingParams, and the context-length checks the engine would fail later.

Checking here, before submission, turns "the request can never fit" into a 400 naming the
field (`prompt`/`messages` or `max_tokens`) instead of a failure after queueing.
"""
from __future__ import annotations

import re
from dataclasses import fields

from kvserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from kvserve.server.errors import APIError, from_value_error
from kvserve.server.protocol import _SamplingRequest

SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))

# Fields left None in a request take SamplingParams' defaults (vLLM's), not OpenAI's nulls.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    rename: dict[str, str] | None = None, prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """Build and validate; a ValueError becomes a 400 whose `param` is the request's field name
    (`rename` maps SamplingParams names to the request's, e.g. logprobs -> top_logprobs).
    `prompt_logprobs`: the request's own unless given (completions' echo asks for them).

    A stream asks the engine for what is new each step, a plain response for the final output
    alone: neither copies the whole text, tokens and logprobs every step."""
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    kwargs = dict(output_kind=kind,
        n=req.n, max_tokens=max_tokens, stop=req.stop, seed=req.seed, logprobs=logprobs,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        logit_bias=_logit_bias(req.logit_bias),
        structured_outputs=structured,
    )
    for name in _OPTIONAL:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        err = from_value_error(e, SAMPLING_FIELDS)
        if rename and err.param in rename:
            err.message = err.message.replace(err.param, rename[err.param], 1)
            err.param = rename[err.param]
        raise err from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys -> token ids (the values are SamplingParams' to check)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        token = key.strip()
        if not re.fullmatch(r"-?[0-9]{1,19}", token):
            raise APIError(400, f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                           "logit_bias", "invalid_value")
        out[int(token)] = value
    return out


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Every biased token id must index the vocabulary."""
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise APIError(400, f"logit_bias has token id {bad[0]}, outside this model's vocabulary [0, {vocab_size})",
                       "logit_bias", "invalid_value")


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                  prompt_field: str, max_tokens_field: str) -> None:
    """The prompt must leave room to generate, and prompt + max_tokens must fit the context."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"{prompt_field} has {num_prompt_tokens} tokens; this model's context (max_model_len) "
                            f"is {max_model_len} tokens, which leaves no room for output",
                       prompt_field, "context_length_exceeded")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        room = max_model_len - num_prompt_tokens
        raise APIError(400, f"{max_tokens_field} is too large: {max_tokens} output tokens + {num_prompt_tokens} prompt "
                            f"tokens exceed this model's context (max_model_len {max_model_len}); "
                            f"ask for at most {room}", max_tokens_field, "context_length_exceeded")
