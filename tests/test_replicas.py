"""Replicas behind the server (kvserve/server/replicas/): engines on Ray Serve, routed by prefix,
round-robin or power of two choices; and `usage.prompt_tokens_details.cached_tokens`.

The oracles: a single in-process engine's greedy outputs (every policy must give the same
text), the engines' own counters of prompt tokens computed, the block arithmetic of a prefix
hit. One Ray cluster with two replicas of a tiny random Llama serves the whole module.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from tests.server_harness import live_server, wait_healthy
from tests.tiny_models import make_model

ray = pytest.importorskip("ray", reason="pip install -e '.[dev]' (ray[serve], the `ray` extra)")
psutil = pytest.importorskip("psutil", reason="comes with ray")
# Ray kills workers when the whole machine is short of memory; on a shared test machine that is
# other processes' doing, not a failure of these tests (the replicas here take ~0.5 GB each).
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

BS = 16
PAGE_BYTES = 3 * 2 * 2 * 16 * 4 * BS  # the tiny Llama: layers x (K, V) x kv heads x head_dim x fp32 x tokens


def _gib(blocks: int) -> float:
    return blocks * PAGE_BYTES / 2**30


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_replicas")
    make_model("llama", folder)
    return folder


def _config(folder, blocks: int) -> EngineConfig:
    return EngineConfig(model=str(folder), kv_cache_gib=_gib(blocks), num_threads=1, max_num_seqs=16)


def _complete(http: httpx.Client, prompt, max_tokens: int = 4, **extra) -> dict:
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _events(resp: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


# ------------------------------------------------------------------ cached_tokens, one engine
def test_cached_tokens_one_engine(tiny_folder):
    """The second request with the same prompt is served from the cache except its last
    partial block (and the last token, which needs its logits): the usage says how much, and it
    is what the engine's own prefix-hit counter grew by."""
    engine = LLMEngine(_config(tiny_folder, 64))
    prompt = list(range(3, 3 + 53))  # 3 full blocks + 5
    with live_server(engine, "tiny") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        first = _complete(http, prompt)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        hits = engine.stats()["prefix_cache_hits"]
        second = _complete(http, prompt)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
        assert engine.stats()["prefix_cache_hits"] - hits == 3 * BS
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                           "stream": True,
                                                           "stream_options": {"include_usage": True}}) as resp:
            usage = _events(resp)[-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * BS
        messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 4}]
        chat = [http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2})
                .json()["usage"] for _ in range(2)]
        assert chat[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert chat[1]["prompt_tokens_details"]["cached_tokens"] == (chat[1]["prompt_tokens"] - 1) // BS * BS > 0


def test_replicas_of_a_gguf_share_the_mapped_file(tmp_path, monkeypatch):
    """Each replica computes a GGUF's blocks from the mapped file, sharing its pages, not a copy of
    its own; other settings pass through, the model path made absolute."""
    from kvserve.server.replicas.pool import replica_engine_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    for weights, asked, want in [("gguf", False, True), ("gguf", True, True), ("float", False, False)]:
        got = replica_engine_config(EngineConfig(model="m.gguf", weights=weights, gguf_mmap=asked, max_num_seqs=3), 2)
        assert (got.gguf_mmap, got.weights, got.max_num_seqs, got.num_threads) == (want, weights, 3, 2)
        assert got.model == str(tmp_path.resolve() / "m.gguf")


def test_replica_flags_are_checked_before_anything_loads(capsys):
    from kvserve.cli import main

    assert main(["serve", "--ray-address", "ray://x:1"]) == 2
    assert "--ray-address needs --data-parallel-size > 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--data-parallel-size", "2", "--router", "random"])
    assert "--router" in capsys.readouterr().err
    for flag, value in [("--router-cache-threshold", "1.5"), ("--router-balance-abs-threshold", "-1"),
                        ("--router-balance-rel-threshold", "0.5")]:
        assert main(["serve", "--data-parallel-size", "2", flag, value]) == 2
        assert flag in capsys.readouterr().err


# ------------------------------------------------------------------ two replicas on Ray Serve


class _Owner:
    """What a RoutedStream reports to: a stand-in for the ReplicaSet."""

    def __init__(self):
        self.ended_streams, self.failed = [], []

    def ended(self, stream):
        self.ended_streams.append(stream.request_id)

    def observe(self, out, first):
        pass

    def replica_failed(self, index, exc):
        from kvserve.engine.async_engine import RequestError

        self.failed.append(index)
        return RequestError(f"replica {index} failed", 503)


