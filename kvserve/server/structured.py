"""Structured outputs on the wire: the request's constraint fields -> one StructuredOutputsParams,
compiled before the request is submitted, so that a schema, regex or grammar that cannot compile
is a 400 naming the field it came from (never an error inside a stream that already started).

The fields, one constraint per request:
- OpenAI's `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} ("text": no constraint);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object"}, with
  `disable_any_whitespace`;
- vLLM's older spellings `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.sampling.structured import GrammarError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import _SamplingRequest
from kvserve.server.state import ServerState

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from: what a 400 about it names

    def param_of(self, error_field: str) -> str:
        """`structured_outputs.regex` stays as it is; any other source is named itself."""
        return error_field if self.field == "structured_outputs" else self.field


def _sources(req: _SamplingRequest) -> list[tuple[str, dict]]:
    """(field, StructuredOutputsParams kwargs) of every constraint field the request sets."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_
        found.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                             "grammar": so.grammar, "json_object": so.json_object,
                                             "disable_any_whitespace": so.disable_any_whitespace}))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    return found


def constraint_of(req: _SamplingRequest) -> Constraint | None:
    """The request's one constraint, or None. A 400 naming the field for two at once or for a
    malformed one (an empty choice list, ...)."""
    found = _sources(req)
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, f"{found[1][0]} cannot be combined with {found[0][0]}: a request takes one "
                            "structured-output constraint", found[1][0], "invalid_value")
    field, kwargs = found[0]
    try:
        return Constraint(StructuredOutputsParams(**kwargs), field)
    except ValueError as e:
        message = str(e)
        head = message.split(" ", 1)[0]
        param = head if field == "structured_outputs" and head.startswith("structured_outputs.") else field
        raise APIError(400, _renamed(message, field), param, "invalid_value") from None


def _renamed(message: str, field: str) -> str:
    """StructuredOutputsParams' messages name its own fields; another source is named itself."""
    if field == "structured_outputs":
        return message
    return re.sub(r"structured_outputs(\.\w+)?", field, message, count=1)


async def compile_constraint(state: ServerState, constraint: Constraint) -> None:
    """Compile off the event loop (the engine then finds it cached); a 400 naming the field."""
    try:
        await state.engine.compile_grammar(constraint.params)
    except GrammarError as e:
        raise APIError(400, _renamed(str(e), constraint.field), constraint.param_of(e.field),
                       "invalid_value") from None
