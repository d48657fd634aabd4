"""Structured outputs (JSON schema, regex, choice, grammar) in the engine: the token mask per row,
the vocabulary handed to xgrammar, compilation off the step, and the oracles: HF generate under
xgrammar's own mask (built from transformers' tokenizer) for greedy tokens, and a constrained
request batched with plain ones leaving theirs unchanged."""
from __future__ import annotations

import enum
import json
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal, Optional

import httpx
import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve import kernels
from kvserve.sampling.sampler import Sampler, SamplingRequest
from kvserve.sampling.structured import GrammarError, build_grammar, tokenizer_info
from tests.logits import hf_forced_logits


PROMPT = "<bos><start_of_turn>user\nDescribe a person as JSON.<end_of_turn>\n<start_of_turn>model\n"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


# ------------------------------------------------------------------ parameters and the backend
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"json": {}, "regex": "a"}, "exactly one"), ({"choice": []}, "non-empty"),
    ({"choice": ["a", 1]}, "only strings"), ({"regex": ""}, "non-empty"), ({"json": 5}, "JSON schema"),
    ({"grammar": "root ::= \"a\"", "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
])
def test_params_shape_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.parametrize("params, field", [
    (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
    (StructuredOutputsParams(json="[1, 2]"), "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(grammar="root ::= \"a"), "structured_outputs.grammar"),
])
def test_constraints_that_cannot_compile(params, field):
    with pytest.raises(GrammarError) as e:
        build_grammar(params)
    assert e.value.field == field and str(e.value).startswith(field)
    assert "/project/cpp" not in str(e.value)  # xgrammar's source location is not the client's business


def test_choice_grammar_matches_exactly_its_strings():
    choices = ["yes", 'no "way"', "back\\slash", "line\nbreak", "émoji 🎉"]
    grammar = build_grammar(StructuredOutputsParams(choice=choices))
    info = xgr.TokenizerInfo(["a"])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    for c in choices + ["ye", "yes!", "no way"]:
        m = xgr.GrammarMatcher(compiled)
        assert (m.accept_string(c) and m.is_completed()) == (c in choices), c


@pytest.mark.parametrize("string", [{"maxLength": 5}, {"minLength": 1}, {}])
def test_json_strings_never_hold_raw_control_characters(string):
    schema = {"type": "object", "properties": {"a": {"type": "string", **string}}, "required": ["a"]}
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["x"])).compile_grammar(
        build_grammar(StructuredOutputsParams(json=schema)))
    for ch in ("\x03", "\t", "\n", "\x1f"):
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string('{"a": "x') and not m.accept_string(ch), repr(ch)
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('{"a": "xé"}') and m.is_completed()


def test_token_mask_kernel_equals_xgrammar_and_torch():
    torch.manual_seed(0)
    n, vocab = 6, 1000 + 7  # a vocabulary that is not a multiple of 32
    words = -(-vocab // 32)
    logits = torch.randn(n, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32)
    bitmask[1] = 0
    bitmask[2, 3:] = -1
    rows = [0, 1, 2, 4]
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, indices=rows, vocab_size=vocab)
    ours = logits.clone()
    kernels.apply_token_bitmask(ours, bitmask, rows)
    assert torch.equal(ours, ref)
    strided = torch.cat([logits, logits], 1)[:, :vocab]  # not contiguous: the torch path
    kernels.apply_token_bitmask(strided, bitmask, rows)
    assert torch.equal(strided, ref)


def test_gemma_vocabulary_is_byte_fallback_and_decodes_as_our_tokenizer(gemma):
    tok = gemma.tokenizer
    info = tokenizer_info(tok, gemma.config.vocab_size)
    assert info.vocab_type == xgr.VocabType.BYTE_FALLBACK and not info.add_prefix_space
    assert sorted(info.stop_token_ids) == sorted(tok.eos_token_ids)
    decoded = info.decoded_vocab
    special = tok.special_token_ids()
    assert set(info.special_token_ids) >= special - set(tok.eos_token_ids)
    rng = random.Random(0)
    ids = rng.sample([i for i in range(gemma.config.vocab_size) if i not in special], 3000)
    ids += [tok.token_to_id(f"<0x{b:02X}>") for b in (0x0A, 0x7B, 0xE2, 0xFF)]
    for i in ids:
        text = tok.decode([i], skip_special_tokens=False)
        piece = tok.id_to_token(i)
        if re.fullmatch(r"<0x[0-9A-F]{2}>", piece):  # byte fallback: one raw byte
            assert decoded[i] == bytes([int(piece[3:5], 16)]), piece
        elif "\ufffd" not in text:
            assert decoded[i] == text.encode(), (i, piece, text)


