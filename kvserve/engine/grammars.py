"""Structured-output requests waiting for their grammar, compiled off the step loop.

A constrained request whose grammar is cached starts at once; any other waits here while one
worker thread compiles it (tens of ms, more for a large schema), and the requests already
running keep stepping. Each step the engine takes the requests whose grammar is ready.
"""
from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvserve.sampling.structured import GrammarBackend
from kvserve.sampling_params import StructuredOutputsParams

# With nothing else to run, the engine thread waits this long for a grammar before looking at
# its command queue again (a compile that finishes sooner wakes it at once).
IDLE_WAIT_S = 0.02


class GrammarCompiles:
    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")  # its thread starts on first use
        self._waiting: dict[str, Future] = {}  # request id -> its grammar's compilation

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, request_id: str, params: StructuredOutputsParams) -> Any | None:
        """The compiled grammar when cached; else None, the compilation under way."""
        compiled = self.backend.cached(params)
        if compiled is not None:
            return compiled
        self._waiting[request_id] = self._pool.submit(self.backend.compile, params)
        return None

    def compile_in_background(self, params: StructuredOutputsParams) -> Future:
        """Compile on the worker thread (the server does it before submitting a request, so that
        a bad constraint is its 400 and the engine then finds the grammar cached)."""
        return self._pool.submit(self.backend.compile, params)

    def discard(self, request_id: str) -> None:
        """An aborted request: its grammar (still compiling or not) is no longer wanted."""
        self._waiting.pop(request_id, None)

    def ready(self, idle: bool) -> list[tuple[str, Any, BaseException | None]]:
        """(request id, compiled grammar, error) of every finished compilation; `idle` (nothing
        else to run) waits up to IDLE_WAIT_S for one instead of spinning."""
        if not self._waiting:
            return []
        if idle:
            cf.wait(list(self._waiting.values()), timeout=IDLE_WAIT_S, return_when=cf.FIRST_COMPLETED)
        done = [(rid, fut) for rid, fut in self._waiting.items() if fut.done()]
        out = []
        for rid, fut in done:
            del self._waiting[rid]
            err = fut.exception()
            out.append((rid, None if err else fut.result(), err))
        return out
