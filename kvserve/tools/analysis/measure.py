"""`kvserve roofline --measure`: this machine as a Hardware, from two quick torch probes on CPU.

Bandwidth is the engine's own probe (`kvserve.tools.bench.latency.read_bandwidth_gbs`: a sum over a
large fp32 tensor, what a GEMV streaming weights can reach); FLOP/s is the median of square
fp32 matmuls. Both use torch's current thread count, so they describe the engine as it runs.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from kvserve.tools.analysis.roofline import Hardware
from kvserve.tools.bench.latency import read_bandwidth_gbs


def matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """Median FLOP/s of an `n x n` fp32 matmul (2n^3 FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def physical_memory() -> float:
    """Bytes of RAM."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_hardware(bandwidth_gib: float = 0.5) -> Hardware:
    """This machine: measured fp32 matmul FLOP/s, measured read bandwidth, physical RAM."""
    bandwidth = read_bandwidth_gbs(bandwidth_gib) * 1e9
    return Hardware(f"this machine (CPU, {torch.get_num_threads()} threads, measured)",
                    flops=matmul_flops(), bandwidth=bandwidth, memory=physical_memory())