def test_byte_level_vocabulary(tmp_path):
    from kvserve.loading.tokenizer import Tokenizer
    from tests.tiny_models import write_tokenizer

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json", [1], 2)
    info = tokenizer_info(tok, 336)  # logits wider than the 320-token vocabulary
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.vocab_size == 336
    decoded = info.decoded_vocab
    checked = 0
    for i in range(3, 320):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text:  # a lone byte of a multi-byte character decodes to U+FFFD
            assert decoded[i] == text.encode(), i
            checked += 1
    assert checked > 150
    assert set(range(320, 336)) <= set(info.special_token_ids)  # padding ids are never allowed


def test_constrained_rows_leave_the_argmax_path():
    state = object()
    greedy = SamplingParams(temperature=0)
    assert Sampler.greedy_only([SamplingRequest(greedy, [1], [])])
    assert not Sampler.greedy_only([SamplingRequest(greedy, [1], [], grammar=state)])


# ------------------------------------------------------------------ the engine on Gemma
def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_sampled_json_regex_choice_hold(gemma_llm):
    so = StructuredOutputsParams(json=PERSON)
    outs = gemma_llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=120,
                                                       structured_outputs=so))
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop" and c.token_ids[-1] in gemma_llm.tokenizer.eos_token_ids
        assert _valid(c.text, PERSON), c.text
    regex = r"[A-Z][a-z]{2,6}-\d{2,4}"
    out = gemma_llm.generate("Code:", SamplingParams(n=12, temperature=1.0, seed=3, max_tokens=20,
                                                     structured_outputs=StructuredOutputsParams(regex=regex)))[0]
    assert all(c.finish_reason == "stop" and re.fullmatch(regex, c.text) for c in out.outputs), \
        [c.text for c in out.outputs]
    choices = ["red", "green", "deep blue"]
    out = gemma_llm.generate("Color:", SamplingParams(n=12, temperature=1.0, seed=4, max_tokens=20, min_tokens=2,
                                                      structured_outputs=StructuredOutputsParams(choice=choices)))[0]
    assert all(c.text in choices for c in out.outputs)  # min_tokens past a one-token choice: the grammar wins


def test_greedy_json_equals_hf_greedy_under_xgrammar_mask(gemma, gemma_llm, hf_gemma, hf_gemma_tokenizer):
    """The oracle: HF's logits with xgrammar's mask applied, from xgrammar's own view of
    transformers' tokenizer, teacher-forced (tests/logits.py: what HF generate with the mask as a
    logits processor gives, in one forward); greedy tokens equal, token for token, from the full
    logits (logprobs asked) and from the head's screen under the mask (none asked)."""
    ids = gemma.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = gemma_llm.generate(ids, SamplingParams(temperature=0, max_tokens=60, logprobs=0,
                                                 structured_outputs=StructuredOutputsParams(json=PERSON)))[0]
    vocab = gemma.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(hf_gemma_tokenizer, vocab_size=vocab,
                                              stop_token_ids=gemma.tokenizer.eos_token_ids)
    grammar = build_grammar(StructuredOutputsParams(json=PERSON))  # the same grammar, another view of the vocabulary
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    raw = hf_forced_logits(hf_gemma, ids, out.token_ids)
    ref = []
    for logits, token in zip(raw, out.token_ids):
        matcher.fill_next_token_bitmask(bitmask)
        masked = logits.clone()[None]
        xgr.apply_token_bitmask_inplace(masked, bitmask)
        ref.append(int(masked.argmax()))
        assert matcher.accept_token(token)
    assert out.token_ids == ref
    assert out.outputs[0].finish_reason == "stop" and _valid(out.text, PERSON) and matcher.is_terminated()
    # Without logprobs the tokens come from the head's screen under the mask (no full logits).
    screened = gemma_llm.generate(ids, SamplingParams(temperature=0, max_tokens=60,
                                                      structured_outputs=StructuredOutputsParams(json=PERSON)))[0]
    assert screened.token_ids == out.token_ids
    # Logprobs are the model's own (the raw logits), not the masked distribution's.
    expected = raw.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.outputs[0].logprobs), expected, atol=1e-3)


def test_constrained_row_leaves_the_batch_unchanged(gemma_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = gemma_llm.generate(prompts, greedy)
    constrained = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
        regex=r"(yes|no)( indeed)?"))
    mixed = gemma_llm.generate([prompts[0], "Is water wet?", prompts[1], prompts[2]],
                               [greedy, constrained, greedy, greedy])
    assert [o.token_ids for o in alone] == [mixed[0].token_ids, mixed[2].token_ids, mixed[3].token_ids]
    assert re.fullmatch(r"(yes|no)( indeed)?", mixed[1].text)


