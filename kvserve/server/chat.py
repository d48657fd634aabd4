"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

Streaming follows OpenAI's chunk sequence per choice: a first delta carrying the role (sent
with the first output, so it does not pose as an early first token), content deltas, and a
final chunk with the finish_reason.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestError, RequestStream
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.loading.chat_template import ChatTemplateError
from kvserve.server.errors import APIError, error_body, from_request_error
from kvserve.server.logprobs import chat_logprobs, delta_logprobs, prompt_logprobs_wire
from kvserve.server.params import check_context, check_logit_bias, sampling_params
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from kvserve.reasoning import ReasoningSplitter, opens_reasoning
from kvserve.server.state import Job, ServerState
from kvserve.server.streams import DONE, SSEResponse, sse, unless_disconnected
from kvserve.server.structured import compile_constraint, constraint_of
from kvserve.server.tool_parsers import CallDelta, ToolParser
from kvserve.server.tools import ToolPlan, check_tool_schemas, message_dict, plan_tools

OFF_LOOP_CHARS = 64 * 1024  # conversations longer than this render in a worker thread


@dataclass
class _Job(Job):
    id_prefix = "chatcmpl"
    req: ChatCompletionRequest
    tools: ToolPlan = field(default_factory=lambda: ToolPlan("none"))
    reasoning: bool = False  # the server splits <think> blocks off (--reasoning-parser)
    opens_reasoning: bool = False  # ... and this prompt leaves the model inside one

    def new_splitter(self) -> ReasoningSplitter | None:
        return ReasoningSplitter(in_reasoning=self.opens_reasoning) if self.reasoning else None

    def logprobs(self, token_ids: list[int], lps: list, tops: list) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.state.tokenizer, token_ids, lps, tops, self.req.top_logprobs or 0)


async def create_chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    arrival = state.engine.clock()
    state.check_model(req.model)
    rename = {"max_tokens": req.max_tokens_field, "logprobs": "top_logprobs"}
    state.limits.check(req.n, req.stop, req.stop_token_ids)
    constraint = constraint_of(req)
    tools = plan_tools(req, state.tool_parser, constraint)
    constraint = tools.constraint or constraint
    params = sampling_params(req, req.max_new_tokens, (req.top_logprobs or 0) if req.logprobs else None, rename,
                             structured=constraint.params if constraint else None)
    check_logit_bias(params, state.vocab_size)
    state.admit(req.n)  # before rendering and tokenizing
    await check_tool_schemas(req, tools)
    if constraint is not None:
        await compile_constraint(state, constraint)
    ids, prompt = await _prompt_ids(state, req, tools)
    check_context(len(ids), params.max_tokens, state.max_model_len, "messages", req.max_tokens_field)
    params.max_tokens = state.limits.default_max_tokens(params.max_tokens, len(ids), state.max_model_len,
                                                        params.min_tokens)
    # (where the prompt opens a block, the engine starts a constrained request's grammar after it)
    job = _Job(state, req, params, arrival, tools=tools, reasoning=state.reasoning_parser is not None,
               opens_reasoning=opens_reasoning(prompt))
    try:
        stream = state.engine.generate(ids, params, job.id, job.arrival_time, cache_salt=req.cache_salt,
                                       deadline=job.arrival_time + state.limits.request_timeout)
    except (ValueError, RequestError) as e:
        raise APIError(getattr(e, "status", 400), str(e)) from None
    if req.stream:
        return SSEResponse(_stream(job, stream), [stream])
    final = await unless_disconnected(request, _collect(stream))
    return Response(_response(job, final).model_dump_json(), media_type="application/json")


def render_messages(state: ServerState, req: ChatCompletionRequest, tools: ToolPlan | None = None) -> str:
    messages = [message_dict(m) for m in req.messages]
    try:
        return state.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                          continue_final_message=req.continue_final_message,
                                          template_kwargs=req.chat_template_kwargs,
                                          tools=tools.template_tools if tools else None)
    except ChatTemplateError as e:
        message = str(e) if str(e).startswith(e.field) else f"{e.field}: {e}"
        raise APIError(400, message, e.field, "invalid_messages") from None


async def _prompt_ids(state: ServerState, req: ChatCompletionRequest, tools: ToolPlan) -> tuple[list[int], str]:
    """The rendered conversation's token ids, and its text."""
    # Rendering is a Jinja template over every message: off the event loop for long conversations.
    many = sum(len(m.text) for m in req.messages) > OFF_LOOP_CHARS or len(req.messages) > 64
    text = await asyncio.to_thread(render_messages, state, req, tools) if many else \
        render_messages(state, req, tools)
    # The rendered text already starts with the template's BOS: add no special tokens again.
    ids = await state.engine.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "messages render to an empty prompt", "messages", "invalid_messages")
    return ids, text


async def _collect(stream: RequestStream) -> RequestOutput:
    try:
        async for out in stream:
            if out.finished:
                return out
    except RequestError as e:
        raise from_request_error(e) from None
    raise APIError(500, "the request ended without a final output", None, "engine_error")