class _Response:
    """A replica's response stream: `items` (an exception is raised when reached), then the end."""

    def __init__(self, items):
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.cancelled or not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def _output(k: int, finished: bool = False):
    from kvserve.engine.metrics import RequestMetrics
    from kvserve.engine.outputs import CompletionOutput, RequestOutput

    c = CompletionOutput(0, "x", [k], "length" if finished else None, delta_text="x", delta_token_ids=[k])
    return RequestOutput("r1", None, [1, 2], [c], finished, RequestMetrics(0.0))


@pytest.mark.parametrize("exc,status,dead", [
    (ray.exceptions.RayTaskError("generate", "traceback", ValueError("bug")), 500, False),
    (ray.exceptions.ActorDiedError(), 503, True),
])
def test_an_error_in_the_replica_is_not_a_dead_replica(exc, status, dead):
    """A request whose replica code raised fails with 500 and leaves the replica in the rotation;
    a replica that died fails it with 503 and is taken out."""
    from kvserve.engine.async_engine import RequestError
    from kvserve.server.replicas.pool import RoutedStream

    owner = _Owner()

    async def first_item():
        stream = RoutedStream(owner, 1, "r1", _Response([exc]))
        try:
            return await stream.__anext__()
        finally:
            stream.close()

    with pytest.raises(RequestError) as err:
        asyncio.run(first_item())
    assert err.value.status == status and (owner.failed == [1]) == dead
    assert owner.ended_streams == ["r1"]  # the router's count is released once


def test_a_reader_too_far_behind_is_cut_off_and_the_request_cancelled():
    """--max-stream-backlog with replicas: outputs wait merged in the front; past the limit the
    replica's request is cancelled and the reader gets a 408. A reader that keeps up gets all."""
    from kvserve.engine.async_engine import RequestError
    from kvserve.server.replicas.pool import RoutedStream

    async def run(read_every_step: bool):
        response = _Response([_output(k) for k in range(19)] + [_output(19, finished=True)])
        stream = RoutedStream(_Owner(), 0, "r1", response, max_unread_tokens=5, delta=True)
        tokens = []
        if not read_every_step:
            for _ in range(30):  # the replica streams on; nobody reads
                await asyncio.sleep(0)
        try:
            async for out in stream:
                tokens += out.outputs[0].delta_token_ids
        except RequestError as e:
            return e, response.cancelled
        return tokens, response.cancelled

    err, cancelled = asyncio.run(run(read_every_step=False))
    assert isinstance(err, RequestError) and err.status == 408 and cancelled
    tokens, cancelled = asyncio.run(run(read_every_step=True))
    assert tokens == list(range(20)) and not cancelled


def test_cli_serves_with_replicas_and_leaves_no_process_after_sigterm(tiny_folder):
    """`kvserve serve --data-parallel-size 2` as a process: both replicas answer (round-robin),
    SIGTERM exits 0, and every process Ray started for it is gone."""
    port = socket_port()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", str(tiny_folder), "--port", str(port),
                             "--data-parallel-size", "2", "--router", "round_robin", "--threads", "1",
                             "--served-model-name", "tiny",
                             "--kv-cache-gib", str(_gib(14)), "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 120)
        with httpx.Client(base_url=url, timeout=60) as http:
            texts = {_complete(http, [5, 6, 7, 8], max_tokens=6)["choices"][0]["text"] for _ in range(2)}
            assert len(texts) == 1  # the same greedy text from both replicas
            time.sleep(1.0)  # a stats poll
            assert [r["routed"] for r in http.get("/stats").json()["replicas"]] == [1, 1]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # Ray's own processes and the two replicas
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def socket_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tiny_folder):
    from kvserve.server.replicas.pool import ReplicaOptions, start_replicas

    # Each pool holds 2 of the 4 prefixes below (6 blocks each) and the tail of a running request.
    rs = start_replicas(_config(tiny_folder, 14), ReplicaOptions(2, "prefix", num_cpus=2), None)
    try:
        with live_server(rs, "tiny") as srv:
            yield srv
    finally:
        rs.close()


def _use_policy(srv, policy: str, **router_args) -> None:
    from kvserve.server.replicas.router import Router, RouterConfig

    rs = srv.state.engine
    cfg = RouterConfig(policy=policy, block_size=BS, **router_args)
    rs.router = Router(2, cfg, capacities=[r.info.num_cache_blocks for r in rs.replicas])


