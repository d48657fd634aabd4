"""`kvserve bench serve` against a fake OpenAI-compatible streaming server whose delays, failures
and concurrency are known, so the client's measurements can be checked (no model is loaded)."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import uvicorn
from conftest import (
    WIKITEXT,  # tests/ is on sys.path under both `pytest` and `python -m pytest`
)
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.cli import main
from kvserve.tools.bench import serve
from kvserve.tools.bench.serve import (
    SLO,
    BenchRequest,
    RequestResult,
    ServeTarget,
    arrival_offsets,
    parse_goodput,
    parse_rates,
    percentile,
    run_requests,
    summarize_ms,
    summarize_run,
)

FIRST_DELAY = 0.04  # fake server: seconds before the first content chunk
CHUNK_DELAY = 0.01  # fake server: seconds between content chunks


# --------------------------------------------------------------------------- the fake server


@dataclass
class FakeState:
    """What the fake does and what it saw. Request `i` is the i-th to arrive."""

    first_delay: float = FIRST_DELAY
    chunk_delay: float = CHUNK_DELAY
    slow_every: int = 0  # every k-th arrival waits slow_first_delay before its first chunk
    slow_first_delay: float = 0.4
    fail_every: int = 0  # every k-th arrival fails: HTTP 500 and 400 alternately
    midstream_error_every: int = 0  # every k-th arrival streams one chunk, then an error object
    send_usage: bool = True
    cached_share: float | None = None  # report this share of the prompt's words as cached_tokens
    hold_until_active: int = 0  # >0: hold first chunks until this many streams are open (or all arrived)
    expected: int = 0  # requests the test sends; once all arrived, held streams are released
    count: int = 0
    active: int = 0
    peak: int = 0
    arrivals: list[float] = field(default_factory=list)
    payloads: list[dict] = field(default_factory=list)


def _chunk(chat: bool, text: str | None, finish: str | None = None, role: bool = False) -> str:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        obj = "text_completion"
    return "data: " + json.dumps({"id": "x", "object": obj, "model": "fake-model", "choices": [choice]}) + "\n\n"


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(i: int, body: dict, chat: bool):
        state.active += 1
        state.peak = max(state.peak, state.active)
        try:
            n = int(body["max_tokens"])
            if chat:
                yield _chunk(chat, None, role=True)  # role-only chunk: no content, must not end TTFT
            slow = state.slow_every and i % state.slow_every == state.slow_every - 1
            if state.hold_until_active:
                # A barrier instead of a guessed delay: the peak is then exact however slow the CPU.
                deadline = time.perf_counter() + 10.0
                while (state.active < state.hold_until_active and state.count < state.expected
                       and time.perf_counter() < deadline):
                    await asyncio.sleep(0.005)
            await asyncio.sleep(state.slow_first_delay if slow else state.first_delay)
            for k in range(n):
                if k:
                    await asyncio.sleep(state.chunk_delay)
                yield _chunk(chat, f" tok{k}", "length" if k == n - 1 else None)
                if state.midstream_error_every and i % state.midstream_error_every == state.midstream_error_every - 1:
                    yield "data: " + json.dumps({"error": {"message": f"engine died on {i}", "code": 500}}) + "\n\n"
                    return
            if state.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                prompt = body["messages"][0]["content"] if chat else body["prompt"]
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                         "total_tokens": len(prompt.split()) + n}
                if state.cached_share is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": int(state.cached_share * len(prompt.split()))}
                yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            state.active -= 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        i = state.count
        state.count += 1
        state.arrivals.append(time.perf_counter())
        state.payloads.append(body)
        if state.fail_every and i % state.fail_every == state.fail_every - 1:
            status = 500 if (i // state.fail_every) % 2 else 400
            return JSONResponse({"error": {"message": f"fake failure {i}", "code": status}}, status_code=status)
        return StreamingResponse(stream(i, body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    """(base URL, state): uvicorn in a background thread on a free 127.0.0.1 port."""
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(fake_server):
    """The server with its state reset to defaults for each test."""
    url, state = fake_server
    fresh = FakeState()
    for name in fresh.__dataclass_fields__:
        setattr(state, name, getattr(fresh, name))
    return url, state


def _requests(n: int, output_len: int = 5, input_len: int = 12) -> list[BenchRequest]:
    return serve.random_requests(n, input_len, output_len, seed=3)


def _run(url: str, reqs, rate=math.inf, max_concurrency=None, seed=0, endpoint="completions"):
    target = ServeTarget(url, "fake-model", endpoint, timeout_s=30)
    return asyncio.run(run_requests(target, reqs, rate, max_concurrency, seed, progress=False))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- measurements


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_all_complete_with_right_counts_and_plausible_latency(fake, endpoint):
    url, state = fake
    reqs = _requests(6, output_len=5, input_len=12)
    results, duration = _run(url, reqs, endpoint=endpoint)
    assert all(r.success for r in results), [r.error for r in results]
    for r in results:
        assert r.output_tokens == 5 and r.prompt_tokens == 12 and r.usage_reported
        # A chunk cannot be read before it is sent (chat's role-only chunk comes at once: not a
        # token); single gaps can be shorter than the server's when a busy client reads late.
        assert r.ttft_s >= FIRST_DELAY - 0.002
        assert len(r.itl_s) == 4 and all(g >= 0 for g in r.itl_s)
        assert r.ttft_s + sum(r.itl_s) >= FIRST_DELAY + 4 * CHUNK_DELAY - 0.002
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s)
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 4)
    assert duration >= FIRST_DELAY + 4 * CHUNK_DELAY - 0.01
    body = state.payloads[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"
    assert ("messages" in body) == (endpoint == "chat")
    s = summarize_run(results, duration, math.inf)
    assert s.completed == 6 and s.failed == 0
    assert s.output_tokens == 30 and s.input_tokens == 72
    assert s.output_throughput == pytest.approx(30 / duration)
    assert s.total_token_throughput == pytest.approx(102 / duration)
    assert s.ttft_ms.median >= FIRST_DELAY * 1000 - 2
    assert 0.3 * CHUNK_DELAY * 1000 <= s.itl_ms.median < CHUNK_DELAY * 1000 + 200


def test_without_usage_chunk_counts_content_chunks(fake):
    url, state = fake
    state.send_usage = False
    results, _ = _run(url, _requests(3, output_len=4))
    assert all(r.success and r.output_tokens == 4 and r.prompt_tokens is None and not r.usage_reported
               for r in results)
    assert summarize_run(results, 1.0, math.inf).requests_without_usage == 3


def test_poisson_pacing_follows_seeded_schedule(fake):
    url, state = fake
    n, rate, seed = 16, 40.0, 7
    planned = arrival_offsets(n, rate, seed)
    for attempt in range(3):
        state.arrivals.clear()
        results, duration = _run(url, _requests(n, output_len=2), rate=rate, seed=seed)
        late = [r.sent_s - r.scheduled_s for r in results]
        on_time = min(late) >= -1e-3 and np.median(late) < 0.02 and max(late) < 0.25
        # A stall of the shared host delays every send after it (fresh-clone runs on the 2-core dev
        # VM saw 0.6-0.9 s once each, and CI once a 0.15 s stall early on that made the median
        # late): more runs, same bounds. Early sends are a bug a rerun cannot hide.
        if on_time or min(late) < -1e-3:
            break
    assert [r.scheduled_s for r in results] == planned
    assert on_time, late
    seen = np.sort(np.array(state.arrivals) - state.arrivals[0])  # as the server saw them
    assert np.median(np.abs(seen - (np.array(planned) - planned[0]))) < 0.02
    assert planned[-1] <= duration <= planned[-1] + 1.5
    assert 0.3 * n / rate < duration < 3 * n / rate  # roughly N/R


def test_arrival_offsets_are_exponential_and_seeded():
    rate = 5.0
    t = np.array(arrival_offsets(20_000, rate, seed=1))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # exponential: std == mean
    assert np.median(gaps) == pytest.approx(math.log(2) / rate, rel=0.05)
    assert arrival_offsets(10, rate, 1) == arrival_offsets(10, rate, 1) != arrival_offsets(10, rate, 2)
    assert arrival_offsets(4, math.inf, 1) == [0.0] * 4


@pytest.mark.parametrize("limit", [2, 3])
def test_max_concurrency_never_exceeded(fake, limit):
    url, state = fake
    state.hold_until_active, state.expected = limit, 9  # each wave is held until it is complete
    results, _ = _run(url, _requests(9, output_len=4), max_concurrency=limit)
    assert all(r.success for r in results)
    assert state.peak == limit  # all sent at once: the bound is reached, never passed


def test_unbounded_concurrency_sends_all_at_once(fake):
    url, state = fake
    state.hold_until_active, state.expected = 8, 8
    _run(url, _requests(8, output_len=4))
    assert state.peak == 8


def test_failed_requests_are_counted_not_fatal(fake):
    url, state = fake
    state.fail_every = 3
    state.midstream_error_every = 0
    results, duration = _run(url, _requests(9, output_len=3))
    s = summarize_run(results, duration, math.inf)
    assert (s.completed, s.failed) == (6, 3)
    assert s.output_tokens == 18
    errors = [r.error for r in results if not r.success]
    assert any(e.startswith("HTTP 400: fake failure") for e in errors)
    assert any(e.startswith("HTTP 500: fake failure") for e in errors)
    assert s.errors and all("fake failure" in e for e in s.errors)


def test_error_inside_stream_is_a_failure(fake):
    url, state = fake
    state.midstream_error_every = 2
    results, _ = _run(url, _requests(4, output_len=3))
    failed = [r for r in results if not r.success]
    assert len(failed) == 2 and all("engine died" in r.error for r in failed)


def test_connection_refused_is_a_failed_request_not_a_crash():
    url = f"http://127.0.0.1:{_free_port()}"
    results, _ = _run(url, _requests(2))
    assert not any(r.success for r in results) and all("Connect" in r.error for r in results)


def test_whole_request_timeout_is_a_failure(fake):
    url, state = fake
    state.first_delay = 3.0  # far past the timeout: a run that waited for the answer takes >= 3 s
    target = ServeTarget(url, "fake-model", timeout_s=0.15)
    results, duration = asyncio.run(run_requests(target, _requests(2), math.inf, progress=False))
    assert duration < 2.0 and all(not r.success and "timed out after 0.15 s" in r.error for r in results)


def test_goodput_counts_only_requests_meeting_slos(fake):
    url, state = fake
    # Half the arrivals wait 2 s for their first chunk, the others 0.04 s: a 1 s SLO splits them
    # with room for a busy host, where a 0.4 s wait against 250 ms can misclassify the fast ones.
    state.slow_every, state.slow_first_delay = 2, 2.0
    results, duration = _run(url, _requests(8, output_len=3))
    s = summarize_run(results, duration, math.inf, slo=SLO(ttft_ms=1000))
    assert s.completed == 8 and s.good_requests == 4
    assert s.goodput == pytest.approx(4 / duration)
    assert s.slo_ms == {"ttft": 1000}


def test_goodput_checks_every_slo():
    def req(ttft, e2e, n, ok=True):
        return RequestResult(0, success=ok, ttft_s=ttft, e2e_s=e2e, output_tokens=n)

    slo = SLO(ttft_ms=100, tpot_ms=10, e2e_ms=500)
    assert slo.met_by(req(0.1, 0.19, 10))  # TPOT = 90 ms / 9 = 10 ms: on the limit counts
    assert not slo.met_by(req(0.101, 0.19, 10))  # TTFT over
    assert not slo.met_by(req(0.05, 0.2, 10))  # TPOT 16.7 ms
    assert not slo.met_by(req(0.05, 0.6, 100))  # E2E over
    assert slo.met_by(req(0.05, 0.3, 1))  # one token: no TPOT to miss
    assert not slo.met_by(req(0.05, 0.1, 10, ok=False))  # failures are never good
    results = [req(0.05, 0.1, 10), req(0.2, 0.3, 10), req(0.05, 0.1, 10, ok=False)]
    s = summarize_run(results, 2.0, 1.0, slo=SLO(ttft_ms=100))
    assert s.good_requests == 1 and s.goodput == 0.5


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 4.0, 9.0],
                                    list(np.random.default_rng(0).exponential(50.0, 101)),
                                    list(np.random.default_rng(1).normal(10.0, 3.0, 1000))])
def test_percentile_matches_numpy(values):
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-12)
    st = summarize_ms([v / 1000 for v in values])
    assert st.mean == pytest.approx(np.mean(values))
    assert st.median == pytest.approx(np.median(values))
    assert st.p99 == pytest.approx(np.percentile(values, 99))


def test_empty_statistics_are_none():
    assert percentile([], 50) is None
    assert summarize_ms([]) == serve.Stats(None, None, None)
    s = summarize_run([RequestResult(0, error="HTTP 500: x")], 1.0, 2.0)
    assert s.completed == 0 and s.failed == 1 and s.ttft_ms.median is None and s.errors == ["1x HTTP 500: x"]


# --------------------------------------------------------------------------- datasets and flags


def test_random_dataset_is_seeded_and_sized():
    a = serve.random_requests(5, 30, 7, seed=1)
    assert a == serve.random_requests(5, 30, 7, seed=1) != serve.random_requests(5, 30, 7, seed=2)
    assert all(len(r.prompt.split()) == 30 and r.output_len == 7 for r in a)
    assert len({r.prompt for r in a}) == 5


def test_wikitext_dataset_slices_passages():
    path = WIKITEXT / "wiki.test.raw"
    reqs = serve.build_requests("wikitext2", 4, 50, 8, seed=0, dataset_path=str(path))
    text = " ".join(serve.load_wikitext_words(path))
    for r in reqs:
        assert len(r.prompt.split()) == 50 and r.prompt in text and r.output_len == 8
    assert serve.build_requests("wikitext2", 4, 50, 8, seed=0, dataset_path=str(WIKITEXT))[0] == reqs[0]


def test_wikitext_default_path_found():
    assert serve.default_wikitext_path().name == "wiki.test.raw"


@pytest.mark.parametrize("text,expected", [("1", [1.0]), ("0.5, 2,inf", [0.5, 2.0, math.inf])])
def test_parse_rates(text, expected):
    assert parse_rates(text) == expected


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == SLO(500.0, 50.0, None)
    assert parse_goodput(["e2e:1e4,ttft:1"]) == SLO(1.0, None, 10000.0)


# --------------------------------------------------------------------------- CLI


def test_cli_sweep_writes_json_and_plot(fake, tmp_path, capsys):
    url, state = fake
    state.fail_every = 4
    out_json, out_png = tmp_path / "r" / "serve.json", tmp_path / "serve.png"
    argv = ["bench", "serve", "--url", url + "/", "--request-rate", "50,inf", "--num-prompts", "8",
            "--input-len", "10", "--output-len", "4", "--goodput", "ttft:5000", "e2e:10000",
            "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for word in ("rate=50", "rate=inf", "TTFT mean / median / p99 (ms)", "goodput (req/s)", "fake failure",
                 "output tok/s"):
        assert word in out
    data = json.loads(out_json.read_text())
    assert data["config"]["model"] == "fake-model" and "api_key" not in data["config"]
    runs = data["runs"]
    assert [r["request_rate"] for r in runs] == [50.0, "inf"]
    for r in runs:
        assert (r["completed"], r["failed"]) == (6, 2)
        assert r["output_tokens"] == 24 and r["input_tokens"] == 60
        assert r["good_requests"] == 6 and r["slo_ms"] == {"ttft": 5000.0, "e2e": 10000.0}
        assert set(r["ttft_ms"]) == {"mean", "median", "p99"} and r["tpot_ms"]["median"] > 0
        assert len(r["requests"]) == 8 and len(r["errors"]) == 2
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    prompts = [p["prompt"] for p in state.payloads]
    assert len(set(prompts)) == 16  # each rate has its own prompts: no prefix-cache carry-over


def test_cli_all_failed_exits_1(fake, capsys):
    url, state = fake
    state.fail_every = 1
    assert main(["bench", "serve", "--url", url, "--num-prompts", "2", "--input-len", "3", "--output-len", "2"]) == 1
    captured = capsys.readouterr()
    assert "no request completed" in captured.err and "fake failure" in captured.out


@pytest.mark.parametrize("extra,message", [
    (["--goodput", "ttft=5"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--goodput", "ttft:-1"], "--goodput"),
    (["--goodput", "ttft:1", "ttft:2"], "given twice"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "2,-1"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--timeout", "0"], "--timeout"),
    (["--url", "localhost:8000"], "--url"),
    (["--dataset", "wikitext2", "--dataset-path", "/no/such/wiki.raw"], "/no/such/wiki.raw"),
])
def test_cli_bad_input_exits_2_with_message(fake, extra, message, capsys):
    url, _ = fake
    argv = ["bench", "serve", "--url", url, "--num-prompts", "2", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and message in err and "Traceback" not in err


def test_cli_unreachable_url_exits_2(capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    assert main(["bench", "serve", "--url", url, "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert "--url" in err and url in err and "cannot reach" in err and "Traceback" not in err


def test_cli_bad_concurrency_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--max-concurrency", "0"])
    assert e.value.code == 2 and "--max-concurrency" in capsys.readouterr().err


# --------------------------------------------------------------------------- shared-prefix workload
def test_shared_prefix_workload_shape():
    spec = serve.SharedPrefixSpec(num_prefixes=3, prefix_len=20, suffix_len=4, turns=2)
    reqs = serve.shared_prefix_requests(11, spec, 5, seed=1)
    assert len(reqs) == 11 and reqs == serve.shared_prefix_requests(11, spec, 5, seed=1)
    prefixes = {" ".join(r.prompt.split()[:20]) for r in reqs}
    assert len(prefixes) <= 3
    firsts, seconds = reqs[:6], reqs[6:]  # 6 conversations: all first turns, then second turns
    assert all(len(r.prompt.split()) == r.input_words == 24 for r in firsts)
    assert all(len(r.prompt.split()) == r.input_words == 28 for r in seconds)
    assert len({r.prompt for r in firsts}) == 6  # unique suffixes
    for r in seconds:  # a later turn repeats its conversation's first turn
        assert any(r.prompt.startswith(f.prompt + " ") for f in firsts)


def test_shared_prefix_bad_sizes_name_the_flag():
    with pytest.raises(ValueError, match="--prefix-len"):
        serve.SharedPrefixSpec(prefix_len=0)


def test_cli_shared_prefix_reports_the_hit_rate(fake, tmp_path, capsys):
    url, state = fake
    state.cached_share = 0.75
    out_json = tmp_path / "sp.json"
    argv = ["bench", "serve", "--url", url, "--workload", "shared-prefix", "--num-prompts", "6",
            "--num-prefixes", "2", "--prefix-len", "12", "--suffix-len", "4", "--output-len", "2",
            "--json", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prefix hit rate (cached / prompt tokens) | 0.750" in out and "shared-prefix: 2 prefixes" in out
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["cached_tokens"] == 6 * 12 and run["prefix_hit_rate"] == 0.75
    assert len({" ".join(p["prompt"].split()[:12]) for p in state.payloads}) <= 2
