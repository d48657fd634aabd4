"""One replica: an LLMEngine driven by an AsyncLLMEngine inside a Ray Serve deployment.

The front (kvserve/server/replicas/pool.py) tokenizes, routes and sends token ids; a replica
streams back the engine's own RequestOutputs (delta outputs when the request asked for them), or
one `ReplicaFailure` carrying the status and message an in-process engine would have raised.
Serve restarts a replica whose `check_health` raises or whose process dies.
"""
from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import ray
from ray._private import ray_constants
from ray.serve._private import replica as serve_replica

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine, RequestError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import EmbeddingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling.structured import GrammarError
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaFailure:
    """What a replica sends instead of an output when the engine refused or failed a request."""

    message: str
    status: int


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front needs from a replica: the tokenizer and model for templates and limits."""

    tokenizer: object
    model_config: object
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int  # pages of the KV pool
    num_cache_blocks: int  # logical blocks it holds: one page per KV layer group each
    incarnation: str  # new after every (re)start: the router forgets what the old one held
    pid: int
    actor_name: str | None
    reasoning_parser: str | None = None  # the engines' (EngineConfig.reasoning_parser)


class EngineReplica:
    """The Serve deployment's class (one engine per replica)."""

    def __init__(self, config: EngineConfig, max_unread_tokens: int | None):
        if not ray_constants.ENABLE_RAY_CLUSTER:  # the server's own single-node Ray (pool.start_ray)
            _serve_grpc_on_loopback()
        self.engine = AsyncLLMEngine(LLMEngine(config), max_unread_tokens=max_unread_tokens)
        self.engine.start()
        self.incarnation = uuid.uuid4().hex

    def describe(self) -> ReplicaInfo:
        core = self.engine.engine
        return ReplicaInfo(core.tokenizer, core.model_config, core.max_model_len, core.model_config.vocab_size,
                           core.config.block_size, core.num_blocks,
                           core.num_blocks // max(1, core.block_manager.num_groups), self.incarnation,
                           os.getpid(), _actor_name(), core.config.reasoning_parser)

    def stats(self) -> dict:
        return {**self.engine.stats(), "incarnation": self.incarnation, "healthy": self.engine.healthy,
                "num_unfinished": self.engine.num_unfinished}

    def abort(self, request_id: str) -> None:
        """A server-side abort (a drain): the request's stream ends with finish_reason "abort"."""
        self.engine.abort(request_id)

    def check_health(self) -> None:
        """Serve's health check: a dead engine thread or an unhealthy engine gets the replica restarted."""
        if not self.engine.is_running:
            raise RuntimeError("the engine thread is not running")
        if not self.engine.healthy:
            raise RuntimeError("the engine's last steps failed")

    async def compile_grammar(self, params: StructuredOutputsParams) -> tuple[str, str] | None:
        """Compile a constraint into this replica's cache before a request needs it; a constraint
        that cannot compile comes back as (field, message) for the front's 400."""
        try:
            await self.engine.compile_grammar(params)
        except GrammarError as e:
            return e.field, str(e)[len(e.field) + 1:]
        return None

    async def generate(self, token_ids: list[int], params: SamplingParams | PoolingParams, request_id: str,
                       waited_s: float, cache_salt: str | None,
                       timeout_s: float | None) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput | ReplicaFailure]:
        """Stream a request's outputs (PoolingParams: its one embedding output). `waited_s`: how
        long ago it arrived at the front, so that TTFT counts from the front's arrival on this
        replica's clock; `timeout_s`: time left of its deadline."""
        now = self.engine.clock()
        deadline = None if timeout_s is None else now + timeout_s
        submit = self.engine.embed if isinstance(params, PoolingParams) else self.engine.generate
        try:
            stream = submit(token_ids, params, request_id, now - waited_s, cache_salt=cache_salt, deadline=deadline)
        except (ValueError, RequestError) as e:
            yield ReplicaFailure(str(e), getattr(e, "status", 400))
            return
        try:
            async for out in stream:
                yield out
        except RequestError as e:
            yield ReplicaFailure(str(e), e.status)
        finally:  # also on cancellation (the client left): aborts the request, frees its blocks
            stream.close()

    def __del__(self) -> None:
        try:
            self.engine.abort_all()
        except Exception:
            pass


def _serve_grpc_on_loopback() -> None:
    """Serve starts each replica's inter-deployment gRPC server on all interfaces ("[::]:0",
    fixed in its code) once the replica's class is built; in a single-node Ray, whose every other
    server listens on 127.0.0.1, bind it there too (tests/test_replicas.py checks every socket)."""
    bind = serve_replica.add_port_to_grpc_server
    if getattr(bind, "loopback", False):
        return

    def loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return bind(server, address)

    loopback.loopback = True
    serve_replica.add_port_to_grpc_server = loopback


def _actor_name() -> str | None:
    try:
        return ray.get_runtime_context().get_actor_name()
    except Exception:  # outside Ray (tests of the class itself)
        return None
