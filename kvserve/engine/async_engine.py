"""AsyncLLMEngine: the LLMEngine driven by one background thread, for the server.

Why a thread and queues: a step is tens of milliseconds of torch compute; run on the event
loop it would stall every HTTP connection for that long. So exactly one thread owns the
LLMEngine and runs `step()`; nothing else touches it. Everyone else talks to that thread:

* submissions and aborts go into one command list under a condition variable; the loop drains
  it between steps (so a request added mid-step joins the next one), and sleeps on the
  condition when there is nothing to do (no busy spin);
* each request has a mailbox on its caller's event loop, fed from the engine thread with
  `loop.call_soon_threadsafe`; outputs arriving while one is unread merge into it, and a reader
  too far behind (`max_unread_tokens`) has its request aborted;
* tokenization (the one CPU-heavy thing a handler does) runs in a small thread pool, so it
  neither blocks the event loop nor waits behind a step;
* `stats()` reads a snapshot the loop publishes after every drain and step.

A failing step must not kill the loop silently: the LLMEngine itself ends only the request a
failure can be pinned on; a failure that escapes `step()` fails the requests it was running with an
error (their blocks freed) and the loop keeps serving the others. After UNHEALTHY_AFTER failed
steps in a row the engine is unhealthy (`healthy` False: the server's /health answers 503 and new
requests are refused with 503) until a step succeeds again. Clients get a reference to the log
entry, never the exception's text.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.metrics import RequestMetrics
from kvserve.engine.outputs import CompletionOutput, RequestOutput, error_reference
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

log = logging.getLogger(__name__)
UNHEALTHY_AFTER = 3  # failed steps in a row before the engine reports itself unhealthy
# Tokens of one sample a stream's reader may leave unread before the request is aborted. A
# reader that keeps up holds at most a step's worth (plus what socket buffers absorb first).
DEFAULT_MAX_UNREAD_TOKENS = 512


class RequestError(Exception):
    """A request the engine refused or could not finish.

    `status` says whose fault it was, as an HTTP status: 400 when the request itself can never
    run (the engine rejected it), 500 when the engine failed while running it.
    """

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class OutputObserver(Protocol):
    """Sees every output on the engine thread (the Prometheus collectors implement it)."""

    def on_output(self, out: RequestOutput, first: bool) -> None: ...


class _Mailbox:
    """A request's undelivered outputs, on its caller's event loop. An output arriving while the
    previous one is still unread replaces it, carrying both steps' news, so a client that stops
    reading holds one output, not one per step; and once that unread output holds more than
    `max_unread_tokens` tokens of one sample, the request is given up: `on_overflow` runs (the
    engine aborts it, freeing its blocks) and the reader, if it ever comes back, gets an error."""

    def __init__(self, delta: bool = False, max_unread_tokens: int | None = None,
                 on_overflow: Callable[[], None] | None = None):
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self._delta = delta  # outputs carry only what is new (RequestOutputKind.DELTA)
        self._max_unread = max_unread_tokens
        self._on_overflow = on_overflow
        self._overflowed = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._overflowed:
            return
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            self._items.pop()
            item = _with_earlier(item, last, self._delta)
            if not item.finished and self._too_far_behind(item):
                self._overflow()
                return
        self._items.append(item)
        self._ready.set()

    def _too_far_behind(self, item: RequestOutput) -> bool:
        return self._max_unread is not None and max(len(c.delta_token_ids) for c in item.outputs) > self._max_unread

    def _overflow(self) -> None:
        self._overflowed = True
        self._items.clear()
        self._items.append(RequestError(f"the client read no output for more than {self._max_unread} tokens "
                                        "(the stream's backlog limit); the request was aborted", 408))
        self._ready.set()
        if self._on_overflow is not None:
            self._on_overflow()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


def _with_earlier(out: RequestOutput, earlier: RequestOutput, delta: bool) -> RequestOutput:
    """`out` that also carries the unread news of `earlier` (same request, an earlier step): its
    deltas, and with delta outputs its text, tokens and logprobs as well."""
    before = {c.index: c for c in earlier.outputs}
    merged = []
    for c in out.outputs:
        e = before.get(c.index)
        if e is not None:
            c = dataclasses.replace(c, delta_text=e.delta_text + c.delta_text,
                                    delta_token_ids=e.delta_token_ids + c.delta_token_ids)
            if delta:
                c.text, c.token_ids = e.text + c.text, e.token_ids + c.token_ids
                if c.logprobs is not None:
                    c.logprobs, c.top_logprobs = e.logprobs + c.logprobs, e.top_logprobs + c.top_logprobs
        merged.append(c)
    # A DELTA request's prompt logprobs come in one output: keep them if that one went unread.
    return dataclasses.replace(out, outputs=merged, prompt_logprobs=out.prompt_logprobs or earlier.prompt_logprobs)


@dataclass
class _Stream:
    """Where one request's outputs go: a mailbox living on its caller's event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: _Mailbox
    n: int
    prompt_token_ids: list[int] | None
    arrival_time: float
    delta: bool = False  # its outputs carry only what is new
    last: RequestOutput | None = None
    cancelled: bool = False  # the consumer went away; drop anything still coming


