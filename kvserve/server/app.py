"""The FastAPI app: OpenAI routes plus /health, /metrics, /stats and the playground page.

`build_app(engine, served_model_name, ...)` wires the pieces: an AsyncLLMEngine (started and
stopped with the app's lifespan), Prometheus metrics on a registry of this app's own, the
model's chat template, the gateway (auth, body limit, drain) and OpenAI-shaped errors.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.body import parse_body
from kvserve.server.chat import create_chat_completion
from kvserve.loading.chat_template import ChatTemplate, TemplateSource, chat_template_for
from kvserve.server.completions import create_completion
from kvserve.server.embeddings import create_embedding
from kvserve.server.errors import APIError, error_body, install_handlers
from kvserve.server.gateway import Gateway
from kvserve.server.limits import RequestLimits
from kvserve.server.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.server.state import ServerState
from kvserve.server.tokenize import detokenize, tokenize, tokenizer_info
from kvserve.server.tool_parsers import PARSERS, parser_for_template

log = logging.getLogger(__name__)
DEFAULT_MAX_QUEUE = 1024  # waiting requests before 429; well past what a CPU drains in minutes
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a full 32k-token prompt, as text or as token ids, is < 1 MiB
STATIC = Path(__file__).parent / "static"
_PLACEHOLDER = ("<!doctype html><title>kvserve</title><h1>kvserve</h1><p>OpenAI-compatible API at "
                "<code>/v1</code>; <a href='/v1/models'>/v1/models</a>, <a href='/stats'>/stats</a>, "
                "<a href='/metrics'>/metrics</a>.</p>")


def build_app(engine: AsyncLLMEngine | LLMEngine, served_model_name: str, api_key: str | None = None,
              max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              limits: RequestLimits | None = None, protect_metrics: bool = False,
              allowed_hosts: list[str] | None = None, body_timeout: float = 60.0,
              chat_template: TemplateSource | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """`chat_template`: the template chats render with instead of the model's (--chat-template).
    `tool_call_parser`: the format of the model's tool calls for tool_choice "auto" (hermes,
    llama3_json); None: the one its chat template defines, if any; "none": no auto tool calls.
    The engine's `reasoning_parser` (EngineConfig) also sets apart the reasoning of chat responses.
    `engine` may also be a replica set (kvserve/server/replicas/pool.py), which offers what the
    routes use of an AsyncLLMEngine."""
    async_engine = AsyncLLMEngine(engine) if isinstance(engine, LLMEngine) else engine
    metrics = ServerMetrics(async_engine.stats, served_model_name)
    if async_engine.observer is None:
        async_engine.observer = metrics
    core = async_engine.engine
    template = chat_template_for(core.model_config, core.tokenizer, chat_template)
    state = ServerState(async_engine, served_model_name, template,
                        metrics, api_key, max_queue, max_body_bytes, limits or RequestLimits(),
                        protect_ops=protect_metrics, body_timeout=body_timeout,
                        tool_parser=resolve_tool_parser(tool_call_parser, template),
                        reasoning_parser=_reasoning_parser(core))
    if protect_metrics and api_key is None:
        raise ValueError("--protect-metrics needs an API key (--api-key, --api-key-file or KVSERVE_API_KEY)")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.kvserve = state
    install_handlers(app)
    app.add_middleware(Gateway, state=state)
    if allowed_hosts:  # DNS rebinding: a page on another site resolving its name to this address
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    _add_api_routes(app, state)
    _add_ops_routes(app, state)
    return app


def resolve_tool_parser(name: str | None, template: ChatTemplate) -> str | None:
    """The tool-call parser to use: the one named, or the template's own format (logged)."""
    if name == "none":
        return None
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)} or none, got {name!r}")
        return name
    found = None if template.is_default else parser_for_template(template.source)
    log.info("tool calls: %s", f"the chat template's {found} format" if found else
             "the chat template defines no format; tool_choice 'required' and named functions still work")
    return found


def _reasoning_parser(core) -> str | None:
    """The engine's reasoning format, which chat responses set apart (logged)."""
    name = core.reasoning_parser
    if name is not None:
        log.info("reasoning: <think> blocks (%s) go to chat responses' reasoning field", name)
    return name


def _add_api_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, state.limits)
        return await _guarded(request, create_completion(state, request, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, state.limits)
        return await _guarded(request, create_chat_completion(state, request, body))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await parse_body(request, EmbeddingRequest, state.limits)
        return await _guarded(request, create_embedding(state, request, body))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> TokenizeResponse:
        return await tokenize(state, await parse_body(request, TokenizeRequest, state.limits))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> DetokenizeResponse:
        return await detokenize(state, await parse_body(request, DetokenizeRequest, state.limits))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        return tokenizer_info(state)

    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        state.check_model(model_id)
        return card()


async def _guarded(request: Request, work: Awaitable[Response]) -> Response:
    """A bug in a handler still gets an OpenAI-shaped 500 answered here: Starlette's outermost
    handler would answer too, but then re-raise, and uvicorn drops the connection."""
    try:
        return await work
    except (APIError, StarletteHTTPException):
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}: {e}", 500, None,
                                       "internal_error"), 500)


def _add_ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse(error_body("the server is shutting down", 503, None, "shutting_down"), 503)
        if not state.engine.is_running:
            return JSONResponse(error_body("the engine loop is not running", 503, None, "engine_dead"), 503)
        if not state.engine.healthy:
            return JSONResponse(error_body("the engine is unhealthy: its last steps failed", 503, None,
                                           "engine_unhealthy"), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats() -> dict:
        """Engine counters for the playground: running/waiting, KV usage, prefix cache, ..."""
        return {**state.engine.stats(), "model": state.model_name, "max_model_len": state.max_model_len,
                "num_http_inflight": state.inflight, "draining": state.draining}

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        page = STATIC / "index.html"
        return FileResponse(page) if page.is_file() else HTMLResponse(_PLACEHOLDER)
