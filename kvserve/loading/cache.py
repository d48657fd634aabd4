"""The on-disk cache of converted artefacts (`~/.cache/kvserve`, or $KVSERVE_CACHE).

Converting a GGUF file (parsing 262k vocabulary entries, dequantizing every tensor, building a
tokenizer) takes tens of seconds; the results are stored once, keyed by the source file's
path, size and mtime, so the next start only memory-maps a safetensors file.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Callable

from kvserve.paths import cache_root

# Bump when the cached format or the conversion changes, so stale entries are not reused.
CACHE_VERSION = 1


def entry_dir(kind: str, source: Path) -> Path:
    """A folder private to one version of one source file."""
    st = source.stat()
    key = f"{CACHE_VERSION}|{source.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / kind / f"{source.stem}-{digest}"


def temp_sibling(path: Path, tag: str = "tmp") -> Path:
    """A name beside `path` that no other process or thread will pick (two processes converting
    one file at once each write their own, and the last rename wins with a complete file)."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_path(path: Path) -> None:
    """Flush a written file (or a folder's entries) to the disk before it is renamed into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) into a private temporary sibling, flush it, rename it over `path`: readers see
    the old file or the whole new one, never a part, and a crash leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write then rename, so a crash never leaves a half-written cache file behind."""
    replace_atomically(path, lambda tmp: tmp.write_bytes(data))
