"""What evaluation clients ask of the server, through the `openai` client and raw HTTP: echo with
prompt logprobs (max_tokens 0 and 1, streamed, batched), vLLM's prompt_logprobs, logit_bias,
/tokenize, /detokenize, /tokenizer_info and /v1/embeddings, each equal to the offline API on the
same weights; every bad field a 400 naming it, the server healthy and its KV pool whole after."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from kvserve import PoolingParams, SamplingParams
from tests.server_harness import live_server, make_engine

pytestmark = pytest.mark.slow
MODEL = "gemma-test"
KEY = "sekret"
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is Paris, and the capital of Italy is"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(gemma):
    engine = make_engine(gemma, kv_cache_gib=0.1, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256)
    with live_server(engine, MODEL, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as c:
        yield c


def _offline(gemma_llm, prompt, **kw):
    return gemma_llm.generate(prompt, SamplingParams(temperature=0, **kw))[0]


def test_echo_with_logprobs_is_the_prompt_scored(client, server, gemma_llm):
    ref = _offline(gemma_llm, PROMPT, max_tokens=1, prompt_logprobs=2, logprobs=2)
    ids, plp = ref.prompt_token_ids, ref.prompt_logprobs
    tok = server.engine.tokenizer

    only = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0).choices[0]
    assert only.text == PROMPT and only.finish_reason == "length"
    lp = only.logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(plp[i][ids[i]].logprob, abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 3 and lp.tokens[i] in lp.top_logprobs[i]
        top2 = sorted((e for e in plp[i].values() if e.rank <= 2), key=lambda e: e.rank)
        assert [lp.top_logprobs[i].get(e.decoded_token) for e in top2] == pytest.approx([e.logprob for e in top2],
                                                                                          abs=1e-4)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))

    # max_tokens 1 (what lm-evaluation-harness sends): the prompt, then the generated token
    one = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=1, temperature=0)
    c = one.choices[0]
    assert c.text == PROMPT + ref.outputs[0].text
    assert c.logprobs.token_logprobs[:-1] == lp.token_logprobs
    assert c.logprobs.token_logprobs[-1] == pytest.approx(ref.outputs[0].logprobs[0], abs=1e-4)
    assert one.usage.completion_tokens == 1 and one.usage.prompt_tokens == len(ids)

    # streamed: the first chunk carries the prompt; the pieces add up to the whole response
    chunks = [ch.choices[0] for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0, stream=True) if ch.choices]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                      temperature=0).choices[0]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(ch.text for ch in chunks) == whole.text
    streamed = [x for ch in chunks for x in ch.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)
    assert [x for ch in chunks for x in ch.logprobs.text_offset] == whole.logprobs.text_offset
    assert server.wait_pool_full(10)


def test_echo_batch_of_token_ids_as_lm_eval_sends_it(http, gemma_llm):
    prompts = [[2, 818, 5279, 529, 7001, 563], [2, 10979, 993], [2, 818]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
            "seed": 1234}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, c in zip(prompts, choices):
        ref = _offline(gemma_llm, ids, max_tokens=1, prompt_logprobs=1)
        got = c["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) + 1 and got[0] is None
        assert got[1:-1] == pytest.approx([ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))],
                                          abs=1e-4)
        assert c["text"].startswith(gemma_llm.tokenizer.decode(ids, skip_special_tokens=False))
    # echo without logprobs: the text only; streamed echo of the prompt alone
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "echo": True, "max_tokens": 0})
    assert r.json()["choices"][0]["text"] == "Hi there" and r.json()["choices"][0]["logprobs"] is None
    assert r.json()["usage"]["completion_tokens"] == 0
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "echo": True, "max_tokens": 0,
                                           "stream": True})
    assert '"text": "Hi there"' in r.text and r.text.count('"text"') == 1 and r.text.endswith("data: [DONE]\n\n")


def test_prompt_logprobs_field_in_completions_and_chat(http, gemma_llm, server):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ref = _offline(gemma_llm, PROMPT, max_tokens=2, prompt_logprobs=1)
    assert plp[0] is None and len(plp) == len(ref.prompt_token_ids)
    for got, want in zip(plp[1:], ref.prompt_logprobs[1:]):
        assert {int(k) for k in got} == set(want)
        for k, v in got.items():
            assert v["logprob"] == pytest.approx(want[int(k)].logprob, abs=1e-4)
            assert v["rank"] == want[int(k)].rank and v["decoded_token"] == want[int(k)].decoded_token
    msgs = [{"role": "user", "content": "Say hi"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2,
                                                "prompt_logprobs": 0})
    body = r.json()
    ids = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(ids)
    assert all(list(e) == [str(t)] for e, t in zip(body["prompt_logprobs"][1:], ids[1:]))
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_logit_bias_over_http(client, server):
    forced = server.engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == " banana" * 4
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       logit_bias={str(forced): 100}, temperature=0.7, seed=3)
    assert r.choices[0].message.content == " banana" * 3


def test_tokenize_detokenize_and_tokenizer_info(http, server):
    tok = server.engine.tokenizer
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r == {"count": len(tok.encode(PROMPT)), "max_model_len": MAX_MODEL_LEN, "tokens": tok.encode(PROMPT),
                 "token_strs": None}
    r = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = server.state.chat_template.render(msgs)
    assert http.post("/tokenize", json={"messages": msgs}).json()["tokens"] == tok.encode(text, add_special_tokens=False)
    open_turn = server.state.chat_template.render(msgs, add_generation_prompt=False)
    assert http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["tokens"] == \
        tok.encode(open_turn, add_special_tokens=False)
    ids = tok.encode(PROMPT)
    assert http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == \
        {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    info = http.get("/tokenizer_info").json()
    assert info["bos_token"] == "<bos>" and info["eos_token"] == tok.id_to_token(tok.eos_token_ids[0])
    assert info["model_max_length"] == MAX_MODEL_LEN
    for path in ("/tokenize", "/detokenize", "/tokenizer_info"):  # API routes: the key is required
        resp = httpx.request("GET" if path == "/tokenizer_info" else "POST", server.url + path,
                             json={"prompt": "x"} if path != "/tokenizer_info" else None)
        assert resp.status_code == 401


def test_embeddings_equal_the_offline_api(client, http, server, gemma_llm):
    texts = ["The capital of France is Paris", "A cat sat on the mat", "x"]
    r = client.embeddings.create(model=MODEL, input=texts)
    ref = gemma_llm.embed(texts)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    for d, want in zip(r.data, ref):
        assert np.allclose(d.embedding, want.outputs.embedding, atol=1e-5)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(o.prompt_token_ids) for o in ref)
    raw = http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, ref[0].outputs.embedding, atol=1e-5)
    ids = ref[1].prompt_token_ids
    by_ids = http.post("/v1/embeddings", json={"input": [ids, ids[:3]], "dimensions": 640}).json()
    assert np.allclose(by_ids["data"][0]["embedding"], ref[1].outputs.embedding, atol=1e-5)
    unnormed = http.post("/v1/embeddings", json={"input": texts[1], "normalize": False}).json()["data"][0]["embedding"]
    want = gemma_llm.embed(texts[1], PoolingParams(normalize=False))[0].outputs.embedding
    assert np.allclose(unnormed, want, rtol=1e-4, atol=1e-4) and np.linalg.norm(unnormed) > 2
    assert server.wait_pool_full(10)


E, T, D, C = "/v1/embeddings", "/tokenize", "/detokenize", "/v1/completions"
BAD = {
    "embeddings empty input": (E, {"input": ""}, "input"),
    "embeddings empty list": (E, {"input": []}, "input"),
    "embeddings empty string in a batch": (E, {"input": ["ok", ""]}, "input[1]"),
    "embeddings empty token list in a batch": (E, {"input": [[2, 3], []]}, "input"),
    "embeddings too long": (E, {"input": "word " * (MAX_MODEL_LEN + 10)}, "input"),
    "embeddings token ids too long": (E, {"input": [2] * (MAX_MODEL_LEN + 1)}, "input"),
    "embeddings token id past vocab": (E, {"input": [2, 10**7]}, "input"),
    "embeddings negative token id": (E, {"input": [[2, -1]]}, "input[0]"),
    "embeddings unsupported encoding_format": (E, {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    "embeddings other dimensions": (E, {"input": "x", "dimensions": 64}, "dimensions"),
    "embeddings input of wrong type": (E, {"input": 5}, "input"),
    "embeddings unknown model": (E, {"input": "x", "model": "other"}, "model"),
    "embeddings too many inputs": (E, {"input": ["x"] * 257}, "input"),
    "tokenize prompt and messages": (T, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    "tokenize neither": (T, {"add_special_tokens": True}, "prompt"),
    "tokenize empty messages": (T, {"messages": []}, "messages"),
    "tokenize prompt of wrong type": (T, {"prompt": [1, 2]}, "prompt"),
    "tokenize bad message": (T, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    "detokenize token past vocab": (D, {"tokens": [2, 10**7]}, "tokens[1]"),
    "detokenize negative token": (D, {"tokens": [-1]}, "tokens[0]"),
    "detokenize not a list": (D, {"tokens": "2 3"}, "tokens"),
    "detokenize unknown model": (D, {"tokens": [2], "model": "other"}, "model"),
    "echo with a prompt past the context": (C, {"prompt": "word " * 600, "echo": True, "logprobs": 1}, "prompt"),
    "echo with max_tokens past the context": (C, {"prompt": "Hi", "echo": True, "max_tokens": MAX_MODEL_LEN},
                                              "max_tokens"),
    "logit_bias id past vocab": (C, {"prompt": "Hi", "logit_bias": {str(10**7): 1}}, "logit_bias"),
    "logit_bias id not an integer": (C, {"prompt": "Hi", "logit_bias": {"1.5": 1}}, "logit_bias"),
    "logit_bias below -100": (C, {"prompt": "Hi", "logit_bias": {"5": -100.5}}, "logit_bias"),
    "prompt_logprobs past 20": (C, {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    "prompt_logprobs not an int": (C, {"prompt": "Hi", "prompt_logprobs": 1.5}, "prompt_logprobs"),
    "max_tokens 0 without echo": (C, {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_naming_the_field(http, case):
    path, body, param = BAD[case]
    resp = http.post(path, json=body)
    status = 404 if param == "model" else 400
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err
    assert param.split("[")[0].split(".")[0] in err["message"], err


def test_server_healthy_and_pool_whole_after_bad_input(http, server):
    """Runs after the bad requests above: nothing leaked, the server still answers."""
    assert http.get("/health").status_code == 200
    ok = http.post(E, json={"input": "still fine"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 640
    assert server.wait_pool_full(10), server.state.engine.stats()
    assert not server.engine.requests
