"""The OpenAI-compatible server, live on 127.0.0.1 over the shared Gemma weights, driven by the
real `openai` client: same tokens as the offline API, usage counts, streaming, n, stop, seeds,
logprobs, /metrics, and KV blocks returned when streaming clients walk away."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import SamplingParams
from tests.server_harness import live_server, make_engine

pytestmark = pytest.mark.slow
MODEL = "gemma-test"
PROMPT = "The capital of France is"
LONG_PROMPT = "Paris is the capital and largest city of France, on the river Seine. " * 4


@pytest.fixture(scope="module")
def server(gemma):
    with live_server(make_engine(gemma, kv_cache_gib=0.5), MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(gemma_llm, prompt, max_tokens):
    return gemma_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def _chat_prompt_ids(server, messages) -> list[int]:
    text = server.state.chat_template.render(messages)
    return server.engine.tokenizer.encode(text, add_special_tokens=False)


def test_completion_greedy_matches_offline_api(client, server, gemma_llm):
    ref = _greedy(gemma_llm, PROMPT, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(server.engine.tokenize(PROMPT)) == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream_with_usage(client, gemma_llm):
    ref = _greedy(gemma_llm, PROMPT, 12)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2, "tokens must arrive in several chunks"
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 12
    assert usage.prompt_tokens == len(ref.prompt_token_ids) and usage.total_tokens == usage.prompt_tokens + 12


def test_prompt_as_token_ids_and_batch_of_prompts(client, server, gemma_llm):
    ids = server.engine.tokenize(PROMPT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == _greedy(gemma_llm, PROMPT, 6).text
    other = "Water boils at"
    r = client.completions.create(model=MODEL, prompt=[PROMPT, other], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    texts = {c.index: c.text for c in r.choices}
    assert texts[0] == texts[1] == _greedy(gemma_llm, PROMPT, 6).text
    assert texts[2] == texts[3] == _greedy(gemma_llm, other, 6).text
    assert r.usage.prompt_tokens == len(ids) + len(server.engine.tokenize(other))
    assert r.usage.completion_tokens == 24


def test_chat_greedy_matches_offline_api_on_the_template(client, server, gemma_llm):
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = _chat_prompt_ids(server, messages)
    assert ids[0] == server.engine.tokenizer.bos_token_id and ids.count(ids[0]) == 1, "exactly one BOS"
    ref = gemma_llm.generate(ids, SamplingParams(temperature=0, max_tokens=10))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason


def test_chat_stream_n2_roles_then_content(client, server):
    messages = [{"role": "user", "content": "Tell me a story."}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, n=2,
                                            temperature=0.8, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    by_choice: dict[int, list] = {0: [], 1: []}
    for c in chunks:
        for ch in c.choices:
            by_choice[ch.index].append(ch)
    for index, parts in by_choice.items():
        assert parts[0].delta.role == "assistant" and parts[0].delta.content == ""
        assert all(p.delta.role is None for p in parts[1:])
        assert parts[-1].finish_reason in ("length", "stop")
    assert chunks[-1].usage.completion_tokens <= 16
    assert chunks[-1].usage.prompt_tokens == len(_chat_prompt_ids(server, messages))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, n=2,
                                          temperature=0.8, seed=3)
    for choice in full.choices:  # seeded: the stream and the whole response agree
        assert choice.message.content == "".join(p.delta.content or "" for p in by_choice[choice.index])


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8,
                                         seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3)), "different seeds should not all give the same text"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, gemma_llm, stream):
    full = _greedy(gemma_llm, PROMPT, 16).text
    words = full.split()
    assert len(words) >= 3
    stop = words[2]
    expected = full[:full.index(stop)]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "zzzz"])
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kw).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == expected and finish == "stop"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, alts in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(alts) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(alts.values()))  # greedy picks the most likely token


def test_chat_logprobs_streamed_and_whole(client):
    messages = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.logprob == pytest.approx(tok.top_logprobs[0].logprob)
        assert bytes(tok.bytes).decode() == tok.token
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t.token for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert streamed == [t.token for t in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_models_health_stats_index(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        stats = http.get("/stats").json()
        for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits"):
            assert key in stats
        assert stats["model"] == MODEL and stats["max_model_len"] == server.engine.max_model_len
        page = http.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]


def _samples(text: str) -> dict[str, float]:
    """Sample name (+ finished_reason label) -> summed value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_metrics_parse_and_move(client, server):
    with httpx.Client(base_url=server.url) as http:
        before = _samples(http.get("/metrics").text)
        for _ in range(2):  # the second hits the prefix cache (the prompt spans full 16-token blocks)
            client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=5, temperature=0)
        resp = http.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = _samples(resp.text)
    prompt_len = len(server.engine.tokenize(LONG_PROMPT))
    assert after["kvserve:prompt_tokens_total"] - before.get("kvserve:prompt_tokens_total", 0) == 2 * prompt_len
    assert after["kvserve:generation_tokens_total"] - before.get("kvserve:generation_tokens_total", 0) == 10
    assert after["kvserve:request_success_total{length}"] - before.get("kvserve:request_success_total{length}", 0) == 2
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert after[f"kvserve:{hist}_count"] - before.get(f"kvserve:{hist}_count", 0) == 2
    assert after["kvserve:inter_token_latency_seconds_count"] - before.get(
        "kvserve:inter_token_latency_seconds_count", 0) == 8
    assert after["kvserve:prefix_cache_queries_total"] > before.get("kvserve:prefix_cache_queries_total", 0)
    assert after["kvserve:prefix_cache_hits_total"] > before.get("kvserve:prefix_cache_hits_total", 0)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"kvserve:{gauge}" in after
    assert "kvserve:num_preemptions_total" in after


async def _drop_after_chunks(url: str, i: int, chunks: int) -> int:
    body = {"model": MODEL, "prompt": f"Story number {i}: once upon a time", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0.8, "seed": i, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen >= chunks:
                        break  # leaving the block closes the connection mid-generation
    return seen


def test_streaming_clients_that_disconnect_free_their_blocks(server):
    async def main():
        return await asyncio.gather(*(_drop_after_chunks(server.url, i, 2) for i in range(20)))

    assert asyncio.run(main()) == [2] * 20
    assert server.wait_pool_full(timeout=60), server.state.engine.stats()
    with httpx.Client(base_url=server.url) as http:
        stats = http.get("/stats").json()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
