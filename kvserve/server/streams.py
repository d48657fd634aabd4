"""Plumbing between engine request streams and HTTP: merging, SSE framing, disconnects.

A request the client no longer waits for must stop using the engine: a streaming response
closes its request streams when it ends for any reason (finished, client gone, server
cancelling it), and a non-streaming handler races the generation against the client's
`http.disconnect` and cancels the generation when the client leaves first.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.async_engine import RequestError, RequestStream
from kvserve.engine.outputs import RequestOutput
from kvserve.server.errors import APIError, from_request_error

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
_END = object()


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event in OpenAI's framing: `data: {json}` and a blank line."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests (a batch of prompts) as they come, tagged by position.
    However it ends, every stream is closed (an unfinished request is aborted).

    The hand-over queue is bounded: while the consumer (the client's socket) is stuck, a
    stream's outputs wait merged in its own mailbox, whose backlog limit then applies."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # forwarded: the consumer decides
            await queue.put((i, e))
        await queue.put((i, _END))

    tasks: list[asyncio.Task] = []
    try:
        if len(streams) == 1:  # the common case needs no tasks
            async for out in streams[0]:
                yield 0, out
            return
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


def submit_each(prompts: list[list[int]], submit: Callable[[int, list[int]], RequestStream]) -> list[RequestStream]:
    """One engine request per prompt (`submit(index, ids)`). If the engine refuses one, those
    already submitted are closed (aborted) and the refusal becomes an APIError with its status."""
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompts):
            streams.append(submit(i, ids))
    except (ValueError, RequestError) as e:
        for s in streams:
            s.close()
        raise APIError(getattr(e, "status", 400), str(e)) from None
    return streams


async def collect_finals(streams: list[RequestStream]) -> list:
    """Each request's final output, by position (None where a request ended without one)."""
    finals: list = [None] * len(streams)
    try:
        async for i, out in merge(streams):
            if out.finished:
                finals[i] = out
    except RequestError as e:
        raise from_request_error(e) from None
    return finals


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its engine requests when it ends."""

    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise APIError(499, "client closed the request", None, "client_disconnected")
    finally:
        for t in (task, watcher):
            t.cancel()
        with contextlib.suppress(BaseException):
            await task
