"""Request body -> validated pydantic model, every failure a 4xx naming what is wrong.

Parsed by hand rather than by FastAPI's body injection so that each failure gets its own
clear status and message: wrong Content-Type (415), bytes that are not UTF-8, text that is
not JSON (including NaN/Infinity, which Python's json would accept), JSON that is not an
object or nests deeper than the server allows (400), and pydantic's validation errors (400 with
`param`). Fields no request model declares are ignored with one warning per request naming them
(vLLM's behaviour: clients send parameters of newer API versions), or refused with a 400 naming
the first under `--strict-requests` (`RequestLimits.strict_requests`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from kvserve.server.errors import APIError, from_validation_error, unknown_field_error
from kvserve.server.limits import RequestLimits
from kvserve.server.protocol import unknown_fields

M = TypeVar("M", bound=BaseModel)
OFF_LOOP_BYTES = 64 * 1024  # bodies larger than this are parsed in a worker thread
LOGGED_UNKNOWN = 16  # unknown field names one warning lists (a body can carry thousands)
log = logging.getLogger(__name__)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _check_content_type(request: Request) -> None:
    ctype = request.headers.get("content-type")
    if ctype is None:  # (curl -d sends a form type unless told: -H 'Content-Type: application/json')
        raise APIError(415, "Content-Type must be application/json, and the request has none", None,
                       "unsupported_media_type")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {ctype!r}", None, "unsupported_media_type")


def _check_unicode(obj: dict) -> None:
    """JSON escapes can spell lone surrogates ("\\ud800") that are not text: no tokenizer takes them."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"request body contains an invalid Unicode escape (a lone surrogate, {e.reason})",
                       None, "invalid_encoding") from None


async def parse_body(request: Request, model: type[M], limits: RequestLimits) -> M:
    _check_content_type(request)
    try:
        raw = await request.body()
    except ClientDisconnect:  # the client left mid-upload: nobody to answer, nothing went wrong here
        log.info("client %s disconnected while sending its request body", request.client)
        raise APIError(499, "the client disconnected before its request body arrived", None,
                       "client_disconnected") from None
    if len(raw) > OFF_LOOP_BYTES:  # parsing and validating megabytes takes long enough to stall others
        req = await asyncio.to_thread(_parse, raw, model, limits)
    else:
        req = _parse(raw, model, limits)
    _check_unknown(req, limits.strict_requests, f"{request.method} {request.url.path}")
    return req


def _check_unknown(req: BaseModel, strict: bool, route: str) -> None:
    """Refuse (strict) or log the request's undeclared fields."""
    unknown = unknown_fields(req)
    if not unknown:
        return
    if strict:
        raise unknown_field_error(unknown[0])
    names = ", ".join(repr(name[:64]) for name in unknown[:LOGGED_UNKNOWN])
    more = f" and {len(unknown) - LOGGED_UNKNOWN} more" if len(unknown) > LOGGED_UNKNOWN else ""
    log.warning("%s: ignored unknown request field(s) %s%s (not OpenAI or kvserve parameters; "
                "--strict-requests refuses them)", route, names, more)


def _parse(raw: bytes, model: type[M], limits: RequestLimits) -> M:
    """Bytes -> the validated request model, each failure an APIError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", None, "invalid_encoding") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(obj).__name__}", None, "invalid_json")
    limits.check_depth(obj)  # before anything recurses over it
    _check_unicode(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None
