"""`kvserve serve`: load the model, build the app, run uvicorn with a graceful drain.

On SIGTERM (or the first Ctrl+C) the server drains instead of dying: new API requests get
503 while the listening socket stays open (a load balancer sees a clean refusal, not a
connection reset), in-flight requests have `shutdown_timeout` seconds to finish, whatever
still runs after that is aborted (its stream ends with finish_reason "abort"), and then
uvicorn closes connections, the engine thread stops and the process exits 0. A second
signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import uvicorn

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import DEFAULT_MAX_UNREAD_TOKENS, AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.loading.chat_template import read_chat_template
from kvserve.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, build_app
from kvserve.server.connections import DEFAULT_HEADER_TIMEOUT_S, with_header_timeout
from kvserve.server.limits import RequestLimits
from kvserve.server.replicas.router import POLICIES, RouterConfig
from kvserve.server.state import ServerState

log = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "gemma-3-270m"


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: RequestLimits = field(default_factory=RequestLimits)
    protect_metrics: bool = False
    max_connections: int = 1024  # uvicorn's limit_concurrency
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = 60.0
    max_stream_backlog: int = DEFAULT_MAX_UNREAD_TOKENS  # tokens a stream's reader may leave unread
    allowed_hosts: list[str] | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    chat_template: str | None = None  # a Jinja file, or the template itself, instead of the model's
    tool_call_parser: str | None = None  # None: the chat template's format; "none": no auto tool calls
    data_parallel_size: int = 1  # > 1: that many engine replicas on Ray Serve behind a router
    router: str = "prefix"  # with replicas: prefix, round_robin or pow2
    ray_address: str | None = None  # with replicas: an existing Ray cluster (None: a local one)
    router_cache_threshold: float = RouterConfig.cache_threshold  # with replicas: see router.py
    router_balance_abs_threshold: int = RouterConfig.balance_abs_threshold
    router_balance_rel_threshold: float = RouterConfig.balance_rel_threshold


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the app before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self._state = state
        self._timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._signalled = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: it would re-raise SIGTERM after the
        # shutdown, and the default handler would end the process with -15 instead of 0.
        if self._signalled or self._loop is None:
            self.should_exit = True
            self.force_exit = self._signalled
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        # On the event loop, not in the signal handler: logging there could re-enter a lock.
        log.info("received %s: draining (up to %.0f s)", signal.Signals(sig).name, self._timeout)
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self._state.drain(self._timeout)
        finally:
            self.should_exit = True


def serve(config: EngineConfig, opts: ServeOptions) -> int:
    """Blocks until the server has shut down; returns the exit status (0 after a drain)."""
    _check_options(opts)
    template = read_chat_template(opts.chat_template, "--chat-template") if opts.chat_template is not None else None
    name = opts.served_model_name or (str(config.model) if config.model is not None else DEFAULT_MODEL_NAME)
    if opts.data_parallel_size > 1:
        return _serve_replicas(config, opts, template, name)
    engine = LLMEngine(config)
    async_engine = AsyncLLMEngine(engine, max_unread_tokens=opts.max_stream_backlog)
    app = build_app(async_engine, name, api_key=opts.api_key, max_queue=opts.max_queue,
                    max_body_bytes=opts.max_body_bytes, limits=opts.limits, protect_metrics=opts.protect_metrics,
                    allowed_hosts=opts.allowed_hosts, body_timeout=opts.body_timeout, chat_template=template,
                    tool_call_parser=opts.tool_call_parser)
    uv_config = uvicorn_config(app, opts)
    server = DrainingServer(uv_config, app.state.kvserve, opts.shutdown_timeout)
    log.info("serving %r on http://%s:%d (OpenAI API at /v1)", name, opts.host, opts.port)
    server.run()
    return 0 if server.started else 1


def _serve_replicas(config: EngineConfig, opts: ServeOptions, template, name: str) -> int:
    """The same server in front of N engine replicas on Ray Serve (kvserve/server/replicas/)."""
    from kvserve.server.replicas.pool import ReplicaOptions, start_replicas  # imports Ray: only when asked

    replica_opts = ReplicaOptions(opts.data_parallel_size, opts.router, opts.ray_address,
                                  cache_threshold=opts.router_cache_threshold,
                                  balance_abs_threshold=opts.router_balance_abs_threshold,
                                  balance_rel_threshold=opts.router_balance_rel_threshold)
    replicas = start_replicas(config, replica_opts, opts.max_stream_backlog)
    try:
        app = build_app(replicas, name, api_key=opts.api_key, max_queue=opts.max_queue,
                        max_body_bytes=opts.max_body_bytes, limits=opts.limits, protect_metrics=opts.protect_metrics,
                        allowed_hosts=opts.allowed_hosts, body_timeout=opts.body_timeout, chat_template=template,
                        tool_call_parser=opts.tool_call_parser)
        server = DrainingServer(uvicorn_config(app, opts), app.state.kvserve, opts.shutdown_timeout)
        log.info("serving %r on http://%s:%d with %d replicas (router %s)", name, opts.host, opts.port,
                 opts.data_parallel_size, opts.router)
        server.run()
    finally:
        replicas.close()
    return 0 if server.started else 1


def uvicorn_config(app, opts: ServeOptions) -> uvicorn.Config:
    """uvicorn's settings: past `max_connections` open connections new ones get 503 at once;
    an idle keep-alive connection is closed after 5 s; headers over 16 KiB are refused, and
    headers not complete within `header_timeout` s close the connection (connections.py)."""
    return uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                          timeout_graceful_shutdown=5, timeout_keep_alive=5,
                          limit_concurrency=opts.max_connections, h11_max_incomplete_event_size=16 * 1024,
                          http=with_header_timeout(opts.header_timeout))


def resolve_api_key(flag: str | None, key_file: str | None, env: dict | None = None) -> str | None:
    """The API key from --api-key, --api-key-file (first line) or $KVSERVE_API_KEY, in that order
    of precedence (the flag shows in `ps`; the file and the variable do not). None: no key."""
    if flag is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {key_file}: cannot be read ({e.__class__.__name__}: {e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {key_file}: the first line is empty")
        return key
    if flag is not None:
        return flag
    value = (os.environ if env is None else env).get("KVSERVE_API_KEY")
    if value is not None and not value.strip():
        raise ValueError("KVSERVE_API_KEY is set but empty")
    return None if value is None else value.strip()


def _check_options(opts: ServeOptions) -> None:
    if not 0 <= opts.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {opts.port}")
    if opts.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {opts.max_queue}")
    if opts.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {opts.max_body_bytes}")
    if opts.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {opts.shutdown_timeout}")
    if opts.api_key is not None and not opts.api_key:
        raise ValueError("--api-key must not be empty")
    if not opts.body_timeout > 0:
        raise ValueError(f"--body-timeout must be a positive number of seconds, got {opts.body_timeout}")
    if not opts.header_timeout > 0:
        raise ValueError(f"--header-timeout must be a positive number of seconds, got {opts.header_timeout}")
    if opts.max_stream_backlog < 1:
        raise ValueError(f"--max-stream-backlog must be >= 1, got {opts.max_stream_backlog}")
    if opts.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {opts.max_connections}")
    if opts.protect_metrics and opts.api_key is None:
        raise ValueError("--protect-metrics needs an API key (--api-key, --api-key-file or KVSERVE_API_KEY)")
    if opts.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {opts.data_parallel_size}")
    if opts.router not in POLICIES:
        raise ValueError(f"--router must be one of {', '.join(POLICIES)}, got {opts.router!r}")
    RouterConfig(cache_threshold=opts.router_cache_threshold, balance_abs_threshold=opts.router_balance_abs_threshold,
                 balance_rel_threshold=opts.router_balance_rel_threshold)  # a bad setting names its flag
    if opts.ray_address is not None and opts.data_parallel_size == 1:
        raise ValueError("--ray-address needs --data-parallel-size > 1 (one engine runs in this process)")
    if opts.allowed_hosts is not None and not all(h.strip() for h in opts.allowed_hosts):
        raise ValueError(f"--allowed-hosts must be a comma list of host names, got {','.join(opts.allowed_hosts)!r}")
