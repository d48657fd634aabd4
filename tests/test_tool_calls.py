"""Tool calling: the parsers (a stream's deltas reassemble to the whole response's calls), the
template rendering tools and tool turns as transformers' apply_chat_template does, and round trips
through the openai client on a tiny Qwen2-style model with a Hermes template and on the bundled
Gemma with a named choice; forced calls validated against their tools' schemas."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest

from kvserve.loading import load_model
from kvserve.server.tool_parsers import (
    HermesParser,
    JsonCallsParser,
    NamedParser,
    parser_for_template,
)
from kvserve.server.tools import required_schema
from tests.server_harness import live_server, make_engine
from tests.tiny_models import make_model

MODEL = "tiny-qwen"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

# A minimal Hermes-style template (Qwen2.5's shape): tools listed in a system turn, calls as
# <tool_call> JSON, results in <tool_response>.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{%- for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# ------------------------------------------------------------------ parsers
def _run(parser, text: str, seed: int):
    """Feed text in random pieces; (content, {index: [id, name, arguments]}, parser.calls)."""
    rng = random.Random(seed)
    content, calls, i = [], {}, 0
    pieces = []
    while i < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[i:i + n])
        i += n
    for piece in [*pieces, None]:
        c, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content.append(c)
        for d in deltas:
            entry = calls.setdefault(d.index, [None, None, ""])
            if d.id is not None:
                assert entry[0] is None and d.name, "id and name come once, first"
                entry[0], entry[1] = d.id, d.name
            else:
                assert entry[0] is not None, "arguments only after the call's name"
            entry[2] += d.arguments
    return "".join(content), calls, parser.calls


PARSER_CASES = [
    (HermesParser, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "n": [1, {"a": '
                   '"}"}]}}\n</tool_call>\n<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>\n',
     "Sure.", [("get_weather", {"city": 'Pa"ris', "n": [1, {"a": "}"}]}), ("get_time", {})]),
    (HermesParser, "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.",
     []),
    (HermesParser, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> done', "done",
     [("f", {"x": 1})]),  # arguments written as a JSON string
    (JsonCallsParser, '<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}; {"name": "b", "parameters": '
                      '{"q": "a;b"}}', "", [("get_time", {"zone": 2}), ("b", {"q": "a;b"})]),
    (JsonCallsParser, '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}, {"name": "get_time", '
                      '"parameters": {"zone": -3}}]', "",
     [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": -3})]),
    (JsonCallsParser, "Just text, {not a call}.", "Just text, {not a call}.", []),
]


@pytest.mark.parametrize("case", range(len(PARSER_CASES)))
def test_parser_streams_reassemble_to_the_whole_parse(case):
    cls, text, content, expected = PARSER_CASES[case]
    whole = cls()
    whole_content = whole.feed(text)[0] + whole.finish()[0]
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == expected
    for seed in range(5):
        streamed_content, calls, parsed = _run(cls(), text, seed)
        assert streamed_content == content
        assert [(name, args) for _, name, args in calls.values()] == [(c.name, c.arguments) for c in whole.calls]
        assert [c.id for c in parsed] == [calls[i][0] for i in sorted(calls)]
        assert all(i.startswith("call_") for i, _, _ in calls.values())


def test_named_parser_takes_the_whole_output_as_arguments():
    content, calls, parsed = _run(NamedParser("get_time"), '{"zone": 3}', 0)
    assert content == "" and [(n, a) for _, n, a in calls.values()] == [("get_time", '{"zone": 3}')]
    assert parsed[0].arguments == '{"zone": 3}'


def test_parser_detected_from_the_template():
    assert parser_for_template(HERMES_TEMPLATE) == "hermes"
    assert parser_for_template('{{ "<|python_tag|>" }}') == "llama3_json"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None


def test_required_schema_accepts_calls_of_the_tools_only():
    funcs = [t["function"] for t in TOOLS]
    schema = required_schema(funcs, parallel=True)
    good = [{"name": "get_time", "parameters": {"zone": 1}}, {"name": "get_weather",
                                                             "parameters": {"city": "x", "unit": "f"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_time", "parameters": {"zone": 99}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_schema(funcs, parallel=False))


# ------------------------------------------------------------------ a tiny Qwen2 with a Hermes template
@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2-tools")
    make_model("qwen2", folder, max_position_embeddings=4096)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    loaded = load_model(qwen_dir)
    with live_server(make_engine(loaded, kv_cache_gib=0.05, max_model_len=4096), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(qwen):
    return openai.OpenAI(base_url=qwen.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[dict, str | None, str]:
    """{index: (id, name, arguments)} reassembled from the deltas, the finish_reason, the content."""
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, [None, None, ""])
                if d.id is not None:
                    assert d.type == "function" and d.function.name
                    entry[0], entry[1] = d.id, d.function.name
                entry[2] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return {i: tuple(v) for i, v in calls.items()}, finish, content


def test_template_renders_tools_and_tool_turns_as_transformers(qwen, qwen_dir, client):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 2}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "14:00"}]
    hf_messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_time", "arguments": {"zone": 2}}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "14:00"}]
    text = hf.apply_chat_template(hf_messages, tools=TOOLS, chat_template=HERMES_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}' in text and "<tools>" in text
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=4)
    assert r.usage.prompt_tokens == len(qwen.engine.tokenizer.encode(text, add_special_tokens=False))
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def test_required_round_trip(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=3, max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    call = choice.message.tool_calls[0]
    messages = [*USER, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content is not None
    assert final.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result are in the prompt


def test_required_without_parallel_calls_makes_one(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=400)
        assert len(r.choices[0].message.tool_calls) == 1
        _check_call(r.choices[0].message.tool_calls[0])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls_reassemble_to_the_same_call(client, choice):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=21, max_tokens=400)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert [(name, args) for _, name, args in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    if isinstance(choice, dict):
        assert [c.function.name for c in whole.message.tool_calls] == ["get_time"]
    for c in whole.message.tool_calls:
        _check_call(c)


def test_auto_choice_parses_hermes_calls_from_the_output(client):
    """tool_choice auto with the template's Hermes parser; a regex makes the tiny model write a call."""
    regex = r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}", "unit": "c"\}\}\n</tool_call>'
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=1.0, seed=5, max_tokens=200,
              extra_body={"structured_outputs": {"regex": regex}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "I will check."
    [call] = whole.message.tool_calls
    _check_call(call, "get_weather")
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and content == "I will check."
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", call.function.arguments)]


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **kw}