def _response(job: _Job, out: RequestOutput) -> ChatCompletionResponse:
    choices = [_choice(job, c) for c in out.outputs]
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                                  usage=_usage(out), prompt_logprobs=prompt_logprobs_wire(out.prompt_logprobs))


def _choice(job: _Job, c: CompletionOutput) -> ChatChoice:
    """One choice of a whole response: its text, or its reasoning and the content and tool calls
    parsed from the rest (by the splitter and parser a stream uses, fed the whole text at once: the
    stream reassembles to this)."""
    content, calls, reasoning = c.text, None, None
    splitter = job.new_splitter()
    if splitter is not None:
        reasoning, content = splitter.split(c.text)
        reasoning = reasoning if splitter.saw_reasoning else None
    parser = job.tools.new_parser()
    if parser is not None:
        content = parser.feed(content)[0] + parser.finish()[0]
        calls = [ToolCall(id=p.id, function=FunctionCall(name=p.name, arguments=p.arguments))
                 for p in _kept_calls(job, parser.calls)] or None
    if parser is not None or reasoning is not None:
        content = content or None
    message = AssistantMessage(content=content, tool_calls=calls, reasoning=reasoning, reasoning_content=reasoning)
    return ChatChoice(index=c.index, message=message,
                      logprobs=job.logprobs(c.token_ids, c.logprobs or [], c.top_logprobs or []),
                      finish_reason=_finish_reason(c.finish_reason, bool(calls)), stop_reason=c.stop_reason)


def _kept_calls(job: _Job, calls: list) -> list:
    """parallel_tool_calls false: the first call only."""
    return calls if job.tools.parallel else calls[:1]


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _usage(out: RequestOutput) -> Usage:
    return Usage.of(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)


async def _stream(job: _Job, stream: RequestStream) -> AsyncIterator[str]:
    include_usage = job.include_usage
    started: set[int] = set()
    done: set[int] = set()
    parsers: dict[int, ToolParser | None] = {}
    splitters: dict[int, ReasoningSplitter | None] = {}
    final: RequestOutput | None = None
    num_output_tokens = 0  # the outputs carry only what is new: count as they come
    try:
        async for out in stream:
            num_output_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
            for c in out.outputs:
                if c.index not in parsers:
                    parsers[c.index] = job.tools.new_parser()
                    splitters[c.index] = job.new_splitter()
                for choice in _choice_deltas(job, c, started, done, parsers[c.index], splitters[c.index]):
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


def _choice_deltas(job: _Job, c: CompletionOutput, started: set[int], done: set[int],
                   parser: ToolParser | None = None, splitter: ReasoningSplitter | None = None
                   ) -> list[ChatChunkChoice]:
    """The chunks one output contributes for one choice: role first, then reasoning (through
    the choice's splitter), content (or tool call pieces, through its parser)/finish."""
    if c.index in done:
        return []
    out: list[ChatChunkChoice] = []
    if c.index not in started:
        started.add(c.index)
        out.append(ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content="")))
    content, calls, finish_reason, reasoning = c.delta_text, None, c.finish_reason, ""
    if splitter is not None:
        reasoning, content = splitter.feed(c.delta_text)
        if c.finished:
            more, rest = splitter.finish()
            reasoning, content = reasoning + more, content + rest
    if parser is not None:
        content, deltas = parser.feed(content)
        if c.finished:
            more, rest = parser.finish()
            content, deltas = content + more, deltas + rest
        calls = [_call_delta(d) for d in deltas if job.tools.parallel or d.index == 0] or None
        if c.finished:
            finish_reason = _finish_reason(c.finish_reason, bool(parser.calls))
    want_lp = job.req.logprobs and c.delta_token_ids
    if content or calls or reasoning or c.finished or want_lp:
        lps, tops = delta_logprobs(c)
        delta = Delta(content=content or None, tool_calls=calls, reasoning=reasoning or None,
                      reasoning_content=reasoning or None)
        out.append(ChatChunkChoice(index=c.index, delta=delta,
                                   logprobs=job.logprobs(c.delta_token_ids, lps, tops),
                                   finish_reason=finish_reason, stop_reason=c.stop_reason))
    if c.finished:
        done.add(c.index)
    return out


def _call_delta(d: CallDelta) -> ToolCallDelta:
    """OpenAI's shape: the first piece of a call has its id, type and name (and arguments "")."""
    if d.id is not None:
        return ToolCallDelta(index=d.index, id=d.id, type="function",
                             function=FunctionCallDelta(name=d.name, arguments=d.arguments))
    return ToolCallDelta(index=d.index, function=FunctionCallDelta(arguments=d.arguments))


def _drop_nones(obj: dict) -> None:
    for k in [k for k, v in obj.items() if v is None]:
        del obj[k]
    for v in obj.values():
        if isinstance(v, dict):
            _drop_nones(v)


def _chunk(job: _Job, choices: list[ChatChunkChoice], include_usage: bool, usage: Usage | None = None) -> dict:
    chunk = ChatCompletionChunk(id=job.id, created=job.created, model=job.state.model_name, choices=choices,
                                usage=usage)
    body = chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"})
    for choice in body["choices"]:  # a delta carries only what it adds
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        for call in choice["delta"].get("tool_calls", []):
            _drop_nones(call)
    return body
