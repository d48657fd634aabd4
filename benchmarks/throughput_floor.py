"""The offline throughput workload's floor on this CPU: its unavoidable work over the machine's peaks.

A compute bound from ~0.54 GFLOP per output token leaves out the prompt rows, which the 64-request
workload of `kvserve bench throughput` has ~2 of for every output token. This script counts the work the workload
cannot avoid, whatever the implementation (every prompt and generated row through the body, the last
layer's K/V only for prompt rows that need no logits, attention over each row's causal / sliding
window, one logit row per output token over the whole vocabulary), and divides it by peaks measured
here (the counting: kvserve/tools/analysis/floor.py): fp32 FMAs and int16 multiply-adds (what the greedy screen runs) from benchmarks/peak.c
with every thread busy, and read bandwidth (a sum over a 1 GiB tensor). Each part's time is the larger
of its arithmetic and its bytes; the floor is their sum, so it is optimistic: no glue, no
elementwise work, perfect overlap within a part. With `--run` it then runs the workload in the same
process (as `kvserve bench throughput` does) and prints the achieved fraction of each floor.

    cd benchmarks && ../.venv/bin/python throughput_floor.py [--run] [--json-dir DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from _common import machine, read_bandwidth_gbs, save_json

from kvserve import kernels
from kvserve.argtypes import positive_int
from kvserve.loading import load_model
from kvserve.tools.analysis.floor import count_work, floor_seconds
from kvserve.tools.bench.throughput import (
    INPUT_RANGE,
    OUTPUT_RANGE,
    make_workload,
    run_kvserve,
)


def _peak_library() -> ctypes.CDLL:
    lib = kernels.load_source(Path(__file__).with_name("peak.c"))  # the kernels' flags, cached
    for name in ("fp32_fma_peak", "int16_madd_peak"):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_int64]
    for name in ("peak_threads", "fp32_lanes", "int32_lanes"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def measure_peaks(repeats: int) -> dict:
    """Best and median rates over `repeats` runs of ~0.3 s each: fp32 FLOP/s, int16 MAC/s, read B/s."""
    lib = _peak_library()
    threads = lib.peak_threads()
    out = {}
    # A round: 12 vector FMAs of fp32_lanes() lanes x 2 flops; 12 multiply-adds of int32_lanes()
    # lanes x 2 int16 products. The vector width is the kernels' on this build (peak.c).
    rounds = (("fp32_fma_peak", 12 * lib.fp32_lanes() * 2, "fp32_gflops"),
              ("int16_madd_peak", 12 * lib.int32_lanes() * 2, "int16_gmacs"))
    for name, per_round, unit in rounds:
        fn, iters = getattr(lib, name), 30_000_000
        if fn(1000) == -1.0:
            raise SystemExit(f"{name}: peak.c was built without AVX2/FMA; no peak to measure on this CPU")
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(iters)
            rates.append(iters * per_round * threads / (time.perf_counter() - t) / 1e9)
        out[unit] = {"best": max(rates), "median": statistics.median(rates)}
    bws = [read_bandwidth_gbs(1.0, repeats=3) for _ in range(repeats)]
    out["read_gbs"] = {"best": max(bws), "median": statistics.median(bws)}
    out["threads"] = threads
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--run", action="store_true", help="then run the workload and report the achieved fraction")
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    loaded = load_model(None, "float32")
    cfg = loaded.config
    wl = make_workload(args.num_prompts, INPUT_RANGE, OUTPUT_RANGE, cfg.vocab_size, cfg.bos_token_id, 0)
    work = count_work(cfg, wl)
    peaks = measure_peaks(args.repeats)
    print(machine())
    print(f"{len(wl.prompts)} requests, {wl.input_tokens} prompt + {wl.output_tokens} output tokens")
    print(f"work: body {2 * work.body_macs / 1e9:.0f} GFLOP, prefill attention {2 * work.prefill_attn_macs / 1e9:.0f}, "
          f"decode attention {2 * work.decode_attn_macs / 1e9:.0f} GFLOP and {work.decode_kv_bytes / 1e9:.0f} GB of K/V, "
          f"head {work.head_macs / 1e12:.2f} T multiply-adds; {2 * (work.body_macs + work.head_macs) / work.output_tokens / 1e9:.2f}"
          f" GFLOP of matmuls per output token (the issue counted ~0.54)")
    for unit, r in peaks.items():
        if unit == "threads":
            continue
        print(f"peak {unit}: best {r['best']:.1f}, median {r['median']:.1f}")
    best = {u: r["best"] for u, r in peaks.items() if u != "threads"}
    floors = {head: floor_seconds(work, best["fp32_gflops"], best["int16_gmacs"], best["read_gbs"], head)
              for head in ("fp32", "int16")}
    for head, f in floors.items():
        parts = ", ".join(f"{k} {s:.1f} s" for k, s in f["parts_s"].items())
        print(f"floor, head {head}: {f['seconds']:.1f} s = {f['output_tok_s']:.0f} output tok/s ({parts})")
    result = {"work": asdict(work), "peaks": peaks, "floors": floors}
    if args.run:
        res = run_kvserve(loaded, wl, max_num_seqs=64, enable_prefix_caching=False)
        result["run"] = {"seconds": res.seconds, "output_tok_s": res.output_tok_s}
        print(f"kvserve: {res.seconds:.1f} s, {res.output_tok_s:.1f} output tok/s = "
              + ", ".join(f"{100 * res.output_tok_s / f['output_tok_s']:.0f}% of the {h}-head floor"
                          for h, f in floors.items()))
    save_json("throughput_floor", result, args.json_dir)


if __name__ == "__main__":
    main()
