"""Two replicas behind one server on Ray Serve: prefix-aware routing vs round-robin vs power of two
choices on the shared-prefix workload (`kvserve bench serve --workload shared-prefix`).

Per policy, a fresh set of prompts (K system prompts of L words, unique suffixes) is sent with at
most --max-concurrency requests in flight to the same two replicas, whose KV pools hold about half
the prefixes each; then one more fresh set under prefix routing all at once (a burst: how it
spreads over the replicas).
Reported: TTFT p50/p99, throughput, the prefix hit rate (cached_tokens / prompt tokens), the
prompt tokens the replicas computed (their own counters), each replica's share of the requests;
then a fixed set of prompts under every policy, whose greedy texts must be the same; and Ray's
start time and the resident memory of its processes.

    python benchmarks/replicas.py [--num-prompts 64 --num-prefixes 8 --prefix-len 512 --kv-cache-gib 0.1]
        [--out-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time

import httpx
import psutil
import uvicorn

from _common import machine, save_json
from kvserve import EngineConfig
from kvserve.server import build_app
from kvserve.server.launch import ServeOptions, uvicorn_config
from kvserve.server.replicas.pool import ReplicaOptions, start_replicas
from kvserve.server.replicas.router import Router, RouterConfig
from kvserve.tools.bench.serve import ServeTarget, SharedPrefixSpec, run_requests, shared_prefix_requests, summarize_run

POLICIES = ("round_robin", "pow2", "prefix")


class Server:
    def __init__(self, app, port: int):
        config = uvicorn_config(app, ServeOptions(port=port, log_level="warning"))
        config.access_log = False
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Server":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def use_policy(rs, policy: str) -> None:
    cfg = RouterConfig(policy=policy, block_size=rs.router.config.block_size)
    rs.router = Router(len(rs.replicas), cfg, capacities=[r.info.num_cache_blocks for r in rs.replicas])


def computed(rs) -> int:
    return counter(rs, "prompt_tokens_computed")


def counter(rs, key: str) -> int:
    """A counter summed over the replicas, from the replicas themselves."""
    return sum(r.handle.stats.remote().result()[key] for r in rs.replicas)


def ray_memory(replica_pids: set[int]) -> dict:
    """Resident MiB of this process's descendants: the replicas, and Ray's own processes."""
    rss = {"replicas_mib": 0.0, "ray_other_mib": 0.0, "ray_processes": {}}
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            mib = p.memory_info().rss / 2**20
            name = p.name()
        except psutil.Error:
            continue
        key = "replicas_mib" if p.pid in replica_pids else "ray_other_mib"
        rss[key] += mib
        if p.pid not in replica_pids:
            rss["ray_processes"][name] = round(rss["ray_processes"].get(name, 0.0) + mib, 1)
    rss["driver_mib"] = psutil.Process(os.getpid()).memory_info().rss / 2**20
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in rss.items()}


def greedy_texts(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    with httpx.Client(base_url=url, timeout=600) as http:
        return [http.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": max_tokens,
                                                   "temperature": 0}).json()["choices"][0]["text"] for p in prompts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--kv-cache-gib", type=float, default=0.1, help="per replica: about half the prefixes")
    ap.add_argument("--max-concurrency", type=int, default=16, help="requests in flight (0: all at once)")
    ap.add_argument("--pack-weights", action="store_true",
                    help="packed fp32 panels (faster decode, about twice the weights' memory per replica)")
    ap.add_argument("--no-sliding-window-release", dest="sliding_window_release", action="store_false",
                    help="sliding-window layers keep their blocks (a diagnostic: their released pages are "
                         "evicted first, and a prefix hit needs them)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    config = EngineConfig(model=args.model, kv_cache_gib=args.kv_cache_gib, max_num_seqs=64,
                          pack_weights=args.pack_weights, sliding_window_release=args.sliding_window_release)
    t0 = time.perf_counter()
    rs = start_replicas(config, ReplicaOptions(2, "prefix"), None)
    ready_s = time.perf_counter() - t0
    spec = SharedPrefixSpec(args.num_prefixes, args.prefix_len, args.suffix_len)
    results = {}
    try:
        app = build_app(rs, "m")
        with Server(app, args.port) as srv:
            target = ServeTarget(srv.url, "m", timeout_s=1800)
            memory = ray_memory({r.info.pid for r in rs.replicas})
            for k, policy in enumerate(POLICIES):
                use_policy(rs, policy)
                reqs = shared_prefix_requests(args.num_prompts, spec, args.output_len, seed=100 + k)
                before, preempted = computed(rs), counter(rs, "num_preemptions")
                res, dur = asyncio.run(run_requests(target, reqs, float("inf"), args.max_concurrency or None,
                                                    progress=False))
                s = summarize_run(res, dur, float("inf"), args.max_concurrency or None)
                results[policy] = {
                    "completed": s.completed, "failed": s.failed, "errors": s.errors, "duration_s": round(dur, 2),
                    "ttft_p50_ms": s.ttft_ms.median, "ttft_p99_ms": s.ttft_ms.p99,
                    "request_throughput": s.request_throughput, "output_tok_s": s.output_throughput,
                    "total_tok_s": s.total_token_throughput, "prefix_hit_rate": s.prefix_hit_rate,
                    "prompt_tokens": s.input_tokens, "prompt_tokens_computed": computed(rs) - before,
                    "preemptions": counter(rs, "num_preemptions") - preempted,
                    "share_per_replica": [n / max(1, sum(rs.router.num_routed)) for n in rs.router.num_routed],
                }
                print(policy, json.dumps(results[policy]), flush=True)
            use_policy(rs, "prefix")
            burst = shared_prefix_requests(args.num_prompts, spec, args.output_len, seed=500)
            before = computed(rs)
            res, dur = asyncio.run(run_requests(target, burst, float("inf"), progress=False))
            s = summarize_run(res, dur, float("inf"))
            results["prefix_burst"] = {
                "completed": s.completed, "failed": s.failed, "duration_s": round(dur, 2),
                "ttft_p50_ms": s.ttft_ms.median, "ttft_p99_ms": s.ttft_ms.p99, "prefix_hit_rate": s.prefix_hit_rate,
                "prompt_tokens_computed": computed(rs) - before,
                "share_per_replica": [n / max(1, sum(rs.router.num_routed)) for n in rs.router.num_routed]}
            print("prefix_burst", json.dumps(results["prefix_burst"]), flush=True)
            fixed = [r.prompt for r in shared_prefix_requests(8, spec, 0, seed=999)]
            texts = {}
            for policy in POLICIES:
                use_policy(rs, policy)
                texts[policy] = greedy_texts(srv.url, fixed, 16)
            memory_after = ray_memory({r.info.pid for r in rs.replicas})
    finally:
        rs.close()
    rr, pf = results["round_robin"], results["prefix"]
    out = {
        "machine": machine(), "load_average_after": os.getloadavg()[0],
        "workload": {"num_prompts": args.num_prompts, "num_prefixes": args.num_prefixes, "prefix_len_words":
                     args.prefix_len, "suffix_len_words": args.suffix_len, "output_len": args.output_len,
                     "max_concurrency": args.max_concurrency or "unbounded",
                     "kv_cache_gib_per_replica": args.kv_cache_gib,
                     "pack_weights": args.pack_weights, "sliding_window_release": args.sliding_window_release, "kv_blocks_per_replica":
                     [r.info.num_blocks for r in rs.replicas]},
        "ray": {"start_s": round(rs.runtime.start_s, 2), "replicas_loaded_s": round(rs.runtime.deploy_s, 2),
                "ready_s": round(ready_s, 2), "memory_at_start": memory, "memory_after": memory_after},
        "policies": results,
        "prefix_over_round_robin_computed": pf["prompt_tokens_computed"] / max(1, rr["prompt_tokens_computed"]),
        "greedy_identical_across_policies": texts["prefix"] == texts["round_robin"] == texts["pow2"],
    }
    print(json.dumps(out, indent=1))
    save_json("replicas", out, args.out_dir)


if __name__ == "__main__":
    main()
