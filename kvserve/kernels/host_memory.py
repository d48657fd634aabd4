"""Host memory for the kernels: huge pages for the large buffers they stream, and a malloc that
keeps freed memory for the next step.

A decode step streams every packed weight panel, the head's int8 screen and the KV pages from
memory. On 4 KB pages that is a TLB miss every 4 KB; on 2 MB pages, one every 2 MB. Linux hands out 2 MB pages to ranges marked
`madvise(MADV_HUGEPAGE)` (the default THP mode on most distributions is `madvise`), but only to
aligned 2 MB stretches that are faulted in after the advice: so a buffer is advised right after
`torch.empty` and before anything writes to it. PyTorch itself does this for every allocation of
2 MB or more when THP_MEM_ALLOC_ENABLE=1 is set before its first allocation; kvserve advises only
its own long-lived buffers, whatever the environment.

Advice only: where the kernel or platform does not support it, nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from functools import lru_cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman-common.h


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@lru_cache(maxsize=1)
def _madvise():
    libc = _libc()
    if libc is None:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise_huge(t: torch.Tensor) -> int:
    """Mark the whole 2 MB pages inside contiguous CPU tensor t's memory for huge pages -> the bytes
    advised (0 when nothing was: too small, not on the CPU, not Linux, or the advice refused). The
    partial pages at either end stay 4 KB, so nothing outside t is touched."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu" or not t.is_contiguous():
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    if hi - lo < HUGE_PAGE:
        return 0
    return hi - lo if madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 else 0


def empty_huge(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty(shape) with its pages advised huge before anything touches them."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise_huge(t)
    return t


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
RETAINED_TOP_BYTES = (2 << 30) - 1  # free heap top kept before any goes back to the OS (an int for mallopt)


def keep_freed_memory_wanted() -> bool:
    """KVSERVE_KEEP_FREED_MEMORY: unset or "1" on, "0" off; anything else is refused by name."""
    value = os.environ.get("KVSERVE_KEEP_FREED_MEMORY", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"KVSERVE_KEEP_FREED_MEMORY must be 0 or 1, got {value!r}")
    return value == "1"


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS: no mmap
    for large blocks, and up to RETAINED_TOP_BYTES of free heap top kept. -> whether it applied.

    Why: each engine step allocates and frees the same large temporaries (a 2048-row step's matmul
    outputs are tens of MB). glibc serves blocks over its mmap threshold (at most 32 MB) with a
    fresh mmap and unmaps them on free, so every step faults those pages in again, 4 KB at a time,
    with the zeroing that comes with it; in the offline workload that was ~10-15% of the run
    (docs/ARCHITECTURE.md, the measured decisions). PyTorch's CPU guides recommend
    preloading jemalloc or tcmalloc for the same reason; this is the same effect without one.
    The cost: the process keeps its peak memory once reached. Process-wide and once per process;
    KVSERVE_KEEP_FREED_MEMORY=0 leaves malloc as it is."""
    libc = _libc()
    if not keep_freed_memory_wanted() or libc is None:
        return False
    if platform.libc_ver()[0] != "glibc" or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(_M_MMAP_MAX, 0) == 1
    return mallopt(_M_TRIM_THRESHOLD, RETAINED_TOP_BYTES) == 1 and applied


def release_freed_memory() -> bool:
    """Give the free heap back to the OS now (glibc's malloc_trim) -> whether it ran. For after a
    one-time load that frees most of what it allocated: parsing a 262k-entry tokenizer.json leaves
    ~200 MB of freed memory in malloc's arenas, which the process would otherwise keep."""
    libc = _libc()
    if libc is None or platform.libc_ver()[0] != "glibc" or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.malloc_trim(0)
    return True


def available_memory_bytes() -> int | None:
    """Memory this process can still take: the kernel's MemAvailable (free memory plus what the
    page cache can give back), lowered to the room left under a cgroup v2 limit (a container's);
    None where neither can be read (not Linux)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available