def _workload(seed: int, num_prefixes: int = 4, prefix_len: int = 96, n: int = 32) -> list[list[int]]:
    """Random order over prefixes (as round-robin would otherwise pin each prefix by luck)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [prefixes[rng.randrange(num_prefixes)] + [rng.randrange(3, 300) for _ in range(8)] for _ in range(n)]


def _computed(srv) -> int:
    """Prompt tokens the replicas ran through the model, from their own counters."""
    rs = srv.state.engine
    return sum(r.handle.stats.remote().result()["prompt_tokens_computed"] for r in rs.replicas)


def _run(srv, policy: str, prompts: list[list[int]]) -> tuple[list[str], int, float]:
    _use_policy(srv, policy)
    before = _computed(srv)
    texts, cached, total = [], 0, 0
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for p in prompts:
            r = _complete(http, p, max_tokens=4)
            texts.append(r["choices"][0]["text"])
            cached += r["usage"]["prompt_tokens_details"]["cached_tokens"]
            total += r["usage"]["prompt_tokens"]
    return texts, _computed(srv) - before, cached / total


def test_prefix_routing_computes_half_of_round_robin(replicas, tiny_folder):
    """Same workload shape, fresh prefixes per policy: prefix routing computes <= 0.5x the prompt
    tokens round-robin computes, with a hit rate >= 0.7; greedy text is the same under every
    policy and the same as one engine's."""
    results = {p: _run(replicas, p, _workload(seed=i)) for i, p in enumerate(["round_robin", "pow2", "prefix"])}
    rr, prefix = results["round_robin"], results["prefix"]
    assert prefix[1] <= 0.5 * rr[1], {p: r[1:] for p, r in results.items()}
    assert prefix[2] >= 0.7, prefix[2]
    # The oracle for the text: one engine in this process, per workload.
    engine = LLMEngine(_config(tiny_folder, 64))
    from kvserve.sampling_params import SamplingParams

    for i, policy in enumerate(["round_robin", "pow2", "prefix"]):
        prompts = _workload(seed=i)
        for k, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=4, temperature=0), f"{policy}-{k}")
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].text
        assert results[policy][0] == [done[f"{policy}-{k}"] for k in range(len(prompts))], policy


def test_same_outputs_under_every_policy_with_a_concurrent_burst(replicas):
    """All at once (16 requests, 4 prefixes): each replica gets >= 25% of them, and the greedy
    text is the same under every policy."""
    prompts = _workload(seed=10, n=16)

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=replicas.url, timeout=60) as http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0}) for p in prompts))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [r.json()["choices"][0]["text"] for r in rs]

    texts = {}
    for policy in ["prefix", "round_robin", "pow2"]:
        _use_policy(replicas, policy)
        texts[policy] = asyncio.run(burst())
        routed = replicas.state.engine.router.num_routed
        assert min(routed) >= 0.25 * len(prompts), (policy, routed)
    assert texts["prefix"] == texts["round_robin"] == texts["pow2"]


def test_chat_and_stats_through_replicas(replicas, tiny_folder):
    """A chat renders with the model's template in the front and runs on a replica: the same text
    as one engine gives for the same prompt ids; /stats lists each replica."""
    messages = [{"role": "user", "content": "The quick brown fox"}]
    with httpx.Client(base_url=replicas.url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 5,
                                                        "temperature": 0})
        assert chat.status_code == 200, chat.text
        _complete(http, [5, 6, 7])
        time.sleep(1.0)  # a stats poll
        stats = http.get("/stats").json()
        assert http.get("/health").status_code == 200
    assert stats["num_replicas"] == 2 and stats["num_replicas_alive"] == 2
    assert len(stats["replicas"]) == 2 and stats["kv_blocks_total"] == sum(
        r.info.num_blocks for r in replicas.state.engine.replicas)
    with live_server(LLMEngine(_config(tiny_folder, 64)), "tiny") as one, \
            httpx.Client(base_url=one.url, timeout=60) as http:
        ref = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 5,
                                                       "temperature": 0})
    assert chat.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
    assert chat.json()["usage"]["prompt_tokens"] == ref.json()["usage"]["prompt_tokens"]


