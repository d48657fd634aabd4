"""Malformed and hostile HTTP requests: each gets a 4xx in OpenAI's error shape whose message
names the bad field, never a 500; the server stays up and the KV pool is whole afterwards."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.loading import load_model
from tests.server_harness import live_server, make_engine
from tests.tiny_models import make_model

pytestmark = pytest.mark.slow
MODEL = "gemma-test"
MAX_MODEL_LEN = 1024
MAX_BODY = 256 * 1024
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(gemma):
    engine = make_engine(gemma, kv_cache_gib=0.1, max_model_len=MAX_MODEL_LEN)
    with live_server(engine, MODEL, max_body_bytes=MAX_BODY) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **kw}


# (path, json body, expected status, expected `param` (prefix) or None)
JSON_CASES = {
    "max_tokens string": (C, _comp(max_tokens="5"), 400, "max_tokens"),
    "max_tokens negative": (C, _comp(max_tokens=-1), 400, "max_tokens"),
    "max_tokens zero": (C, _comp(max_tokens=0), 400, "max_tokens"),
    "max_tokens float": (C, _comp(max_tokens=1.5), 400, "max_tokens"),
    "max_tokens huge": (C, _comp(max_tokens=10**9), 400, "max_tokens"),
    "temperature negative": (C, _comp(temperature=-0.5), 400, "temperature"),
    "temperature too high": (C, _comp(temperature=5), 400, "temperature"),
    "temperature string": (C, _comp(temperature="hot"), 400, "temperature"),
    "top_p zero": (C, _comp(top_p=0), 400, "top_p"),
    "top_p above one": (C, _comp(top_p=1.5), 400, "top_p"),
    "n zero": (C, _comp(n=0), 400, "n"),
    "n huge": (C, _comp(n=100000), 400, "n"),
    "n bool": (C, _comp(n=True), 400, "n"),
    # The server's limits on what one request may ask for (kvserve/server/limits.py), at their defaults
    "n past --max-n": (C, _comp(n=17), 400, "n"),
    "chat n past --max-n": (CHAT, _chat(n=17), 400, "n"),
    "n past --max-n with many prompts": (C, _comp(prompt=["a"] * 64, n=128), 400, "n"),
    "stop strings past --max-stop": (C, _comp(stop=["x"] * 17), 400, "stop"),
    "stop string past --max-stop-chars": (C, _comp(stop=["ok", "x" * 257]), 400, "stop[1]"),
    "one stop string past --max-stop-chars": (CHAT, _chat(stop="x" * 257), 400, "stop"),
    "stop_token_ids past --max-stop-token-ids": (C, _comp(stop_token_ids=[1] * 257), 400, "stop_token_ids"),
    "empty prompt": (C, _comp(prompt=""), 400, "prompt"),
    "empty prompt list": (C, _comp(prompt=[]), 400, "prompt"),
    "missing prompt": (C, {"model": MODEL, "max_tokens": 2}, 400, "prompt"),
    "prompt of wrong type": (C, _comp(prompt=5), 400, "prompt"),
    "mixed prompt batch": (C, _comp(prompt=["a", [1, 2]]), 400, "prompt"),
    "empty token list in a batch": (C, _comp(prompt=[[2, 3], []]), 400, "prompt"),
    "negative token id": (C, _comp(prompt=[2, -5]), 400, "prompt"),
    "token id past vocab": (C, _comp(prompt=[2, 10**7]), 400, "prompt"),
    "prompt past the context": (C, _comp(prompt="word " * 2000), 400, "prompt"),
    "stop of wrong type": (C, _comp(stop=5), 400, "stop"),
    "stop with ints": (C, _comp(stop=[1, 2]), 400, "stop"),
    "empty stop string": (C, _comp(stop=[""]), 400, "stop"),
    "logprobs too many": (C, _comp(logprobs=50), 400, "logprobs"),
    "logprobs negative": (C, _comp(logprobs=-1), 400, "logprobs"),
    "presence_penalty out of range": (C, _comp(presence_penalty=3), 400, "presence_penalty"),
    "frequency_penalty string": (C, _comp(frequency_penalty="x"), 400, "frequency_penalty"),
    "seed string": (C, _comp(seed="abc"), 400, "seed"),
    "seed past int64": (C, _comp(seed=2**70), 400, "seed"),
    "top_k below -1": (C, _comp(top_k=-5), 400, "top_k"),
    "min_p above one": (C, _comp(min_p=2.0), 400, "min_p"),
    "min_tokens above max_tokens": (C, _comp(min_tokens=5), 400, "min_tokens"),
    "repetition_penalty zero": (C, _comp(repetition_penalty=0), 400, "repetition_penalty"),
    "negative stop token id": (C, _comp(stop_token_ids=[-1]), 400, "stop_token_ids"),
    "stream not a bool": (C, _comp(stream="yes"), 400, "stream"),
    "stream_options without stream": (C, _comp(stream_options={"include_usage": True}), 400, "stream_options"),
    "echo with a prompt past the context": (C, _comp(prompt="word " * 2000, echo=True, logprobs=1), 400, "prompt"),
    "echo max_tokens zero past the context": (C, _comp(prompt=[2] * MAX_MODEL_LEN, echo=True, max_tokens=0), 400,
                                              "prompt"),
    "logit_bias out of range": (C, _comp(logit_bias={"1": 101}), 400, "logit_bias"),
    "logit_bias key not an id": (C, _comp(logit_bias={"the": 5}), 400, "logit_bias"),
    "logit_bias negative id": (CHAT, _chat(logit_bias={"-3": 5}), 400, "logit_bias"),
    "logit_bias id past vocab": (CHAT, _chat(logit_bias={"999999999": 5}), 400, "logit_bias"),
    "logit_bias value of wrong type": (C, _comp(logit_bias={"1": "up"}), 400, "logit_bias"),
    "prompt_logprobs past the max": (C, _comp(prompt_logprobs=21), 400, "prompt_logprobs"),
    "prompt_logprobs negative": (CHAT, _chat(prompt_logprobs=-1), 400, "prompt_logprobs"),
    "prompt_logprobs streamed": (C, _comp(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    "echo logprobs past the max": (C, _comp(echo=True, logprobs=21), 400, "logprobs"),
    "suffix unsupported": (C, _comp(suffix="!"), 400, "suffix"),
    "unknown model": (C, _comp(model="gpt-17"), 404, "model"),
    "empty messages": (CHAT, _chat(messages=[]), 400, "messages"),
    "missing messages": (CHAT, {"model": MODEL}, 400, "messages"),
    "messages not a list": (CHAT, _chat(messages="hi"), 400, "messages"),
    "wrong role": (CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    "tool message without tool_call_id": (CHAT, _chat(messages=[{"role": "tool", "content": "x"}]), 400,
                                          "messages[0].tool_call_id"),
    "user without content": (CHAT, _chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    "content of wrong type": (CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    "image content part": (CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0].content"),
    "top_logprobs without logprobs": (CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    "top_logprobs too many": (CHAT, _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    "max_completion_tokens negative": (CHAT, _chat(max_completion_tokens=-3), 400, "max_completion_tokens"),
    "max_completion_tokens huge": (CHAT, _chat(max_completion_tokens=10**6), 400, "max_completion_tokens"),
    "chat past the context": (CHAT, _chat(messages=[{"role": "user", "content": "word " * 2000}]), 400, "messages"),
    "auto tool choice without a tool format": (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
                                               400, "tool_choice"),
    "unknown response_format type": (CHAT, _chat(response_format={"type": "xml"}), 400, "response_format.type"),
    "chat unknown model": (CHAT, _chat(model="nope"), 404, "model"),
}


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 5
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
        assert param.split("[")[0].split(".")[0] in err["message"], err
    return err


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_invalid_json_request(http, case):
    path, body, status, param = JSON_CASES[case]
    _assert_openai_error(http.post(path, json=body), status, param)


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_request_also_fails_before_streaming(http, stream):
    resp = http.post(C, json=_comp(temperature=-1, stream=stream))
    _assert_openai_error(resp, 400, "temperature")


RAW = {"Content-Type": "application/json"}
RAW_CASES = {
    "invalid JSON": (C, b'{"prompt": "x",', RAW, 400),
    "non-UTF-8 body": (C, b'{"prompt": "\xff\xfe"}', RAW, 400),
    "JSON array body": (CHAT, b"[1, 2, 3]", RAW, 400),
    "JSON string body": (C, b'"hello"', RAW, 400),
    "lone surrogate in prompt": (C, b'{"prompt": "\\ud800 hi"}', RAW, 400),
    "lone surrogate in a message": (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', RAW, 400),
    "NaN temperature": (C, b'{"prompt": "x", "temperature": NaN}', RAW, 400),
    "infinite logit_bias": (C, b'{"prompt": "x", "logit_bias": {"1": 1e400}}', RAW, 400),
    "deeply nested JSON": (C, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", RAW, 400),
    # Parses (under the recursion limit), then would recurse in the surrogate check: refused by depth
    "JSON nested 960 deep": (C, b'{"prompt": "x", "user": ' + b"[" * 960 + b"]" * 960 + b"}", RAW, 400),
    "JSON nested past --max-json-depth": (C, b'{"prompt": "x", "stop": ' + b"[" * 40 + b"]" * 40 + b"}", RAW, 400),
    "integer with 5000 digits": (C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", RAW, 400),
    "empty body": (C, b"", RAW, 400),
    "no Content-Type": (C, json.dumps(_comp()).encode(), {}, 415),
    "wrong content-type": (C, json.dumps(_comp()).encode(), {"Content-Type": "text/plain"}, 415),
    "form content-type": (C, b"prompt=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    "oversized body": (C, json.dumps(_comp(prompt="x" * (MAX_BODY + 10))).encode(), RAW, 413),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_invalid_raw_body(http, case):
    path, content, headers, status = RAW_CASES[case]
    _assert_openai_error(http.post(path, content=content, headers=headers), status, None)


def test_oversized_chunked_body_without_content_length(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 10_000
        yield b'"}'

    resp = http.post(C, content=chunks(), headers=RAW)  # a generator: chunked, no Content-Length
    _assert_openai_error(resp, 413, None)


@pytest.mark.parametrize("method,path,status", [
    ("GET", C, 405), ("GET", CHAT, 405), ("DELETE", "/v1/models", 405),
    ("POST", "/v1/nope", 404), ("GET", "/v1/models/other-model", 404), ("POST", "/health", 405),
])
def test_wrong_route_or_method(http, method, path, status):
    resp = http.request(method, path)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert path in err["message"] or "other-model" in err["message"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_server")
    make_model("llama", folder)
    return load_model(folder)


def test_api_key_required(tiny_llama):
    with live_server(make_engine(tiny_llama, kv_cache_gib=0.01), "tiny", api_key="sekret") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                        {"Authorization": "Basic sekret"}, {"Authorization": "Bearer"}):
            resp = http.post(C, json=body, headers=headers)
            err = _assert_openai_error(resp, 401, None)
            assert err["code"] == "invalid_api_key" and resp.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models").status_code == 401
        ok = http.post(C, json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        for open_path in ("/health", "/metrics", "/stats"):  # probes and dashboards carry no key
            assert http.get(open_path).status_code == 200
        assert srv.wait_pool_full(10)


# Any JSON value in the fields the two routes read, beside a valid body's own
_ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(-2**70, 2**70),
              st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "n", "stop", "stop_token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "seed",
           "logit_bias", "stream", "stream_options", "min_tokens", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
           "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "response_format", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
           "add_generation_prompt", "continue_final_message", "cache_salt", "suffix", "user"]
# No null or mid-sized output cap: the server's default then runs to the context, minutes on a CPU
_LENGTHS = {"max_tokens", "max_completion_tokens"}
_LENGTH = st.one_of(st.integers(-3, 40), st.integers(-2**70, -4), st.integers(2**20, 2**70), st.booleans(),
                    st.floats(-3, 3), st.text(max_size=8))
_FIELD = st.sampled_from(_FIELDS).flatmap(lambda f: st.tuples(st.just(f), _LENGTH if f in _LENGTHS else _ANY))


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([C, CHAT]), fields=st.lists(_FIELD, max_size=3).map(dict))
def test_random_fields_get_a_reply_or_an_openai_error(http, path, fields):
    """Whatever the values: a reply, or a 4xx in OpenAI's shape; never a 500 (the pool is checked
    whole by the last test)."""
    body = {**(_comp() if path == C else _chat()), **fields}
    resp = http.post(path, json=body)
    if resp.status_code == 200:
        assert resp.text.startswith("data: ") if body.get("stream") is True else resp.json()["choices"]
    else:
        _assert_openai_error(resp, resp.status_code if resp.status_code in (400, 404) else 400, None)


def test_server_survives_and_pool_is_full(http, server):
    """Runs last in this module: after every hostile request above, all is well."""
    assert http.get("/health").status_code == 200
    ok = http.post(C, json=_comp(max_tokens=3, temperature=0))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert server.wait_pool_full(10), server.state.engine.stats()
    assert server.engine.block_manager.num_free_blocks == server.engine.num_blocks
    assert not server.engine.requests
