"""Cold and warm start of `kvserve generate`: seconds from process start to the first token.

Cold: an empty conversion cache (KVSERVE_CACHE points at a fresh folder), so the GGUF is
parsed, dequantized and its tokenizer converted. Warm: the cache is in place.

    python benchmarks/startup.py [--warm-runs 3] [--weights gguf]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, median

CMD = ["generate", "The capital of France is", "--max-tokens", "1"]


def first_token_s(env: dict, weights: str) -> tuple[float, float]:
    """(process start -> first token, process start -> exit) in seconds."""
    exe = shutil.which("kvserve") or str(Path(sys.executable).with_name("kvserve"))
    t0 = time.perf_counter()
    r = subprocess.run([exe, *CMD, "--weights", weights], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    # The CLI reports first token relative to its own start; add the interpreter start-up
    # (the gap between our t0 and its t_start) by measuring an empty run of the same entry point.
    m = re.search(r"first token ([\d.]+) s after start", r.stderr)
    return float(m.group(1)), wall


def interpreter_overhead(env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import kvserve.cli"], env=env, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--weights", default="float", help="kvserve generate --weights (gguf: what `make serve` runs)")
    args = ap.parse_args()
    env = dict(os.environ)
    overhead = interpreter_overhead(env)
    rows = []
    if not args.skip_cold:
        with tempfile.TemporaryDirectory() as tmp:
            cold_env = {**env, "KVSERVE_CACHE": tmp}
            ft, wall = first_token_s(cold_env, args.weights)
            rows.append(("cold (empty cache)", ft + overhead, wall))
    first_token_s(env, args.weights)  # make sure the real cache exists
    warm = [first_token_s(env, args.weights) for _ in range(args.warm_runs)]
    rows.append((f"warm (median of {args.warm_runs})", median([w[0] for w in warm]) + overhead,
                 median([w[1] for w in warm])))
    print(f"machine: {machine()}; --weights {args.weights}; interpreter + import kvserve.cli: {overhead:.2f} s")
    print("| start | process start -> first token (s) | whole command (s) |")
    print("|---|---|---|")
    for name, ft, wall in rows:
        print(f"| {name} | {ft:.1f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