def test_the_local_ray_listens_on_the_loopback_only(replicas):
    """Every socket the server's own Ray listens on (GCS, raylet, workers, agents, this driver's
    core worker) is bound to the loopback, not to the host's addresses."""
    me = psutil.Process()
    pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 4, listening  # at least the GCS, the raylet, a replica and the HTTP server
    outside = [(c.laddr, psutil.Process(c.pid).name()) for c in listening
               if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not outside, outside


def test_structured_outputs_and_embeddings_through_replicas(replicas, tiny_folder):
    """A choice constraint and an embedding run on a replica as on one engine (same text, same
    vector); a regex that cannot compile is a 400 naming the field, as with one engine."""
    choice = {"model": "tiny", "prompt": "Pick one:", "max_tokens": 8, "temperature": 0,
              "structured_outputs": {"choice": ["alpha beta", "gamma", "delta epsilon"]}}
    embed = {"model": "tiny", "input": ["The quick brown fox", "jumps over the lazy dog"]}
    bad = {"model": "tiny", "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "(unclosed"}}

    def ask(url: str) -> tuple[dict, dict, httpx.Response]:
        with httpx.Client(base_url=url, timeout=60) as http:
            c = http.post("/v1/completions", json=choice)
            e = http.post("/v1/embeddings", json=embed)
            assert c.status_code == 200 and e.status_code == 200, (c.text, e.text)
            return c.json(), e.json(), http.post("/v1/completions", json=bad)

    got, emb, refused = ask(replicas.url)
    with live_server(LLMEngine(_config(tiny_folder, 64)), "tiny") as one:
        ref, ref_emb, ref_refused = ask(one.url)
    assert got["choices"][0]["text"] in choice["structured_outputs"]["choice"]
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    for d, r in zip(emb["data"], ref_emb["data"], strict=True):
        assert d["embedding"] == pytest.approx(r["embedding"], abs=1e-5)
    assert refused.status_code == ref_refused.status_code == 400
    assert refused.json()["error"]["param"] == ref_refused.json()["error"]["param"] == "structured_outputs.regex"


def test_a_drain_aborts_requests_on_their_replicas(replicas):
    """abort_all (what SIGTERM's drain calls after its grace period) ends a running stream with
    finish_reason "abort" from the replica, and frees the request there."""
    rs = replicas.state.engine
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 150, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=replicas.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            replicas.run_coroutine(_abort_all(rs)).result(10)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "abort", events[-1]
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events) < 150
    deadline = time.monotonic() + 10
    while rs.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rs.num_unfinished == 0 and sum(rs.router.load) == 0
    assert all(r.handle.stats.remote().result()["num_unfinished"] == 0 for r in rs.replicas)


async def _abort_all(rs) -> None:
    rs.abort_all()


def test_a_dead_replica_fails_its_requests_cleanly_and_new_ones_go_elsewhere(replicas):
    """Kill the replica running a stream and a plain request: the stream ends with a server_error
    event and the plain request with a 503, both naming the replica (no hang); new requests are
    served by the other replica, and Serve brings the dead one back."""
    from concurrent.futures import ThreadPoolExecutor

    _use_policy(replicas, "prefix")  # the same prompt twice: both on replica 0 (least loaded, then its prefix)
    rs = replicas.state.engine
    victim = ray.get_actor(rs.replicas[0].info.actor_name, namespace="serve")
    prompt = list(range(5, 45))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 150, "ignore_eos": True}
    with httpx.Client(base_url=replicas.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # running on replica 0
            plain = pool.submit(lambda: httpx.post(replicas.url + "/v1/completions", json=body, timeout=60))
            # Both running in the replica's engine: a request Serve had not yet handed to the replica
            # would instead wait for the restarted one.
            while rs.replicas[0].handle.stats.remote().result()["num_unfinished"] < 2 and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            assert rs.router.load == [2, 0]
            ray.kill(victim)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
        failed = plain.result(30)
        assert time.monotonic() - t0 < 30
        errors = [e["error"] for e in events if "error" in e]
        assert errors, events[-1:]
        assert errors[0]["type"] == "server_error" and "replica 0 failed" in errors[0]["message"], errors
        assert failed.status_code == 503 and "replica 0 failed" in failed.json()["error"]["message"], failed.text
        assert rs.router.alive == [False, True] and rs.router.load == [0, 0]
        routed = list(rs.router.num_routed)
        for _ in range(3):  # new requests go to the live replica
            assert _complete(http, prompt)["choices"][0]["text"] is not None
        assert rs.router.num_routed == [routed[0], routed[1] + 3]
        assert http.get("/health").status_code == 200
        deadline = time.monotonic() + 60
        while not all(rs.router.alive) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rs.router.alive == [True, True], "Serve did not bring the replica back"
