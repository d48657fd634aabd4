"""Admission at the HTTP edge of the API routes (/v1/..., /tokenize, /detokenize,
/tokenizer_info), before any handler runs.

One pure ASGI middleware (not BaseHTTPMiddleware: that one buffers streaming responses
through a task group and hides disconnects) that, for /v1/ requests:
* answers 503 while the server drains for shutdown,
* checks the bearer token when an API key is set (401),
* refuses a body over the limit: at once from Content-Length, and while reading by counting
  the bytes actually received (chunked uploads, lying headers) (413),
* ends an upload that has not finished `body_timeout` seconds after it began (408): a client
  trickling its body holds a connection and a handler,
* counts in-flight requests, streams included, so a drain knows when they are done.
/health and / stay open (probes carry no key); /metrics and /stats too, unless `protect_ops`
(`--protect-metrics`) asks for the API key there as well.
"""
from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import APIError, error_response
from kvserve.server.state import ServerState


class Gateway:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in OPS_PATHS and self.state.protect_ops:
            if not _authorized(dict(scope["headers"]).get(b"authorization", b""), self.state.api_key):
                await error_response(_unauthorized())(scope, receive, send)
                return
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in ROOT_API_PATHS):
            await self.app(scope, receive, send)
            return
        try:
            self._admit(scope)
        except APIError as e:
            await error_response(e)(scope, receive, send)
            return
        self.state.inflight += 1
        try:
            await self.app(scope, _limited(receive, self.state.max_body_bytes, self.state.body_timeout), send)
        finally:
            self.state.inflight -= 1

    def _admit(self, scope: Scope) -> None:
        st = self.state
        if st.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down")
        headers = dict(scope["headers"])
        if st.api_key is not None and not _authorized(headers.get(b"authorization", b""), st.api_key):
            raise _unauthorized()
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                raise APIError(400, f"Content-Length {length.decode('latin-1')!r} is not a number", None,
                               "invalid_header") from None
            if size > st.max_body_bytes:
                raise APIError(413, f"request body of {size} bytes exceeds the limit of {st.max_body_bytes}",
                               None, "request_too_large")


OPS_PATHS = ("/metrics", "/stats")
# vLLM's API routes outside /v1/ (the tokenizer's): admitted like /v1/ ones.
ROOT_API_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def _unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key")


def _authorized(header: bytes, key: str) -> bool:
    scheme, _, token = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _limited(receive: Receive, limit: int, timeout: float) -> Receive:
    """`receive` that fails with 413 once more than `limit` body bytes have arrived, and with 408
    when the body is not complete `timeout` seconds after the first read. Once the body is in,
    later calls (a handler waiting for the client to disconnect) pass through untimed."""
    total = 0
    deadline: float | None = None
    body_done = False
    loop = asyncio.get_running_loop()

    async def wrapped() -> Message:
        nonlocal total, deadline, body_done
        if body_done:
            return await receive()
        if deadline is None:
            deadline = loop.time() + timeout
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)", None,
                           "request_timeout") from None
        body_done = message["type"] != "http.request" or not message.get("more_body", False)
        if message["type"] == "http.request":
            total += len(message.get("body", b""))
            if total > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", None, "request_too_large")
        return message

    return wrapped
