"""Batch-1 decode attention from the paged pool: an earlier revision of kernels/paged_attention.c
against the current one (and the current one built without its row prefetch), as a decode step
sees the pool: between two reads of a layer's pages the step streams the weights, so the pages
come from memory, not cache.

Each "layer" call is preceded by a read of 16 MB of other memory (about what a layer's weights
are); 18 layers, Gemma 3 270M's shapes (MQA: 4 query heads on 1 KV head, head_dim 256), fp32.

    python benchmarks/attention_prefetch_ab.py [--before-rev 123b8f2] [--json-dir results]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from _common import machine, save_json

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "kvserve" / "kernels" / "paged_attention.c"


def build(source: str, out: Path, defines: list[str]) -> ctypes.CDLL:
    from kvserve.kernels import _FLAGS, _SIGNATURES

    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", *_FLAGS, *defines, f"-I{SRC.parent}", str(src), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    args, res = _SIGNATURES["paged_attention"]["paged_decode"]
    lib.paged_decode.argtypes, lib.paged_decode.restype = args, res
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-rev", default="123b8f2", help="git revision of the kernel to compare against")
    ap.add_argument("--contexts", default="150,250,350,500")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    before = subprocess.run(["git", "show", f"{args.before_rev}:kvserve/kernels/paged_attention.c"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    tmp = Path(tempfile.mkdtemp())
    libs = {f"{args.before_rev}": (build(before, tmp / "before.so", []), 128),
            "current, no prefetch": (build(SRC.read_text(), tmp / "nopf.so", ["-DPREFETCH_ROWS=0"]), 64),
            "current": (build(SRC.read_text(), tmp / "current.so", []), 64)}
    # (the split rule lives in kvserve/kernels/__init__.py: ranges of >= 128 positions before, >= 64 now)

    torch.manual_seed(0)
    bs, slots, layers, H, D = 16, 2048, 18, 4, 256
    pools = [(torch.randn(slots, 1, D), torch.randn(slots, 1, D)) for _ in range(layers)]
    other = [torch.randint(-100, 100, (16 << 20,), dtype=torch.int8) for _ in range(layers)]

    def per_call_us(lib: ctypes.CDLL, min_split: int, ctx: int) -> float:
        nb = -(-ctx // bs)
        tables = torch.randperm(slots // bs)[:nb].to(torch.int32)[None]
        q, out = torch.randn(1, H, D), torch.empty(1, H, D)
        starts, lens = torch.zeros(1, dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
        splits = max(1, min(4 * args.threads, -(-ctx // min_split) if min_split == 64 else ctx // min_split))
        total = 0.0
        for layer in range(layers):
            other[layer].max()  # the weights streamed between two attention calls
            k, v = pools[layer]
            t = time.perf_counter()
            lib.paged_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), starts.data_ptr(),
                             lens.data_ptr(), out.data_ptr(), 1, H, 1, D, bs, nb, splits, D ** -0.5, args.threads, 0)
            total += time.perf_counter() - t
        return total / layers * 1e6

    results = {}
    for ctx in (int(c) for c in args.contexts.split(",")):
        runs: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(args.rounds):
            for name, (lib, min_split) in libs.items():
                runs[name].append(per_call_us(lib, min_split, ctx))
        results[ctx] = {name: statistics.median(v) for name, v in runs.items()}
        print(f"context {ctx:4d}: " + ", ".join(f"{n} {us:.1f} us" for n, us in results[ctx].items()))
    print(machine())
    save_json("attention_prefetch_ab", {"results": results, "before_rev": args.before_rev}, args.json_dir)


if __name__ == "__main__":
    main()
