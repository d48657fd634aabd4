"""The server under load and trouble, on a tiny random Llama (fast): 200 concurrent streams,
a full queue (429), an engine step that raises, clients that hang up on non-streaming
requests, and a drain for shutdown (503 for newcomers, in-flight finish, stragglers aborted)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from kvserve.loading import load_model
from tests.server_harness import live_server, make_engine
from tests.tiny_models import make_model

MODEL = "tiny"
C = "/v1/completions"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_robust")
    make_model("llama", folder)
    return load_model(folder)


def _slow_steps(engine, seconds: float) -> None:
    """Make every engine step take at least `seconds`, so a request stays in flight."""
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.step = slow


async def _stream_completion(http: httpx.AsyncClient, i: int) -> dict:
    max_tokens = 8 + i % 9
    body = {"model": MODEL, "prompt": f"The quick brown fox {i}", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.7, "seed": i, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    result = {"max_tokens": max_tokens, "tokens": 0, "finish": [], "usage": None, "done": False, "text": ""}
    async with http.stream("POST", C, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                result["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result["usage"] = chunk["usage"]
                for ch in chunk["choices"]:
                    result["tokens"] += len(ch["logprobs"]["tokens"]) if ch["logprobs"] else 0
                    result["text"] += ch["text"]
                    if ch["finish_reason"]:
                        result["finish"].append(ch["finish_reason"])
    return result


def test_200_concurrent_streams_all_complete(tiny_llama):
    with live_server(make_engine(tiny_llama, kv_cache_gib=0.02), MODEL) as srv:
        async def main():
            limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
            async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as http:
                return await asyncio.gather(*(_stream_completion(http, i) for i in range(200)))

        t0 = time.perf_counter()
        results = asyncio.run(main())
        elapsed = time.perf_counter() - t0
        assert len(results) == 200
        for r in results:
            assert r["done"] and r["finish"] == ["length"], r
            assert r["tokens"] == r["max_tokens"] == r["usage"]["completion_tokens"], r
            assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["max_tokens"]
        assert srv.wait_pool_full(10), srv.state.engine.stats()
        stats = httpx.get(srv.url + "/stats").json()
        assert stats["num_preemptions"] >= 0 and stats["kv_cache_usage_perc"] == 0.0
        print(f"200 streams, {sum(r['max_tokens'] for r in results)} tokens in {elapsed:.1f} s")


def test_queue_full_gives_429(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_gib=0.01, max_num_seqs=1)
    _slow_steps(engine, 0.02)
    with live_server(engine, MODEL, max_queue=1) as srv:
        async def main():
            long = {"model": MODEL, "prompt": "The quick", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                async with http.stream("POST", C, json=long) as running:
                    await running.aiter_lines().__anext__()  # generating: it holds the only slot
                    async with http.stream("POST", C, json=long) as queued:  # waits: the queue is full
                        assert queued.status_code == 200
                        refused = await http.post(C, json={**long, "stream": False})
                        assert refused.status_code == 429
                        err = refused.json()["error"]
                        assert err["code"] == "queue_full" and "max_queue" in err["message"]

        asyncio.run(main())
        assert srv.wait_pool_full(10), srv.state.engine.stats()
        ok = httpx.post(srv.url + C, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_engine_step_failure_fails_the_request_and_keeps_serving(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    real_step, calls = engine.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.step = flaky_step
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 6, "ignore_eos": True}
    with live_server(engine, MODEL) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        failed = http.post(C, json=body)
        assert failed.status_code == 500
        err = failed.json()["error"]
        # The client gets a reference to the log entry, not the exception's text
        assert err["type"] == "server_error" and "log reference" in err["message"]
        assert "simulated" not in err["message"] and "RuntimeError" not in err["message"]
        assert srv.wait_pool_full(10)
        ok = http.post(C, json=body)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        calls["n"] = 2  # the next step fails again, this time under a stream
        lines = [ln for ln in http.post(C, json={**body, "stream": True}).text.splitlines() if ln.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and "log reference" in lines[-2] and "simulated" not in lines[-2]
        assert json.loads(lines[-2][6:])["error"]["type"] == "server_error"
        assert http.get("/health").status_code == 200
        assert srv.wait_pool_full(10)


def test_a_failure_pinned_on_one_request_fails_only_it(tiny_llama):
    """The engine runs a failed step's sequences alone: the request whose pass fails gets a 500
    (a log reference, no exception text), the one batched with it is answered in full."""
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    poison = 7
    execute_greedy = engine.runner.execute_greedy

    def fragile(inputs, *args, **kwargs):
        if any(poison in i.token_ids for i in inputs):
            raise RuntimeError("simulated kernel fault")
        return execute_greedy(inputs, *args, **kwargs)

    engine.runner.execute_greedy = fragile
    _slow_steps(engine, 0.02)  # both requests reach the engine before its first step ends
    good = {"model": MODEL, "prompt": [2, 5, 6], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    bad = {**good, "prompt": [2, poison, 6]}

    async def both(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            return await asyncio.gather(http.post(C, json=good), http.post(C, json=bad))

    with live_server(engine, MODEL) as srv:
        ok, failed = asyncio.run(both(srv.url))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        err = failed.json()["error"]
        assert failed.status_code == 500 and "log reference" in err["message"] and "simulated" not in err["message"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert srv.wait_pool_full(10)


def test_steps_failing_in_a_row_make_the_engine_unhealthy(tiny_llama):
    """A failure no request can be blamed for (every step fails): after UNHEALTHY_AFTER in a row
    /health answers 503 and new requests get 503 at once instead of queueing forever."""
    from kvserve.engine.async_engine import UNHEALTHY_AFTER

    engine = make_engine(tiny_llama, kv_cache_gib=0.01)

    def broken_step():
        raise RuntimeError("simulated device loss")

    engine.step = broken_step
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 4}
    with live_server(engine, MODEL) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        statuses = [http.post(C, json=body).status_code for _ in range(UNHEALTHY_AFTER)]
        assert statuses == [500] * UNHEALTHY_AFTER
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unhealthy"
        refused = http.post(C, json=body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unhealthy"
        assert srv.state.engine.num_unfinished == 0


def test_non_streaming_client_disconnect_aborts(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    _slow_steps(engine, 0.02)  # 400 tokens would take ~8 s
    with live_server(engine, MODEL) as srv:
        body = {"model": MODEL, "prompt": "The quick", "max_tokens": 400, "ignore_eos": True}
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + C, json=body, timeout=httpx.Timeout(30, read=0.5))
        assert srv.wait_pool_full(3), srv.state.engine.stats()
        assert time.monotonic() - t0 < 5, "the request must be aborted, not run to its end"


def test_drain_lets_in_flight_finish_and_refuses_new(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    _slow_steps(engine, 0.01)
    with live_server(engine, MODEL) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "The quick", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with http.stream("POST", C, json=body) as resp:
            lines = resp.iter_lines()
            next(lines)
            drained = srv.run_coroutine(srv.state.drain(timeout=30))
            time.sleep(0.1)
            refused = http.post(C, json={**body, "stream": False})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert http.get("/health").status_code == 503
            rest = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        drained.result(timeout=10)
        assert srv.wait_pool_full(5)


def test_drain_timeout_aborts_stragglers(tiny_llama):
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    _slow_steps(engine, 0.02)
    with live_server(engine, MODEL) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "The quick", "max_tokens": 400, "ignore_eos": True, "stream": True}
        result: dict = {}

        def non_streaming():
            result["resp"] = http.post(C, json={**body, "stream": False})

        waiter = threading.Thread(target=non_streaming)
        with http.stream("POST", C, json=body) as resp:
            lines = resp.iter_lines()
            next(lines)
            waiter.start()
            deadline = time.monotonic() + 10
            while srv.state.engine.num_unfinished < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # both requests are in the engine before the drain begins
            drained = srv.run_coroutine(srv.state.drain(timeout=0.3))
            rest = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        waiter.join(10)
        assert rest[-1]["choices"][0]["finish_reason"] == "abort"
        assert result["resp"].status_code == 200
        assert result["resp"].json()["choices"][0]["finish_reason"] == "abort"
        drained.result(timeout=10)
        assert srv.wait_pool_full(5)


def test_request_timeout_finishes_with_length(tiny_llama):
    """--request-timeout: past its deadline a request ends with what it has, finish_reason
    "length", its blocks freed; streamed or not."""
    from kvserve.server.limits import RequestLimits

    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    _slow_steps(engine, 0.02)  # 400 tokens would take ~8 s
    with live_server(engine, MODEL, limits=RequestLimits(request_timeout=0.5)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "The quick", "max_tokens": 400, "ignore_eos": True}
        t0 = time.monotonic()
        out = http.post(C, json=body).json()
        assert out["choices"][0]["finish_reason"] == "length"
        assert 0 < out["usage"]["completion_tokens"] < 400 and time.monotonic() - t0 < 5
        lines = [json.loads(ln[6:]) for ln in http.post(C, json={**body, "stream": True}).text.splitlines()
                 if ln.startswith("data: {")]
        assert lines[-1]["choices"][0]["finish_reason"] == "length"
        assert srv.wait_pool_full(5)