def test_compiling_grammar_does_not_hold_up_other_requests(gemma_llm, monkeypatch):
    engine = gemma_llm.engine
    backend = engine.grammars.backend
    release = threading.Event()
    real = backend.compile

    def slow_compile(params):
        assert release.wait(30)
        return real(params)

    monkeypatch.setattr(backend, "compile", slow_compile)
    so = StructuredOutputsParams(regex=r"slow-[0-9]{3}")  # a new key: not in the cache
    rid = engine.add_request("Code:", SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
    plain = engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.stats()["num_requests_waiting"] >= 1
    done = {}
    for _ in range(10):
        for out in engine.step():
            done[out.request_id] = out
        if plain in done and done[plain].finished:
            break
    assert done[plain].finished and rid not in done  # the plain request ran while the grammar compiled
    release.set()
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert re.fullmatch(r"slow-[0-9]{3}", done[rid].text)
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_failed_compilation_ends_the_request_with_a_400(gemma_llm, monkeypatch):
    engine = gemma_llm.engine

    def failing(params):
        raise GrammarError("structured_outputs.regex", "cannot be compiled: boom")

    monkeypatch.setattr(engine.grammars.backend, "compile", failing)
    rid = engine.add_request("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="fails-[a-z]")))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and outs[-1].error_status == 400 and "boom" in outs[-1].error
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_bad_constraint_is_a_value_error_at_add_request(gemma_llm):
    with pytest.raises(ValueError, match="structured_outputs.regex cannot be compiled"):
        gemma_llm.generate("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert not gemma_llm.engine.has_unfinished()


# ------------------------------------------------------------------ the server, through the openai client
MODEL = "gemma-test"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(gemma):
    from tests.server_harness import live_server, make_engine

    with live_server(make_engine(gemma, kv_cache_gib=1.0, max_num_seqs=128), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"




class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    x: float = Field(ge=-10, le=10)
    y: float = Field(ge=-10, le=10)


class Address(BaseModel):
    street: str = Field(max_length=20)
    city: str = Field(max_length=20)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Employee(BaseModel):
    person: Person
    address: Address


class Polygon(BaseModel):
    name: str = Field(max_length=20)
    points: list[Point] = Field(min_length=3, max_length=4)


class Paint(BaseModel):
    color: Color
    glossy: bool


class Inventory(BaseModel):
    # Bounded items: at temperature 1 an unbounded string or integer may run past any token limit.
    items: list[Annotated[str, Field(max_length=16)]] = Field(min_length=1, max_length=4)
    counts: list[Annotated[int, Field(ge=0, le=9999)]] = Field(max_length=4)


class Weather(BaseModel):
    city: str = Field(max_length=20)
    celsius: float = Field(ge=-60, le=60)
    sky: Literal["clear", "cloudy", "rain", "snow"]


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    summary: str = Field(max_length=40)
    recommend: bool


class Maybe(BaseModel):
    nickname: Optional[str] = Field(max_length=12)
    score: Optional[int] = Field(ge=0, le=10)


class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    price: float = Field(ge=0, le=1000)
    tags: list[Literal["new", "sale", "eco"]] = Field(max_length=3)


class Team(BaseModel):
    name: str = Field(max_length=20)
    members: list[Person] = Field(min_length=1, max_length=3)


class Flags(BaseModel):
    a: bool
    b: bool
    c: bool


class Matrix(BaseModel):
    rows: list[list[int]] = Field(min_length=2, max_length=2)


class Event(BaseModel):
    title: str = Field(max_length=20)
    day: int = Field(ge=1, le=31)
    month: Literal["jan", "feb", "mar", "apr"]
    where: Address


class Shape(BaseModel):
    kind: Literal["circle", "square"]
    size: float = Field(gt=0, le=100)
    fill: Paint


class Tree(BaseModel):
    label: str = Field(max_length=8)
    children: list[Flags] = Field(max_length=2)


class Version(BaseModel):
    major: int = Field(ge=0, le=9)
    minor: int = Field(ge=0, le=99)
    tag: str = Field(pattern=r"^(alpha|beta|rc)[0-9]?$")


class Order(BaseModel):
    id: int = Field(ge=1, le=99999)
    product: Product
    quantity: int = Field(ge=1, le=10)
    express: bool


class Coordinates(BaseModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)
    label: Optional[Color]


SCHEMAS = [Person, Point, Address, Employee, Polygon, Paint, Inventory, Weather, Review, Maybe, Product, Team,
           Flags, Matrix, Event, Shape, Tree, Version, Order, Coordinates]
STREAMED = {Address, Team, Matrix, Order}  # these through a stream, reassembled per choice


def _ask(model: type[BaseModel]) -> list[dict]:
    return [{"role": "user", "content": f"Give me an example {model.__name__} as JSON."}]


def _parsed(client, model: type[BaseModel]) -> list[str]:
    r = client.chat.completions.parse(model=MODEL, messages=_ask(model), response_format=model, n=5,
                                      temperature=1.0, seed=11, max_completion_tokens=400)
    for c in r.choices:
        assert c.finish_reason == "stop" and isinstance(c.message.parsed, model)
    return [c.message.content for c in r.choices]


def _streamed(client, model: type[BaseModel]) -> list[str]:
    fmt = {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": to_strict_json_schema(model),
                                                  "strict": True}}
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=_ask(model), response_format=fmt, n=5,
                                                temperature=1.0, seed=11, max_completion_tokens=400, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert finish == {i: "stop" for i in range(5)}
    return [texts[i] for i in range(5)]


@pytest.mark.slow
def test_openai_parse_20_schemas_100_samples_validate(client, server):
    def run(model):
        return model, (_streamed if model in STREAMED else _parsed)(client, model)

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(run, SCHEMAS))
    count = 0
    for model, texts in results:
        schema = to_strict_json_schema(model)
        for text in texts:
            jsonschema.validate(json.loads(text), schema)  # the oracle: the schema itself
            model.model_validate_json(text)
            count += 1
    assert count == 100
    assert server.wait_pool_full()


@pytest.mark.slow
def test_regex_and_choice_hold_on_100_samples(client):
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    r = client.completions.create(model=MODEL, prompt=["Email:"] * 10, n=10, temperature=1.0, max_tokens=30,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert len(r.choices) == 100
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    options = ["Paris", "London", "New York", "Tokyo", "São Paulo"]
    r = client.completions.create(model=MODEL, prompt=["The best city is"] * 10, n=10, temperature=1.0,
                                  max_tokens=30, extra_body={"guided_choice": options})
    texts = [c.text for c in r.choices]
    assert len(texts) == 100 and set(texts) <= set(options) and len(set(texts)) > 1


def test_streamed_grammar_and_json_object(client):
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A sum"}],
                                            extra_body={"guided_grammar": grammar}, temperature=1.0, seed=5,
                                            stream=True, max_completion_tokens=20)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(r"\([1-9][0-9]? [-+*] [1-9][0-9]?\)", text), text
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Some JSON please"}],
                                       response_format={"type": "json_object"}, temperature=0,
                                       max_completion_tokens=200)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still an object so far
        assert r.choices[0].message.content.lstrip().startswith("{")


def _body(path: str, **kw) -> dict:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kw}


