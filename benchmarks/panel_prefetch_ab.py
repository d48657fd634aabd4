"""The body's panel matmuls of an earlier kernels/panel_gemm.c against the current one, as a step sees them.

Gemma 3 270M's four body matmuls (QKV 640 -> 1536, O 1024 -> 640, gate/up 640 -> 4096, down 2048 ->
640) for 18 layers, each layer with its own packed weights (~400 MB in all, so each step streams
them from memory as the engine does), at several row counts; the two builds run in alternating
rounds and must give bitwise the same outputs. GFLOP/s, median of the rounds.

    cd benchmarks && ../.venv/bin/python panel_prefetch_ab.py [--before-rev 92de9cc] [--json-dir DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import kernel_source_at, machine, save_json

from kvserve import kernels
from kvserve.cli import positive_int

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "kvserve" / "kernels" / "panel_gemm.c"
SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]  # (N, K): QKV, O, gate/up, down
LAYERS = 18


def build(source: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source)
    return kernels.load_source(src, "panel_gemm")  # the engine's compiler flags and signatures


def body(lib: ctypes.CDLL, weights, m: int, threads: int) -> tuple[float, list[torch.Tensor]]:
    """One pass of the 18 layers' matmuls at m rows: (seconds, the last layer's outputs)."""
    gen = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}
    ys = [torch.empty(m, n) for n, _ in SHAPES]
    t = time.perf_counter()
    for layer in weights:
        for (n, k), wp, y in zip(SHAPES, layer, ys):
            lib.panel_gemm(xs[k].data_ptr(), wp.data_ptr(), y.data_ptr(), m, n, k, threads)
    return time.perf_counter() - t, ys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before-rev", default="92de9cc", help="git revision of the kernel to compare against")
    p.add_argument("--rows", default="1,4,16,34,64,128,256,512,2048")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    rows = [positive_int(r) for r in args.rows.split(",")]
    before = kernel_source_at(args.before_rev, "panel_gemm.c")
    tmp = Path(tempfile.mkdtemp())
    libs = {args.before_rev: build(before, tmp / "before.so"), "current": build(SRC.read_text(), tmp / "current.so")}
    torch.manual_seed(0)
    weights = [[kernels.pack_panels(torch.randn(n, k) * 0.05) for n, k in SHAPES] for _ in range(LAYERS)]
    threads = torch.get_num_threads()
    flops_per_row = 2 * LAYERS * sum(n * k for n, k in SHAPES)
    results = {}
    for m in rows:
        outs = {name: body(lib, weights, m, threads)[1] for name, lib in libs.items()}
        a, b = outs.values()
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            raise SystemExit(f"{m} rows: the two builds' outputs differ")
        times: dict[str, list[float]] = {name: [] for name in libs}
        for r in range(args.rounds):
            for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                times[name].append(body(libs[name], weights, m, threads)[0])
        results[m] = {name: flops_per_row * m / statistics.median(ts) / 1e9 for name, ts in times.items()}
        ratio = results[m]["current"] / results[m][args.before_rev]
        print(f"{m:5d} rows: " + ", ".join(f"{n} {g:.0f} GFLOP/s" for n, g in results[m].items())
              + f", {ratio:.2f}x (bitwise equal)", flush=True)
    print(machine())
    save_json("panel_prefetch_ab", {"gflops": results, "before_rev": args.before_rev}, args.json_dir)


if __name__ == "__main__":
    main()
