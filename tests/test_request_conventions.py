"""What applications send beside the parameters kvserve knows: fields of newer OpenAI API versions
and SDKs (`store`, `metadata`, ...) are ignored with a warning naming them, as vLLM does, and
`--strict-requests` refuses them with a 400 naming the field; types stay strict either way."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest

from kvserve.server.limits import RequestLimits
from tests.server_harness import live_server, make_engine

pytestmark = pytest.mark.slow
MODEL = "gemma-test"
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Name a colour."}]
BODY_LOG = "kvserve.server.body"


@pytest.fixture(scope="module")
def engine(gemma):
    return make_engine(gemma, kv_cache_gib=0.05, max_model_len=512)


@pytest.fixture(scope="module")
def server(engine):
    with live_server(engine, MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def strict_server(gemma):
    engine = make_engine(gemma, kv_cache_gib=0.05, max_model_len=512)
    with live_server(engine, MODEL, limits=RequestLimits(strict_requests=True)) as srv:
        yield srv


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == BODY_LOG and r.levelno == logging.WARNING]


def test_unknown_fields_are_ignored_and_logged_once(server, caplog):
    plain = {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0}
    extras = {**plain, "store": True, "metadata": {"team": "a"}, "max_token": 9,
              "messages": [{**USER[0], "mood": "happy"}]}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        expected = http.post(CHAT, json=plain)
        assert expected.status_code == 200 and not _warnings(caplog)
        with caplog.at_level(logging.WARNING, logger=BODY_LOG):
            got = http.post(CHAT, json=extras)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == expected.json()["choices"][0]["message"]
    (warning,) = _warnings(caplog)  # one warning for the request, naming every ignored field
    for name in ("'store'", "'metadata'", "'max_token'", "'messages[0].mood'", CHAT):
        assert name in warning


def test_types_stay_strict_by_default(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post(C, json={"model": MODEL, "prompt": "Hi", "max_tokens": "5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_the_openai_clients_newer_parameters_get_through(server, caplog):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    expected = client.chat.completions.create(**kw).choices[0].message.content
    with caplog.at_level(logging.WARNING, logger=BODY_LOG):
        got = client.chat.completions.create(
            **kw, store=False, metadata={"k": "v"}, service_tier="auto", reasoning_effort="low",
            prediction={"type": "content", "content": "blue"}, modalities=["text"],
            audio={"voice": "alloy", "format": "wav"}, web_search_options={}, parallel_tool_calls=False,
            verbosity="low", prompt_cache_key="k", safety_identifier="u", extra_body={"vendor_flag": 1})
    assert got.choices[0].message.content == expected
    (warning,) = _warnings(caplog)
    for name in ("store", "metadata", "service_tier", "reasoning_effort", "prediction", "modalities", "audio",
                 "web_search_options", "verbosity", "vendor_flag"):
        assert repr(name) in warning
    assert "parallel_tool_calls" not in warning  # a declared field (at its neutral value)


# (path, body, the `param` the 400 names)
STRICT_CASES = {
    "top level": (C, {"prompt": "Hi", "max_tokens": 2, "max_token": 5}, "max_token"),
    "store on chat": (CHAT, {"messages": USER, "store": False}, "store"),
    "in a message": (CHAT, {"messages": [{**USER[0], "mood": "happy"}]}, "messages[0].mood"),
    "in a content part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                             "detail": 1}]}]},
                          "messages[0].content[0].detail"),
    "in stream_options": (C, {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
                          "stream_options.x"),
}


@pytest.mark.parametrize("case", list(STRICT_CASES))
def test_strict_requests_refuse_unknown_fields(strict_server, case):
    path, body, param = STRICT_CASES[case]
    with httpx.Client(base_url=strict_server.url, timeout=60) as http:
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "unknown_field" and param in err["message"]
        assert "--strict-requests" in err["message"]
    assert strict_server.wait_pool_full()


def test_a_body_of_many_unknown_fields_logs_one_bounded_line(server, caplog):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **{f"k{i}" + "x" * 500: i for i in range(5000)}}
    with caplog.at_level(logging.WARNING, logger=BODY_LOG), httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post(C, json=body).status_code == 200
    (warning,) = _warnings(caplog)
    assert "and 4984 more" in warning and len(warning) < 2000