BAD = {
    "invalid JSON schema": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    "json_schema without its body": (CHAT, {"response_format": {"type": "json_schema"}},
                                     "response_format.json_schema"),
    "unknown response_format type": (CHAT, {"response_format": {"type": "yaml"}}, "response_format.type"),
    "schema not an object": (COMP, {"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
    "schema not JSON": (COMP, {"guided_json": "{nope"}, "guided_json"),
    "regex that cannot compile": (COMP, {"guided_regex": "a(b"}, "guided_regex"),
    "structured regex that cannot compile": (CHAT, {"structured_outputs": {"regex": "[z-a]"}},
                                             "structured_outputs.regex"),
    "bad EBNF grammar": (COMP, {"structured_outputs": {"grammar": "root ::= undefined"}},
                         "structured_outputs.grammar"),
    "bad guided grammar": (CHAT, {"guided_grammar": "root ::= \"a"}, "guided_grammar"),
    "empty choice list": (COMP, {"guided_choice": []}, "guided_choice"),
    "empty structured choice": (CHAT, {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    "two constraints": (CHAT, {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    "two kinds in structured_outputs": (COMP, {"structured_outputs": {"regex": "a", "choice": ["a"]}},
                                        "structured_outputs"),
    "choice of ints": (COMP, {"guided_choice": [1, 2]}, "guided_choice[0]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_constraints_are_400s_naming_the_field(server, case):
    path, extra, param = BAD[case]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for stream in (False, True):
            resp = http.post(path, json=_body(path, stream=stream, **extra))
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == param and param.split(".")[0] in err["message"], err
        ok = http.post(path, json=_body(path, guided_choice=["fine"]))  # still serving, and constrained
        assert ok.status_code == 200
        body = ok.json()["choices"][0]
        assert (body.get("text") or body.get("message", {}).get("content")) == "fine"
    assert server.wait_pool_full()
