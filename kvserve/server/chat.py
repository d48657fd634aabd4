"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

Streaming follows OpenAI's chunk sequence per choice: a first delta carrying the role (sent
with the first output, so it does not pose as an early first token), content deltas, and a
final chunk with the finish_reason.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestError, RequestStream
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.loading.chat_template import ChatTemplateError
from kvserve.server.errors import APIError, error_body, from_request_error
from kvserve.server.logprobs import chat_logprobs, delta_logprobs
from kvserve.server.params import check_context, sampling_params
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    Usage,
)
from kvserve.server.state import Job, ServerState
from kvserve.server.streams import DONE, SSEResponse, sse, unless_disconnected

OFF_LOOP_CHARS = 64 * 1024  # conversations longer than this render in a worker thread


@dataclass
class _Job(Job):
    id_prefix = "chatcmpl"
    req: ChatCompletionRequest

    def logprobs(self, token_ids: list[int], lps: list, tops: list) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.state.tokenizer, token_ids, lps, tops, self.req.top_logprobs or 0)


async def create_chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    arrival = state.engine.clock()
    state.check_model(req.model)
    rename = {"max_tokens": req.max_tokens_field, "logprobs": "top_logprobs"}
    state.limits.check(req.n, req.stop, req.stop_token_ids)
    params = sampling_params(req, req.max_new_tokens, (req.top_logprobs or 0) if req.logprobs else None, rename)
    state.admit(req.n)  # before rendering and tokenizing
    ids = await _prompt_ids(state, req)
    check_context(len(ids), params.max_tokens, state.max_model_len, "messages", req.max_tokens_field)
    params.max_tokens = state.limits.default_max_tokens(params.max_tokens, len(ids), state.max_model_len,
                                                        params.min_tokens)
    job = _Job(state, req, params, arrival)
    try:
        stream = state.engine.generate(ids, params, job.id, job.arrival_time, cache_salt=req.cache_salt,
                                       deadline=job.arrival_time + state.limits.request_timeout)
    except (ValueError, RequestError) as e:
        raise APIError(getattr(e, "status", 400), str(e)) from None
    if req.stream:
        return SSEResponse(_stream(job, stream), [stream])
    final = await unless_disconnected(request, _collect(stream))
    return Response(_response(job, final).model_dump_json(), media_type="application/json")


def render_messages(state: ServerState, req: ChatCompletionRequest) -> str:
    # "developer" is OpenAI's new name for "system"; model templates only know the latter.
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text,
                 **({"name": m.name} if m.name else {})} for m in req.messages]
    try:
        return state.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                          continue_final_message=req.continue_final_message,
                                          template_kwargs=req.chat_template_kwargs)
    except ChatTemplateError as e:
        message = str(e) if str(e).startswith(e.field) else f"{e.field}: {e}"
        raise APIError(400, message, e.field, "invalid_messages") from None


async def _prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    # Rendering is a Jinja template over every message: off the event loop for long conversations.
    many = sum(len(m.text) for m in req.messages) > OFF_LOOP_CHARS or len(req.messages) > 64
    text = await asyncio.to_thread(render_messages, state, req) if many else render_messages(state, req)
    # The rendered text already starts with the template's BOS: add no special tokens again.
    ids = await state.engine.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "messages render to an empty prompt", "messages", "invalid_messages")
    return ids


async def _collect(stream: RequestStream) -> RequestOutput:
    try:
        async for out in stream:
            if out.finished:
                return out
    except RequestError as e:
        raise from_request_error(e) from None
    raise APIError(500, "the request ended without a final output", None, "engine_error")


def _response(job: _Job, out: RequestOutput) -> ChatCompletionResponse:
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=job.logprobs(c.token_ids, c.logprobs or [], c.top_logprobs or []),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in out.outputs]
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                                  usage=_usage(out))


def _usage(out: RequestOutput) -> Usage:
    return Usage.of(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)


async def _stream(job: _Job, stream: RequestStream) -> AsyncIterator[str]:
    include_usage = job.include_usage
    started: set[int] = set()
    done: set[int] = set()
    final: RequestOutput | None = None
    num_output_tokens = 0  # the outputs carry only what is new: count as they come
    try:
        async for out in stream:
            num_output_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
            for c in out.outputs:
                for choice in _choice_deltas(job, c, started, done):
                    yield sse(_chunk(job, [choice], include_usage))
            if out.finished:
                final = out
    except RequestError as e:
        err = from_request_error(e)
        yield sse(error_body(err.message, err.status, err.param, err.code))
        yield DONE
        return
    if include_usage and final is not None:
        yield sse(_chunk(job, [], include_usage, Usage.of(len(final.prompt_token_ids), num_output_tokens,
                                                          final.num_cached_tokens)))
    yield DONE


def _choice_deltas(job: _Job, c: CompletionOutput, started: set[int], done: set[int]) -> list[ChatChunkChoice]:
    """The chunks one output contributes for one choice: role first, then content/finish."""
    if c.index in done:
        return []
    out: list[ChatChunkChoice] = []
    if c.index not in started:
        started.add(c.index)
        out.append(ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content="")))
    want_lp = job.req.logprobs and c.delta_token_ids
    if c.delta_text or c.finished or want_lp:
        lps, tops = delta_logprobs(c)
        out.append(ChatChunkChoice(index=c.index, delta=Delta(content=c.delta_text or None),
                                   logprobs=job.logprobs(c.delta_token_ids, lps, tops),
                                   finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    if c.finished:
        done.add(c.index)
    return out


def _chunk(job: _Job, choices: list[ChatChunkChoice], include_usage: bool, usage: Usage | None = None) -> dict:
    chunk = ChatCompletionChunk(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                                usage=usage)
    body = chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"})
    for choice in body["choices"]:  # a delta carries only what it adds
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return body
