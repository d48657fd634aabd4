"""AsyncLLMEngine without HTTP: the background step loop gives the offline API's tokens, frees
KV blocks when a consumer leaves (closed or cancelled), sleeps when idle, and reports errors
per request."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import AsyncLLMEngine, RequestError
from kvserve.loading import load_model
from kvserve.sampling_params import RequestOutputKind
from tests.server_harness import make_engine
from tests.tiny_models import make_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_async")
    make_model("llama", folder)
    return load_model(folder)


def _run(tiny_llama, body, async_args: dict | None = None, **config):
    """Run `body(async_engine)` on a fresh engine; return its result and the async engine."""
    engine = AsyncLLMEngine(make_engine(tiny_llama, kv_cache_gib=0.01, **config), **(async_args or {}))

    async def main():
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main()), engine


async def _wait_pool_full(engine: AsyncLLMEngine, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["kv_blocks_free"] == s["kv_blocks_total"] and not engine.engine.requests and not engine.num_unfinished:
            return True
        await asyncio.sleep(0.02)
    return False


def test_deltas_add_up_to_the_offline_output(tiny_llama):
    prompts = ["The quick brown fox", "Paged attention stores"]
    expected = LLM(loaded=tiny_llama, kv_cache_gib=0.01).generate(prompts, GREEDY)

    async def body(engine):
        async def one(i, prompt):
            text, ids, last = "", [], None
            async for out in engine.generate(prompt, GREEDY, f"r{i}"):
                text += out.outputs[0].delta_text
                ids += out.outputs[0].delta_token_ids
                last = out
            return text, ids, last

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results, _ = _run(tiny_llama, body)
    for (text, ids, last), ref in zip(results, expected):
        assert text == ref.text and ids == ref.token_ids
        assert last.finished and last.outputs[0].finish_reason == "length"


def test_closing_or_cancelling_a_consumer_frees_its_blocks(tiny_llama):
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def body(engine):
        stream = engine.generate("The quick brown fox", long, "closed")
        await stream.__anext__()
        await stream.aclose()

        async def consume():
            async for _ in engine.generate("Paged attention", long, "cancelled"):
                pass

        task = asyncio.create_task(consume())
        while engine.stats()["num_requests_running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        never_read = engine.generate("def f(x):", long, "never-read")
        await never_read.aclose()  # closed before iterating: still aborted
        return await _wait_pool_full(engine)

    full, engine = _run(tiny_llama, body)
    assert full, engine.stats()


def test_idle_loop_sleeps(tiny_llama):
    async def body(engine):
        async for _ in engine.generate("The quick", SamplingParams(max_tokens=3), "a"):
            pass
        await asyncio.sleep(0.1)
        before = engine.loop_iterations
        await asyncio.sleep(0.5)
        return before, engine.loop_iterations

    (before, after), _ = _run(tiny_llama, body)
    assert after == before, "an idle engine thread must wait on its condition, not spin"


def test_errors_are_per_request(tiny_llama):
    async def body(engine):
        with pytest.raises(ValueError, match="already in use"):
            engine.generate("x", GREEDY, "dup")
            engine.generate("x", GREEDY, "dup")
        await _drain(engine.generate("x", GREEDY, "dup-ok"))
        with pytest.raises(RequestError) as e:  # the engine refuses it on its own thread
            await _drain(engine.generate("word " * 600, GREEDY, "too-long"))
        assert e.value.status == 400 and "max_model_len" in str(e.value)
        outs = await _drain(engine.generate("The quick", GREEDY, "after"))  # still serving
        return outs[-1]

    last, _ = _run(tiny_llama, body)
    assert last.finished and len(last.token_ids) == 12


async def _drain(stream) -> list:
    return [out async for out in stream]


def test_shutdown_aborts_in_flight_requests(tiny_llama):
    async def body(engine):
        stream = engine.generate("The quick", SamplingParams(max_tokens=400, ignore_eos=True), "long")
        first = await stream.__anext__()
        await engine.shutdown()
        rest = [out async for out in stream]
        return first, rest

    (first, rest), engine = _run(tiny_llama, body)
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert engine.engine.block_manager.num_free_blocks == engine.engine.num_blocks


def test_stats_count_submissions_not_yet_picked_up(tiny_llama):
    engine = AsyncLLMEngine(make_engine(tiny_llama, kv_cache_gib=0.01))

    async def body():  # the loop thread is not started: submissions stay pending
        streams = [engine.generate("The quick", GREEDY, f"p{i}") for i in range(3)]
        stats = engine.stats()
        for s in streams:
            s.close()
        return stats

    stats = asyncio.run(body())
    assert stats["num_requests_waiting"] == 3 and stats["num_requests_running"] == 0
    for key in ("kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
        assert key in stats


def test_a_consumer_that_stops_reading_holds_one_output(tiny_llama):
    """Outputs that arrive while the last one is unread are merged into it (their deltas joined):
    a stalled client costs one output, not one per step, and reads the same tokens and text."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2, seed=1)

    async def body(engine):
        stream = engine.generate([2, 5, 6, 7], params, "stalled")
        while engine.num_unfinished:  # never read while it runs
            await asyncio.sleep(0.01)
        pending = len(stream._stream.queue)
        outs = [o async for o in stream]
        return pending, outs

    (pending, outs), _ = _run(tiny_llama, body)
    assert pending == 1 and len(outs) == 1 and outs[0].finished
    for c in outs[0].outputs:
        assert c.delta_token_ids == c.token_ids and len(c.token_ids) == 30
        assert c.delta_text == c.text


def test_delta_outputs_merged_while_unread_add_up(tiny_llama):
    """With DELTA outputs (what the server streams) a stalled reader's one pending output holds
    every unread token, text piece and logprob, in order."""
    cumulative = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, logprobs=1, n=2)
    delta = dataclasses.replace(cumulative, output_kind=RequestOutputKind.DELTA)

    async def body(engine):
        ref = (await _drain(engine.generate([2, 5, 6, 7], cumulative, "ref")))[-1]
        stream = engine.generate([2, 5, 6, 7], delta, "stalled")
        first = await stream.__anext__()
        while engine.num_unfinished:
            await asyncio.sleep(0.01)
        return ref, [first] + await _drain(stream)

    (ref, outs), _ = _run(tiny_llama, body)
    assert len(outs) == 2
    for c in ref.outputs:
        parts = [o.outputs[c.index] for o in outs]
        assert "".join(p.text for p in parts) == c.text and sum((p.token_ids for p in parts), []) == c.token_ids
        assert sum((p.logprobs for p in parts), []) == c.logprobs
        assert sum((p.top_logprobs for p in parts), []) == c.top_logprobs


def test_a_reader_too_far_behind_is_aborted(tiny_llama):
    """Past max_unread_tokens unread tokens the request is aborted (its blocks freed) and the
    reader, coming back, gets an error instead of a backlog."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def body(engine):
        stream = engine.generate([2, 5, 6, 7], params, "stalled")
        freed = await _wait_pool_full(engine, timeout=20)
        with pytest.raises(RequestError) as e:
            await _drain(stream)
        return freed, e.value, engine.engine.stats()

    (freed, err, stats), engine = _run(tiny_llama, body, async_args={"max_unread_tokens": 8})
    assert freed, stats
    assert err.status == 408 and "backlog" in str(err)
    assert engine.loop_iterations < 100  # given up after a few steps, not after 400
