"""Helpers shared by the benchmark scripts: timing, bandwidth, machine description, output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Callable

import torch

from kvserve.paths import WIKITEXT2_TEST, wikitext2_file
from kvserve.tools.bench.latency import read_bandwidth_gbs  # noqa: F401  (re-exported for the scripts)

ROOT = Path(__file__).resolve().parents[1]


def wikitext2_test() -> Path:
    """WikiText-2's raw test split under $KVSERVE_DATA (a clear error when it is not set)."""
    return wikitext2_file(WIKITEXT2_TEST)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def save_json(name: str, data: dict, out_dir: str | None) -> None:
    if not out_dir:
        return
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"date": date.today().isoformat(), "machine": machine(), **data}
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
