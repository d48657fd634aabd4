"""Tool calling in /v1/chat/completions: what `tools`, `tool_choice` and `parallel_tool_calls`
ask of the prompt, of the generation and of the response.

- The tools go to the chat template (`tools=`, as transformers' apply_chat_template passes them).
- `tool_choice`:
  - "auto" (the default with tools): the model decides; its output is parsed with the server's
    tool-call parser (`--tool-call-parser`, by default the format the template defines: Hermes
    `<tool_call>` or Llama 3 JSON). A model whose template defines none gets a 400.
  - "none": the tools are in the prompt, the output is plain content.
  - "required": the output is constrained (the structured-output mask) to a JSON array of
    `{"name": ..., "parameters": {...}}` calls of the offered tools (at most one when
    `parallel_tool_calls` is false), whatever the model's own format: any model can call.
    Forced calls are written on one line (no free whitespace).
  - {"type": "function", "function": {"name": ...}}: the output is constrained to that
    function's arguments object, which becomes the call.
- The response carries `tool_calls` (ids `call_...`, arguments as JSON text) and
  finish_reason "tool_calls" when the generation ended with calls.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from kvserve.sampling.structured import GrammarError, build_grammar
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from kvserve.server.structured import Constraint
from kvserve.server.tool_parsers import PARSERS, JsonCallsParser, NamedParser, ToolParser

PARSER_NAMES = tuple(PARSERS)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" (no tools, or tool_choice none) | "auto" | "required" | "named"
    template_tools: list[dict] | None = None  # what the chat template gets as `tools`
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the output's format
    constraint: Constraint | None = None  # required / named: the mask's schema
    parallel: bool = True

    def new_parser(self) -> ToolParser | None:
        """A fresh parser for one choice's output (None: plain content)."""
        if self.mode == "named":
            return NamedParser(self.name)
        if self.mode == "required":
            return JsonCallsParser()
        if self.mode == "auto":
            return PARSERS[self.parser]()
        return None


def _error(param: str, message: str) -> APIError:
    return APIError(400, f"{param} {message}", param, "invalid_value")


def _arguments_schema(parameters: dict | None) -> dict:
    """A function's arguments: its parameters schema, or an object with nothing in it."""
    return parameters if parameters is not None else {"type": "object", "properties": {}}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """A JSON array of calls, each the name of one offered tool and arguments of its schema."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["name"]]},
                             "parameters": _arguments_schema(t.get("parameters"))},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _compact(schema: dict) -> StructuredOutputsParams:
    """Forced calls are JSON on one line (", " and ": " between tokens): arguments are read by
    programs, and free whitespace is where small models wander."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def plan_tools(req: ChatCompletionRequest, parser: str | None, constraint: Constraint | None) -> ToolPlan:
    """The request's tool plan; a 400 naming the field for a choice that cannot be honoured."""
    choice = req.tool_choice
    tools = req.tools
    if tools is not None and not tools:
        raise _error("tools", "must not be empty (leave it out instead)")
    if not tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise _error("tool_choice", "needs tools: the request offers none")
        return ToolPlan("none")
    funcs = [t.function.model_dump(exclude_none=True) for t in tools]
    names = [f["name"] for f in funcs]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise _error(f"tools[{names.index(dup, names.index(dup) + 1)}].function.name",
                     f"repeats the function name {dup!r}")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and constraint is not None:
        raise _error("tool_choice", f"cannot be combined with {constraint.field}: both constrain the output")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise _error("tool_choice.function.name", f"names {name!r}, which is not among the request's tools "
                                                      f"({', '.join(names)})")
        schema = _arguments_schema(funcs[names.index(name)].get("parameters"))
        return ToolPlan("named", template_tools, name=name, parallel=parallel,
                        constraint=Constraint(_compact(schema), "tool_choice"))
    if choice == "required":
        return ToolPlan("required", template_tools, parallel=parallel,
                        constraint=Constraint(_compact(required_schema(funcs, parallel)), "tool_choice"))
    if choice == "none":
        return ToolPlan("none", template_tools)
    if parser is None:
        raise _error("tool_choice", "'auto' needs a tool-call format, and this model's chat template defines "
                                    "none: ask for tool_choice 'required' or a named function (any model can "
                                    "call through them), or start the server with --tool-call-parser")
    return ToolPlan("auto", template_tools, parser=parser, parallel=parallel)


def _check_schemas(req: ChatCompletionRequest, plan: ToolPlan) -> None:
    """Each forced tool's parameters must compile as a JSON schema (a 400 naming that tool)."""
    for i, tool in enumerate(req.tools or []):
        f = tool.function
        if plan.mode == "named" and f.name != plan.name:
            continue
        try:
            build_grammar(StructuredOutputsParams(json=_arguments_schema(f.parameters)))
        except GrammarError as e:
            message = str(e).removeprefix(e.field).strip()
            raise _error(f"tools[{i}].function.parameters", f"is not a usable JSON schema: {message}") from None


async def check_tool_schemas(req: ChatCompletionRequest, plan: ToolPlan) -> None:
    """_check_schemas off the event loop (the first use imports the grammar engine)."""
    if plan.mode in ("required", "named"):
        await asyncio.to_thread(_check_schemas, req, plan)


def message_dict(m: ChatMessage) -> dict:
    """A message as chat templates read it (transformers' shape): tool calls' arguments as
    objects where they parse, since templates write them out with `tojson`."""
    role = "system" if m.role == "developer" else m.role  # templates only know "system"
    d: dict = {"role": role, "content": m.text}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": _loaded(c.function.arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if reasoning is not None:
        d["reasoning_content"] = reasoning  # (the key templates read)
    return d


def _loaded(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