BAD = {
    "unknown tool name in tool_choice": (_chat(tools=TOOLS, tool_choice={"type": "function",
                                                                        "function": {"name": "nope"}}),
                                         "tool_choice.function.name"),
    "required with no tools": (_chat(tool_choice="required"), "tool_choice"),
    "named choice with no tools": (_chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    "unknown tool_choice string": (_chat(tools=TOOLS, tool_choice="always"), "tool_choice"),
    "tool without function": (_chat(tools=[{"type": "function"}]), "tools[0].function"),
    "tool of another type": (_chat(tools=[{"type": "retrieval", "function": WEATHER["function"]}]), "tools[0].type"),
    "tool name with spaces": (_chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
                              "tools[0].function.name"),
    "parameters not an object": (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
                                 "tools[0].function.parameters"),
    "tools not a list": (_chat(tools={"type": "function"}), "tools"),
    "empty tools": (_chat(tools=[]), "tools"),
    "repeated tool names": (_chat(tools=[TIME, TIME]), "tools[1].function.name"),
    "schema that cannot compile, forced": (_chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}], tool_choice="required"), "tools[0].function.parameters"),
    "forced call and response_format": (_chat(tools=TOOLS, tool_choice="required",
                                              response_format={"type": "json_object"}), "tool_choice"),
    "tool message without tool_call_id": (_chat(messages=[*USER, {"role": "tool", "content": "x"}]),
                                          "messages[1].tool_call_id"),
    "tool_calls in a user message": (_chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
                                     "messages[0].tool_calls"),
    "malformed tool call": (_chat(messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "1"}]}]),
                            "messages[1].tool_calls[0].function"),
    "tool_call_id outside a tool message": (_chat(messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]),
                                            "messages[0].tool_call_id"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_requests_are_400s_naming_the_field(qwen, case):
    body, param = BAD[case]
    with httpx.Client(base_url=qwen.url, timeout=60) as http:
        for stream in (False, True):
            resp = http.post("/v1/chat/completions", json={**body, "stream": stream})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", err
        ok = http.post("/v1/chat/completions", json=_chat(tools=TOOLS, tool_choice="required", max_tokens=400))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]
    assert qwen.wait_pool_full()


# ------------------------------------------------------------------ the bundled Gemma: a named choice
@pytest.mark.slow
def test_gemma_named_choice_round_trip(gemma):
    with live_server(make_engine(gemma, kv_cache_gib=0.2), "gemma-test") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        named = {"type": "function", "function": {"name": "get_weather"}}
        kw = dict(model="gemma-test", messages=USER, tools=TOOLS, tool_choice=named, temperature=1.0, seed=2,
                  max_tokens=80)
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        _check_call(call, "get_weather")
        calls, finish, _ = _streamed_calls(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls" and [(n, a) for _, n, a in calls.values()] == \
            [("get_weather", call.function.arguments)]
        messages = [*USER, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        final = client.chat.completions.create(model="gemma-test", messages=messages, tools=TOOLS,
                                               tool_choice="none", max_tokens=12, temperature=0)
        assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
        assert srv.wait_pool_full()
