"""POST /v1/completions: one prompt or a batch, streamed as SSE or returned whole.

Choice indices follow OpenAI for a batch of prompts: prompt i, sample j -> i * n + j.

`echo` puts the prompt before each choice's text; with `logprobs` also its tokens' logprobs
(the first token's null, as OpenAI and vLLM report it), computed by the engine as vLLM's
`prompt_logprobs`. `max_tokens` 0 with echo returns the prompt alone (what lm-evaluation-harness
scores loglikelihoods with): one token is generated and dropped, as vLLM does.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestError, RequestStream
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.server.errors import APIError, error_body, from_request_error
from kvserve.server.logprobs import completion_logprobs, delta_logprobs, prompt_logprobs_wire
from kvserve.server.params import check_context, check_logit_bias, sampling_params
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from kvserve.server.state import Job, ServerState
from kvserve.server.streams import DONE, SSEResponse, collect_finals, merge, sse, submit_each, unless_disconnected
from kvserve.server.structured import compile_constraint, constraint_of


@dataclass
class _Echo:
    """What echo puts before a choice: the prompt's text, tokens and their logprobs (None for
    the first token, and for all without logprobs) with their top alternatives."""

    text: str
    token_ids: list[int]
    logprobs: list[float | None]
    top: list[dict[int, float] | None]


@dataclass
class _Job(Job):
    id_prefix = "cmpl"
    req: CompletionRequest

    def choice(self, prompt_index: int, c: CompletionOutput, text: str, token_ids: list[int],
               logprobs: list, top: list, offset: int, echo: _Echo | None = None,
               out: RequestOutput | None = None) -> CompletionChoice:
        finish_reason, stop_reason = c.finish_reason, c.stop_reason
        if self.req.echo_only:  # the generated token is dropped: the prompt alone
            text, token_ids, logprobs, top = "", [], [], []
            finish_reason, stop_reason = ("length" if c.finish_reason else None), None
        if echo is not None:
            text, token_ids = echo.text + text, echo.token_ids + token_ids
            logprobs, top = echo.logprobs + logprobs, echo.top + top
        lp = None
        if self.req.logprobs is not None:
            lp = completion_logprobs(self.state.tokenizer, token_ids, logprobs, top, offset)
        plp = None
        if self.req.prompt_logprobs is not None and out is not None:
            plp = prompt_logprobs_wire(out.prompt_logprobs)
        return CompletionChoice(index=prompt_index * self.req.n + c.index, text=text, logprobs=lp,
                                finish_reason=finish_reason, stop_reason=stop_reason, prompt_logprobs=plp)

    def echo(self, prompt_index: int, out: RequestOutput) -> _Echo | None:
        """The prompt as echo shows it: as sent when it was text, else decoded."""
        if not self.req.echo:
            return None
        prompt = self.req.prompts[prompt_index]
        ids = list(out.prompt_token_ids)
        text = prompt if isinstance(prompt, str) else self.state.tokenizer.decode(ids, skip_special_tokens=False)
        plp = out.prompt_logprobs
        if plp is None:  # echo without logprobs: text only
            return _Echo(text, ids, [None] * len(ids), [None] * len(ids))
        keep = (self.req.logprobs or 0) + 1  # the prompt token and the top-N, as for sampled tokens
        lps = [None] + [entry[t].logprob for t, entry in zip(ids[1:], plp[1:])]
        top = [None] + [dict(itertools.islice(((k, v.logprob) for k, v in entry.items()), keep))
                        for entry in plp[1:]]
        return _Echo(text, ids, lps, top)


async def create_completion(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    arrival = state.engine.clock()
    state.check_model(req.model)
    state.limits.check(req.n, req.stop, req.stop_token_ids, num_prompts=len(req.prompts))
    echo_logprobs = req.logprobs if req.echo and req.prompt_logprobs is None else None
    constraint = constraint_of(req)
    params = sampling_params(req, 1 if req.echo_only else req.max_tokens, req.logprobs,
                             prompt_logprobs=echo_logprobs, structured=constraint.params if constraint else None)
    check_logit_bias(params, state.vocab_size)
    state.admit(len(req.prompts) * req.n)  # before tokenizing: a request refused costs nothing
    if constraint is not None:  # a constraint that cannot compile: a 400 now, not a failed stream
        await compile_constraint(state, constraint)
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
    finals = await unless_disconnected(request, collect_finals(streams))
    return Response(_response(job, finals).model_dump_json(), media_type="application/json")


async def _tokenize(state: ServerState, prompt: str | list[int]) -> list[int]:
    try:
        return await state.engine.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e), "prompt", "invalid_prompt") from None


def _submit(state: ServerState, job: _Job, prompts: list[list[int]]) -> list[RequestStream]:
    return submit_each(prompts, lambda i, ids: state.engine.generate(
        ids, job.params, f"{job.id}-{i}", job.arrival_time, cache_salt=job.req.cache_salt,
        deadline=job.arrival_time + state.limits.request_timeout))


def _response(job: _Job, finals: list[RequestOutput]) -> CompletionResponse:
    choices = [job.choice(i, c, c.text, c.token_ids, c.logprobs or [], c.top_logprobs or [], 0,
                          job.echo(i, out), out)
               for i, out in enumerate(finals) for c in out.outputs]
    return CompletionResponse(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                              usage=_usage(job, finals))


def _usage(job: _Job, finals: list[RequestOutput]) -> Usage:
    generated = 0 if job.req.echo_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
    return Usage.of(sum(len(o.prompt_token_ids) for o in finals), generated,
                    sum(o.num_cached_tokens for o in finals))


async def _stream(job: _Job, streams: list[RequestStream]) -> AsyncIterator[str]:
    req = job.req
    include_usage = job.include_usage
    offsets: dict[int, int] = {}  # choice index -> characters streamed (logprobs text_offset)
    done: set[int] = set()
    echoes: dict[int, _Echo | None] = {}  # prompt index -> its echo (the first output has its logprobs)
    num_prompt_tokens = num_output_tokens = num_cached_tokens = 0
    try:
        async for i, out in merge(streams):
            if not req.echo_only:
                num_output_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
            for c in out.outputs:
                idx = i * req.n + c.index
                echo = None
                if req.echo and idx not in offsets:  # this choice's first chunk: the prompt first
                    if i not in echoes:
                        echoes[i] = job.echo(i, out)
                    echo = echoes[i]
                elif idx in done or not (c.delta_text or c.finished or (req.logprobs is not None and c.delta_token_ids)):
                    continue
                if idx in done or (req.echo_only and not c.finished):
                    continue
                lps, tops = delta_logprobs(c)
                choice = job.choice(i, c, c.delta_text, c.delta_token_ids, lps, tops, offsets.get(idx, 0), echo)
                offsets[idx] = _end_offset(choice, offsets.get(idx, 0))
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


def _end_offset(choice: CompletionChoice, start: int) -> int:
    """Where the next chunk's text_offset starts: after this chunk's tokens as text_offset counts
    them (so streamed offsets equal a whole response's, an echoed BOS token included)."""
    lp = choice.logprobs
    if lp is None or not lp.tokens:
        return start + len(choice.text)
    return lp.text_offset[-1] + len(lp.tokens[-1])


def _chunk(job: _Job, choices: list[CompletionChoice], include_usage: bool, usage: Usage | None = None) -> dict:
    chunk = CompletionResponse(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                               usage=usage)
    return chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"})
