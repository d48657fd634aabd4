"""A live uvicorn server on 127.0.0.1 in a background thread, for tests that talk real HTTP."""
from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import uvicorn

from kvserve import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server import build_app
from kvserve.server.launch import ServeOptions, uvicorn_config


class LiveServer:
    def __init__(self, app, sock: socket.socket, options: ServeOptions | None = None):
        self.app = app
        self.state = app.state.kvserve
        self.engine: LLMEngine = self.state.engine.engine
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._sock = sock
        config = uvicorn_config(app, options or ServeOptions(log_level="warning"))  # as `kvserve serve` runs
        config.access_log = False
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def start(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("live server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def run_coroutine(self, coro) -> "concurrent.futures.Future":
        """Run `coro` on the server's event loop (where the app's state lives)."""
        return asyncio.run_coroutine_threadsafe(coro, self.server.servers[0].get_loop())

    def pool_is_full(self) -> bool:
        """Every KV block is free and no request is left, as seen from the engine thread."""
        s = self.state.engine.stats()
        return (s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_requests_running"] == 0
                and s["num_requests_waiting"] == 0 and self.state.engine.num_unfinished == 0)

    def wait_pool_full(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pool_is_full():
                return True
            time.sleep(0.05)
        return self.pool_is_full()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until a server process answers /health with 200; fails with its output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server did not become healthy in {timeout:.0f} s")


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def make_engine(loaded, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(**config), loaded=loaded)


@contextmanager
def live_server(engine: LLMEngine | AsyncLLMEngine, name: str = "test-model", options: ServeOptions | None = None,
                **app_args) -> Iterator[LiveServer]:
    """A live server of build_app(engine, name, **app_args), uvicorn set up as `kvserve serve`
    sets it up with `options`."""
    server = LiveServer(build_app(engine, name, **app_args), free_socket(), options).start()
    try:
        yield server
    finally:
        server.stop()