@dataclass
class _Add:
    stream: _Stream
    prompt: str | list[int]
    params: SamplingParams | PoolingParams
    cache_salt: str | None = None
    deadline: float | None = None


@dataclass
class _Abort:
    request_id: str
    notify: bool  # True: tell the consumer (server-side abort); False: the consumer asked


class RequestStream:
    """Async iterator over one request's outputs (each carries `delta_text`/`delta_token_ids`).

    A class rather than an async generator on purpose: the request is submitted as soon as
    `generate()` returns, and `aclose()` aborts it even when iteration never started (an async
    generator that never ran would skip its `finally`). Cancelling a pending `__anext__`
    (client gone) aborts as well, and so does dropping the object unclosed.
    """

    def __init__(self, engine: "AsyncLLMEngine", stream: _Stream):
        self._engine = engine
        self._stream = stream
        self._done = False

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:  # CancelledError: whoever waited on us is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; an unfinished request is aborted and its KV blocks freed."""
        if not self._done:
            self._done = True
            self._stream.cancelled = True
            self._engine.abort(self.request_id, notify=False)

    def __del__(self) -> None:  # last resort: never leave an unread request holding KV blocks
        try:
            self.close()
        except Exception:
            pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, tokenizer_threads: int = 2,
                 observer: OutputObserver | None = None, max_unread_tokens: int | None = DEFAULT_MAX_UNREAD_TOKENS):
        """`max_unread_tokens`: a consumer that leaves more than this many tokens of one sample
        unread has its request aborted (None: never; the output kept unread is still one)."""
        if max_unread_tokens is not None and (isinstance(max_unread_tokens, bool) or not isinstance(max_unread_tokens, int)
                                              or max_unread_tokens < 1):
            raise ValueError(f"max_unread_tokens must be >= 1 or None, got {max_unread_tokens!r}")
        self.engine = engine
        self.max_unread_tokens = max_unread_tokens
        self.observer = observer
        self._cv = threading.Condition()
        self._commands: list[_Add | _Abort] = []  # guarded by _cv
        self._num_pending_adds = 0  # guarded by _cv: submitted, not yet in the scheduler
        self._streams: dict[str, _Stream] = {}  # guarded by _cv
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stats: dict = engine.stats()
        self._tokenizer_threads = tokenizer_threads
        self._tokenizer_pool: ThreadPoolExecutor | None = self._new_pool()
        self._consecutive_failures = 0
        self.loop_iterations = 0  # wake-ups of the engine thread (idle means this stands still)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        if self._tokenizer_pool is None:  # started again after a shutdown (an app's second lifespan)
            self._tokenizer_pool = self._new_pool()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """False after UNHEALTHY_AFTER failed steps in a row, until a step succeeds; for good once
        the engine cannot step at all (a tensor-parallel rank died)."""
        return self._consecutive_failures < UNHEALTHY_AFTER and self.engine.fatal_error is None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is left (consumers see finish_reason "abort"), stop the thread."""
        self.abort_all()
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
            self._thread = None
        pool, self._tokenizer_pool = self._tokenizer_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self._tokenizer_threads, thread_name_prefix="kvserve-tokenize")

    # ---------------------------------------------------------------- requests
    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        """engine.tokenize off the event loop (raises its ValueError for a bad prompt)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, self.engine.tokenize, prompt)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Raw tokenizer encode off the event loop (chat prompts carry their own BOS)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, self.engine.tokenizer.encode, text,
                                          add_special_tokens)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a request's constraint off the event loop and off the step loop (cached for
        its add_request); raises kvserve.sampling.structured.GrammarError (a ValueError)."""
        await asyncio.wrap_future(self.engine.grammars.compile_in_background(params))

    def clock(self) -> float:
        """The engine's monotonic clock: a handler stamps arrival with it before tokenizing."""
        return self.engine.clock()

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 deadline: float | None = None) -> RequestStream:
        """Submit now; iterate the result for the outputs. Raises ValueError for a duplicate id.

        `arrival_time` (engine clock) defaults to now; a server passes the time the HTTP request
        arrived, so TTFT includes tokenization as vLLM defines it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        return self._submit(prompt, params, request_id, arrival_time, cache_salt, deadline,
                            params.output_kind is RequestOutputKind.DELTA, params.n)

    def embed(self, prompt: str | list[int], params: PoolingParams, request_id: str,
              arrival_time: float | None = None, cache_salt: str | None = None,
              deadline: float | None = None) -> RequestStream:
        """Submit an embedding request; its one output is an EmbeddingRequestOutput (or, if the
        server aborts it, a RequestOutput whose finish_reason is "abort")."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params must be PoolingParams, got {type(params).__name__}")
        return self._submit(prompt, params, request_id, arrival_time, cache_salt, deadline, False, 1)

    def _submit(self, prompt: str | list[int], params: SamplingParams | PoolingParams, request_id: str,
                arrival_time: float | None, cache_salt: str | None, deadline: float | None, delta: bool,
                n: int) -> RequestStream:
        loop = asyncio.get_running_loop()
        ids = list(prompt) if not isinstance(prompt, str) else None
        arrival = self.engine.clock() if arrival_time is None else arrival_time
        mailbox = _Mailbox(delta, self.max_unread_tokens, lambda: self._give_up(request_id))
        stream = _Stream(request_id, loop, mailbox, n, ids, arrival, delta)
        with self._cv:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if self._stopping:
                raise RequestError("the engine is shutting down", 503)
            if not self.healthy:
                raise RequestError("the engine is unhealthy: its last steps failed; retry later", 503)
            self._streams[request_id] = stream
            self._commands.append(_Add(stream, prompt, params, cache_salt, deadline))
            self._num_pending_adds += 1
            self._cv.notify()
        return RequestStream(self, stream)

    def abort(self, request_id: str, notify: bool = True) -> None:
        """Thread-safe; the loop frees the request's blocks before its next step."""
        with self._cv:
            self._commands.append(_Abort(request_id, notify))
            self._cv.notify()

    def _give_up(self, request_id: str) -> None:
        """The consumer stopped reading (its mailbox overflowed): abort, deliver nothing more."""
        log.warning("request %s: its reader fell more than %s tokens behind; aborted", request_id,
                    self.max_unread_tokens)
        with self._cv:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancelled = True
        self.abort(request_id, notify=False)

    def abort_all(self) -> None:
        with self._cv:
            for rid in list(self._streams):
                self._commands.append(_Abort(rid, True))
            self._cv.notify()

    # ---------------------------------------------------------------- introspection
    def stats(self) -> dict:
        """The engine's counters as of the last drain/step; waiting includes submissions the
        loop has not picked up yet (what a queue limit must count)."""
        with self._cv:
            stats = dict(self._stats)
            stats["num_requests_waiting"] += self._num_pending_adds
        return stats

    @property
    def num_waiting(self) -> int:
        return self.stats()["num_requests_waiting"]

    @property
    def num_unfinished(self) -> int:
        with self._cv:
            return len(self._streams)

    # ---------------------------------------------------------------- the loop (engine thread)
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._cv.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            self.loop_iterations += 1
            self._apply(commands)
            if stopping:
                self._abort_everything()
                self._publish_stats(0)
                return
            if self.engine.has_unfinished():
                self._step()
            self._publish_stats(0)

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        adds = 0
        for cmd in commands:
            if isinstance(cmd, _Add):
                adds += 1
                self._add(cmd)
            else:
                self._abort(cmd.request_id, cmd.notify)
        self._publish_stats(adds)

    def _add(self, cmd: _Add) -> None:
        s = cmd.stream
        if s.cancelled:  # gone before it even started
            self._forget(s.request_id)
            return
        try:
            self.engine.add_request(cmd.prompt, cmd.params, s.request_id, arrival_time=s.arrival_time,
                                    cache_salt=cmd.cache_salt, deadline=cmd.deadline)
        except ValueError as e:
            self._fail(s, RequestError(str(e), 400))
        except Exception:  # a bug, not bad input: say so (the details in the log), keep serving
            ref = error_reference()
            log.exception("add_request %s failed [%s]", s.request_id, ref)
            self._fail(s, RequestError(f"internal engine error while adding the request (log reference {ref})", 500))

    def _abort(self, request_id: str, notify: bool) -> None:
        stream = self._engine_abort(request_id, "abort %s failed")
        if stream is None:
            return
        if notify and not stream.cancelled:
            self._deliver(stream, _aborted_output(stream, self.engine.clock()))
        else:
            self._forget(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        self._consecutive_failures = 0
        for out in outputs:
            stream = self._stream_of(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if out.error is not None:
                self._observe(stream, out)
                self._fail(stream, RequestError(out.error, out.error_status))
            else:
                self._deliver(stream, out)

    def _step_failed(self, exc: Exception) -> None:
        """Fail the requests the step was running; if steps keep failing, fail everything
        (the culprit may be a request still waiting to be admitted)."""
        self._consecutive_failures += 1
        ref = error_reference()
        log.exception("engine step failed (%d in a row) [%s]", self._consecutive_failures, ref, exc_info=exc)
        if not self.healthy:
            log.error("engine unhealthy after %d failed steps in a row: new requests get 503", UNHEALTHY_AFTER)
        running = {s.request_id for s in self.engine.scheduler.running}
        victims = running if running and self._consecutive_failures == 1 else set(self.engine.requests)
        error = RequestError(f"internal engine error (log reference {ref})", 500)
        for rid in victims:
            stream = self._engine_abort(rid, "abort %s after a failed step failed")
            if stream is not None:
                self._fail(stream, error)

    def _abort_everything(self) -> None:
        for rid in list(self.engine.requests):
            self._abort(rid, notify=True)
        with self._cv:
            leftovers = list(self._streams.values())
        for stream in leftovers:  # submitted but never added
            self._fail(stream, RequestError("the engine shut down", 503))

    def _engine_abort(self, request_id: str, failure_msg: str) -> _Stream | None:
        """Abort in the LLMEngine (a failure is logged, not raised); the request's stream, if any."""
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception(failure_msg, request_id)
        return self._stream_of(request_id)

    def _stream_of(self, request_id: str) -> _Stream | None:
        with self._cv:
            return self._streams.get(request_id)

    # ---------------------------------------------------------------- delivery
    def _deliver(self, stream: _Stream, out: RequestOutput) -> None:
        self._observe(stream, out)
        stream.last = out
        if out.finished:
            self._forget(stream.request_id)
        self._put(stream, out)

    def _fail(self, stream: _Stream, error: RequestError) -> None:
        self._forget(stream.request_id)
        self._put(stream, error)

    def _put(self, stream: _Stream, item: RequestOutput | BaseException) -> None:
        if stream.cancelled:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put, item)
        except RuntimeError:  # the caller's event loop is closed: nobody will ever read this
            stream.cancelled = True
            if self.engine.requests.get(stream.request_id) is not None:
                self.engine.abort(stream.request_id)
            self._forget(stream.request_id)

    def _observe(self, stream: _Stream, out: RequestOutput) -> None:
        if self.observer is None:
            return
        try:
            self.observer.on_output(out, first=stream.last is None)
        except Exception:  # metrics must never take a request down
            log.exception("metrics observer failed")

    def _forget(self, request_id: str) -> None:
        with self._cv:
            self._streams.pop(request_id, None)

    def _publish_stats(self, drained_adds: int) -> None:
        stats = self.engine.stats()
        with self._cv:
            self._stats = stats
            self._num_pending_adds -= drained_adds


def _aborted_output(stream: _Stream, now: float) -> RequestOutput:
    """The final output of a request aborted by the server: what was produced, "abort"."""
    last = stream.last
    if last is None:
        ids = stream.prompt_token_ids or []
        comps = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(stream.n)]
        metrics = RequestMetrics(arrival_time=stream.arrival_time, finished_time=now, num_prompt_tokens=len(ids))
        return RequestOutput(stream.request_id, None, ids, comps, True, metrics)
    comps = [dataclasses.replace(c, finish_reason=c.finish_reason or "abort", delta_text="", delta_token_ids=[])
             for c in last.outputs]
    if stream.delta:  # nothing new since the last output
        comps = [dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                     top_logprobs=None if c.top_logprobs is None else []) for c in comps]
    metrics = dataclasses.replace(last.metrics, finished_time=now)
    return dataclasses.replace(last, outputs=comps, finished=True, metrics=metrics)
