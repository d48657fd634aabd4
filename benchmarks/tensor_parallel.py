"""Tensor parallelism on this CPU: TP=1 against TP=2 (two processes over gloo, one core each on
a 2-core machine) on the bundled Gemma 3 270M.

TP=1 runs twice: with torch's threads and with one thread (one rank's share of two cores).

1. Start-up: seconds until the engine is ready (TP=2: the worker's start, both ranks' loads,
   shards and packed panels).
2. Decode: one greedy request of `--decode-tokens` tokens, tok/s from its TPOT.
3. Throughput: `--num-requests` greedy requests of `--output-tokens` tokens each, all at once:
   output tok/s over the wall time.
4. The all-reduce: TP=2's time inside all-reduces per step (from rank 0: the wait for the other
   rank included) and, alone, the latency of one all-reduce of a decode step's activations
   ([rows, 640] fp32) between two processes pinned to one core each.

    python benchmarks/tensor_parallel.py [--decode-tokens 128] [--num-requests 16] [--json-dir results]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from _common import machine, save_json

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Robert Boulter is an English film and television",
           "In 1905 Einstein published", "The recipe calls for two cups of", "Once upon a time, in a small",
           "import numpy as np\n", "The three laws of thermodynamics are"]


def engine_numbers(tp: int, args, threads: int | None = None) -> dict:
    from kvserve import LLM, SamplingParams

    before_threads = torch.get_num_threads()
    t = time.perf_counter()
    llm = LLM(kv_cache_gib=0.5, tensor_parallel_size=tp, num_threads=threads)
    start = time.perf_counter() - t
    group = llm.engine.tp_group
    layers = llm.engine.model_config.num_layers
    try:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True))
        decode = 1.0 / out[0].metrics.tpot
        before = (group.allreduce_calls, group.allreduce_seconds) if group else (0, 0.0)
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.num_requests)]
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True))
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        res = {"tensor_parallel_size": tp, "threads_per_rank": torch.get_num_threads(), "start_s": round(start, 2),
               "decode_tok_s": round(decode, 2), "throughput_tok_s": round(tokens / wall, 2),
               "num_requests": args.num_requests, "output_tokens": args.output_tokens}
        if group is not None:
            calls = group.allreduce_calls - before[0]
            seconds = group.allreduce_seconds - before[1]
            steps = calls / (2 * layers + 1)  # o_proj and down_proj per layer, the embedding
            res.update(throughput_steps=round(steps), allreduce_calls_per_step=2 * layers + 1,
                       allreduce_ms_per_step=round(1000 * seconds / steps, 2),
                       allreduce_share_of_wall=round(seconds / wall, 3))
        return res
    finally:
        llm.close()
        torch.set_num_threads(before_threads)


def allreduce_latency(rank: int, store, rows: int, iters: int) -> list[float] | None:
    """One rank of the micro-benchmark: all-reduces of [rows, 640] fp32, one core per rank."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(store, rank, 2, opts)
    x = torch.randn(rows, 640)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        pg.allreduce([x]).wait()
        times.append(time.perf_counter() - t)
    return times if rank == 0 else None


def micro(rows: int, iters: int = 300) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, __file__, "--peer", str(store.port), str(rows), str(iters)])
    threads = torch.get_num_threads()
    times = allreduce_latency(0, store, rows, iters)
    os.sched_setaffinity(0, range(os.cpu_count()))
    torch.set_num_threads(threads)
    peer.wait()
    times = sorted(times[20:])
    return {"rows": rows, "p50_us": round(1e6 * statistics.median(times), 1),
            "p90_us": round(1e6 * times[int(0.9 * len(times))], 1)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, is_master=False)
        allreduce_latency(1, store, int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    # TP=1 twice: with torch's threads (the machine's cores) and with one thread, a rank's share
    # of a 2-core machine under TP=2 (the split's own cost, apart from the cores it gets).
    load = os.getloadavg()
    runs = [engine_numbers(1, args), engine_numbers(1, args, threads=1), engine_numbers(2, args)]
    data = {"runs": runs, "allreduce_alone": [micro(1), micro(16)],
            "load_average_before_after": [round(load[0], 2), round(os.getloadavg()[0], 2)],
            "measured_at": datetime.datetime.now().isoformat()}
    print(json.dumps(data, indent=1))
    print(machine(), file=sys.stderr)
    save_json("tensor_parallel", data, args.json_dir)


if __name__ == "__main__":
    main()
