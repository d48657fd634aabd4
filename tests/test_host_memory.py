"""kvserve.kernels.host_memory: huge-page advice and the malloc that keeps freed memory."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.kernels.host_memory import (
    HUGE_PAGE,
    advise_huge,
    empty_huge,
    keep_freed_memory,
    keep_freed_memory_wanted,
)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="madvise / mallopt are Linux (glibc) calls")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> str:
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


@linux_only
def test_advise_huge_covers_only_whole_pages_inside_the_tensor():
    t = torch.empty(5 * HUGE_PAGE // 4)  # 5 MB: 4 or 5 whole 2 MB pages, by where it starts
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    expected = end // HUGE_PAGE * HUGE_PAGE - -(-start // HUGE_PAGE) * HUGE_PAGE
    assert advise_huge(t) == expected and expected >= 2 * HUGE_PAGE
    assert advise_huge(torch.empty(1000)) == 0  # smaller than one huge page
    assert advise_huge(torch.empty(4096, 1024).t()) == 0  # not contiguous


_FRESH_PROCESS = """
import torch
from kvserve.kernels.host_memory import empty_huge
def huge_kb():
    return next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages:'))
before = huge_kb()
plain = torch.empty(64 << 20 >> 2)  # 64 MB each
plain.fill_(1.0)
middle = huge_kb()
advised = empty_huge(64 << 20 >> 2)
advised.fill_(1.0)
print(middle - before, huge_kb() - middle)
"""


@linux_only
@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="transparent huge pages not in madvise mode")
def test_empty_huge_is_backed_by_huge_pages_once_touched():
    # A fresh process: in this one, memory freed earlier may be reused already touched, 4 KB a page.
    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, check=True)
    plain_kb, advised_kb = (int(x) for x in out.stdout.split())
    assert plain_kb == 0  # without the advice, no huge pages in madvise mode
    assert advised_kb >= 60 << 10  # all but the partial 2 MB pages at the ends


@linux_only
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_serves_large_blocks_from_the_heap():
    assert keep_freed_memory()
    # Without it glibc gives a block this large its own mmap, unmapped again on free.
    t = torch.empty(64 << 20 >> 2)
    assert _mapping_of(t.data_ptr()) == "[heap]"


def test_empty_huge_on_a_tensor_we_cannot_advise_still_allocates():
    t = empty_huge(3, 4, dtype=torch.int8)
    assert t.shape == (3, 4) and t.dtype == torch.int8


@pytest.mark.parametrize("value, wanted", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_keep_freed_memory_switch(monkeypatch, value, wanted):
    if value is None:
        monkeypatch.delenv("KVSERVE_KEEP_FREED_MEMORY", raising=False)
    else:
        monkeypatch.setenv("KVSERVE_KEEP_FREED_MEMORY", value)
    assert keep_freed_memory_wanted() is wanted


@pytest.mark.parametrize("value", ["false", "yes", "2", ""])
def test_keep_freed_memory_switch_rejects_other_values_by_name(monkeypatch, value):
    monkeypatch.setenv("KVSERVE_KEEP_FREED_MEMORY", value)
    with pytest.raises(ValueError, match="KVSERVE_KEEP_FREED_MEMORY"):
        keep_freed_memory_wanted()


_FREED_PROCESS = """
import ctypes
from kvserve.kernels.host_memory import release_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_kb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
blocks = [libc.malloc(4000) for _ in range(50000)]  # 200 MB of small blocks, as a JSON parse leaves
for b in blocks:
    ctypes.memset(b, 1, 4000)
keep = libc.malloc(64)  # a live block above them: the heap top cannot simply shrink
for b in blocks:
    libc.free(b)
before = rss_kb()
print(release_freed_memory(), before - rss_kb())
"""


@linux_only
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_freed_memory_gives_freed_heap_back():
    out = subprocess.run([sys.executable, "-c", _FREED_PROCESS], capture_output=True, text=True, check=True)
    ran, released_kb = out.stdout.split()
    assert ran == "True" and int(released_kb) > 150 << 10
