"""The greedy screen (kernels/greedy_head.c) of an earlier revision against the current one.

A random 262,144 x 640 head (Gemma 3 270M's shape) packed as the engine packs it; rows of random
hidden states; both builds must return the same tokens; alternating rounds, median time per call.

    cd benchmarks && ../.venv/bin/python screen_ab.py [--before-rev 3f16b67] [--json-dir DIR]
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
SRC = ROOT / "kvserve" / "kernels" / "greedy_head.c"
V, K = 262_144, 640


def build(source: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source)
    return kernels.load_source(src, "greedy_head")  # the engine's compiler flags and signatures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before-rev", default="3f16b67", help="git revision of the kernel to compare against")
    p.add_argument("--rows", default="8,34,64")
    p.add_argument("--rounds", type=positive_int, default=10)
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    before = kernel_source_at(args.before_rev, "greedy_head.c")
    tmp = Path(tempfile.mkdtemp())
    libs = {args.before_rev: build(before, tmp / "before.so"), "current": build(SRC.read_text(), tmp / "current.so")}
    torch.manual_seed(0)
    packed = kernels.pack_panels(torch.randn(V, K) * 0.03)
    screen = kernels.pack_head_screen(packed, V)
    threads = torch.get_num_threads()

    def call(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[float, torch.Tensor]:
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        t = time.perf_counter()
        lib.screen_argmax(x.data_ptr(), packed.data_ptr(), packed.shape[2], screen.q.data_ptr(), screen.scale.data_ptr(),
                          screen.c1.data_ptr(), screen.c2.data_ptr(), tokens.data_ptr(), x.shape[0], V, K,
                          kernels.SCREEN_CAP, threads)
        return time.perf_counter() - t, tokens

    results = {}
    for m in (positive_int(r) for r in args.rows.split(",")):
        x = torch.randn(m, K) * 3
        a, b = (call(lib, x)[1] for lib in libs.values())
        if not torch.equal(a, b):
            raise SystemExit(f"{m} rows: the two builds pick different tokens")
        times: dict[str, list[float]] = {name: [] for name in libs}
        for r in range(args.rounds):
            for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                times[name].append(call(libs[name], x)[0])
        results[m] = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"{m:3d} rows: " + ", ".join(f"{n} {1e3 * s:.1f} ms ({m * V * K / s / 1e9:.0f} G multiply-adds/s)"
                                           for n, s in results[m].items())
              + f", current/before time {results[m]['current'] / results[m][args.before_rev]:.2f} (same tokens)",
              flush=True)
    print(machine())
    save_json("screen_ab", {"seconds": results, "before_rev": args.before_rev}, args.json_dir)


if __name__ == "__main__":
    main()
