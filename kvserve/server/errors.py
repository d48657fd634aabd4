"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause ends here as a 4xx naming the offending field (`param`), so
the OpenAI SDKs raise their usual typed exceptions (BadRequestError, AuthenticationError, ...)
with a message that says what to fix. Only our own bugs are 5xx.
"""
from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.async_engine import RequestError
from kvserve.server.protocol import FieldError

log = logging.getLogger(__name__)

# pydantic puts the union member it tried into the error location ("str", "list[int]", ...);
# those are not fields and do not belong in `param`.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}
MAX_MESSAGES = 4  # of one failing field's errors, in its 400


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(error_body(err.message, err.status, err.param, err.code), err.status, headers=headers)


def _loc_to_param(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role' (union member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() in _TYPE_TAGS or re.search(r"[\[\-(]", part):
            continue
        else:
            out += f".{part}" if out else part
    return out


def from_validation_error(exc: ValidationError) -> APIError:
    """The first failing field as `param`; the message lists what pydantic said about it and
    about its sub-fields (a union reports each alternative: "a string; or a list of ...")."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = _param_of(first)
    if first["type"] == "missing":
        return APIError(400, f"{param}: field required", param, "missing_field")
    msgs: dict[str, None] = {}  # ordered, and O(1) to test: a body can fail thousands of times
    for e in errors:
        p = _param_of(e)
        if p == param or p.startswith((param + "[", param + ".")):
            msgs.setdefault(_message_of(e, p))
            if len(msgs) == MAX_MESSAGES:
                break
    text = "; or ".join(msgs) + (" (further errors not shown)" if len(msgs) == MAX_MESSAGES else "")
    return APIError(400, text, param or None, "invalid_value")


def unknown_field_error(param: str) -> APIError:
    """A field no request model declares, refused under --strict-requests."""
    return APIError(400, f"{param}: unknown field (not an OpenAI or kvserve parameter; this server refuses "
                         f"unknown fields: --strict-requests)", param, "unknown_field")


def _param_of(err: dict) -> str:
    base = _loc_to_param(err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return f"{base}.{cause.field}" if base else cause.field
    return base


def _message_of(err: dict, param: str) -> str:
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # its text already starts with the field's own name
        prefix = param.removesuffix(cause.field)
        return prefix + str(cause)
    msg = err["msg"]
    if "input" in err and err["type"].endswith("_type"):
        msg += f", got {type(err['input']).__name__}"
    return f"{param}: {msg}" if param else msg


def from_value_error(exc: ValueError, fields: tuple[str, ...]) -> APIError:
    """SamplingParams / tokenizer errors start with the field they are about."""
    msg = str(exc)
    head = msg.split(" ", 1)[0]
    param = head if head in fields else None
    return APIError(400, msg, param, "invalid_value")


def from_request_error(exc: RequestError) -> APIError:
    return APIError(exc.status, str(exc), None, "engine_error" if exc.status >= 500 else "invalid_request")


def install_handlers(app) -> None:
    """Map every exception to the OpenAI shape, including Starlette's own 404/405 and bugs."""

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, exc.status_code, None, code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", 500, None, "internal_error"),
                            500)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
