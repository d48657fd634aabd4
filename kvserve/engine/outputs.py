"""What the engine hands back: one RequestOutput per request per step that changed it."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvserve.engine.metrics import RequestMetrics
from kvserve.sequence import Logprob


def error_reference() -> str:
    """A short id tying an error a client sees to its log entry (never the exception's text)."""
    return uuid.uuid4().hex[:12]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    delta_text: str = ""  # text added since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    error_status: int = 400  # with `error`: 400, the request is bad; 500, the engine failed on it
    # SamplingParams.prompt_logprobs (vLLM's shape): None for the first prompt token, then per
    # token {token id: Logprob} of it and its top alternatives. In every output once the prompt
    # is computed; a DELTA request's first output only.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (usage's cached_tokens)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What an embedding request (PoolingParams) gives back, once, finished (vLLM's shape:
    `output.outputs.embedding`). `outputs` is None when it failed (`error`) or was aborted."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    error_status: int = 400
