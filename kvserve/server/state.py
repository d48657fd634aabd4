"""What every handler shares: the engine, the model's name and template, limits, drain state."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.loading.tokenizer import Tokenizer
from kvserve.sampling_params import SamplingParams
from kvserve.loading.chat_template import ChatTemplate
from kvserve.server.errors import APIError
from kvserve.server.limits import RequestLimits
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import _SamplingRequest, now

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    chat_template: ChatTemplate
    metrics: ServerMetrics
    api_key: str | None
    max_queue: int
    max_body_bytes: int
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask for
    protect_ops: bool = False  # /metrics and /stats want the API key too
    body_timeout: float = 60.0  # seconds for a request body to arrive (408 after)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: new API requests get 503
    inflight: int = 0  # API requests being handled (streams included), counted by the gateway
    tool_parser: str | None = None  # the tool-call format of tool_choice "auto" (None: no auto tool calls)
    reasoning_parser: str | None = None  # --reasoning-parser (None: the output is all content)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids the model's embedding has (ids a request may name)."""
        return self.engine.engine.model_config.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def admit(self, count: int = 1) -> None:
        """Refuse new work while draining (503), a request of `count` sequences (prompts x n)
        that could never fit the waiting queue (400: a retry cannot help), or one that would take
        the queue past max_queue now (429)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down")
        if not self.engine.healthy:
            raise APIError(503, "the engine is unhealthy: its last steps failed; retry later", None,
                           "engine_unhealthy")
        if count > self.max_queue:
            raise APIError(400, f"this request is {count} sequences (prompts x n); the server queues at most "
                                f"{self.max_queue} (--max-queue)", "prompt", "limit_exceeded")
        waiting = self.engine.num_waiting
        if waiting + count > self.max_queue:
            raise APIError(429, f"server busy: {waiting} requests are already waiting (max_queue "
                                f"{self.max_queue}); retry later", None, "queue_full")

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout` s, abort the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout
        if self.inflight:
            log.info("draining: waiting up to %.0f s for %d in-flight request(s)", timeout, self.inflight)
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("draining: aborting %d request(s) still running after %.0f s", self.inflight, timeout)
            self.engine.abort_all()
            grace = time.monotonic() + 5.0  # the aborted streams send their final chunk
            while self.inflight and time.monotonic() < grace:
                await asyncio.sleep(0.05)


@dataclass
class Job:
    """One accepted API request: what its responses need to know. Subclasses set `id_prefix`."""

    id_prefix: ClassVar[str]
    state: ServerState
    req: _SamplingRequest
    params: SamplingParams
    arrival_time: float
    id: str = field(init=False)
    created: int = field(default_factory=now)

    def __post_init__(self) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"

    @property
    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)
