"""POST /v1/completions: one prompt or a batch, streamed as SSE or returned whole.

Choice indices follow OpenAI for a batch of prompts: prompt i, sample j -> i * n + j.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestError, RequestStream
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server.errors import APIError, error_body, from_request_error
from kvserve.server.logprobs import completion_logprobs, delta_logprobs
from kvserve.server.params import check_context, sampling_params
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from kvserve.server.state import Job, ServerState
from kvserve.server.streams import DONE, SSEResponse, merge, sse, unless_disconnected


@dataclass
class _Job(Job):
    id_prefix = "cmpl"
    req: CompletionRequest

    def choice(self, prompt_index: int, c: CompletionOutput, text: str, token_ids: list[int],
               logprobs: list, top: list, offset: int) -> CompletionChoice:
        lp = None
        if self.req.logprobs is not None:
            lp = completion_logprobs(self.state.tokenizer, token_ids, logprobs, top, offset)
        return CompletionChoice(index=prompt_index * self.req.n + c.index, text=text, logprobs=lp,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)


async def create_completion(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    arrival = state.engine.clock()
    state.check_model(req.model)
    state.limits.check(req.n, req.stop, req.stop_token_ids, num_prompts=len(req.prompts))
    params = sampling_params(req, req.max_tokens, req.logprobs)
    state.admit(len(req.prompts) * req.n)  # before tokenizing: a request refused costs nothing
    prompts = [await _tokenize(state, p) for p in req.prompts]
    for ids in prompts:
        check_context(len(ids), params.max_tokens, state.max_model_len, "prompt", "max_tokens")
    if params.max_tokens is None:  # an explicit null: the server default, within every prompt's room
        params.max_tokens = min(state.limits.default_max_tokens(None, len(ids), state.max_model_len, params.min_tokens)
                                for ids in prompts)
    job = _Job(state, req, params, arrival)
    streams = _submit(state, job, prompts)
    if req.stream:
        return SSEResponse(_stream(job, streams), streams)
    finals = await unless_disconnected(request, _collect(streams))
    return Response(_response(job, finals).model_dump_json(), media_type="application/json")


async def _tokenize(state: ServerState, prompt: str | list[int]) -> list[int]:
    try:
        return await state.engine.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e), "prompt", "invalid_prompt") from None


def _submit(state: ServerState, job: _Job, prompts: list[list[int]]) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompts):
            streams.append(state.engine.generate(ids, job.params, f"{job.id}-{i}", job.arrival_time,
                                                 cache_salt=job.req.cache_salt,
                                                 deadline=job.arrival_time + state.limits.request_timeout))
    except (ValueError, RequestError) as e:
        for s in streams:
            s.close()
        raise APIError(getattr(e, "status", 400), str(e)) from None
    return streams


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge(streams):
            if out.finished:
                finals[i] = out
    except RequestError as e:
        raise from_request_error(e) from None
    return finals  # type: ignore[return-value]


def _response(job: _Job, finals: list[RequestOutput]) -> CompletionResponse:
    choices = [job.choice(i, c, c.text, c.token_ids, c.logprobs or [], c.top_logprobs or [], 0)
               for i, out in enumerate(finals) for c in out.outputs]
    return CompletionResponse(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                              usage=_usage(finals))


def _usage(finals: list[RequestOutput]) -> Usage:
    return Usage.of(sum(len(o.prompt_token_ids) for o in finals),
                    sum(len(c.token_ids) for o in finals for c in o.outputs),
                    sum(o.num_cached_tokens for o in finals))


async def _stream(job: _Job, streams: list[RequestStream]) -> AsyncIterator[str]:
    req = job.req
    include_usage = job.include_usage
    offsets: dict[int, int] = {}  # choice index -> characters streamed (logprobs text_offset)
    done: set[int] = set()
    num_prompt_tokens = num_output_tokens = num_cached_tokens = 0
    try:
        async for i, out in merge(streams):
            num_output_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
            for c in out.outputs:
                idx = i * req.n + c.index
                if idx in done or not (c.delta_text or c.finished or (req.logprobs is not None and c.delta_token_ids)):
                    continue
                lps, tops = delta_logprobs(c)
                choice = job.choice(i, c, c.delta_text, c.delta_token_ids, lps, tops, offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(c.delta_text)
                if c.finished:
                    done.add(idx)
                yield sse(_chunk(job, [choice], include_usage))
            if out.finished:
                num_prompt_tokens += len(out.prompt_token_ids)
                num_cached_tokens += out.num_cached_tokens
    except RequestError as e:
        err = from_request_error(e)
        yield sse(error_body(err.message, err.status, err.param, err.code))
        yield DONE
        return
    if include_usage:
        yield sse(_chunk(job, [], include_usage, Usage.of(num_prompt_tokens, num_output_tokens, num_cached_tokens)))
    yield DONE


def _chunk(job: _Job, choices: list[CompletionChoice], include_usage: bool, usage: Usage | None = None) -> dict:
    chunk = CompletionResponse(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                               usage=usage)
    return chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"})
