"""The on-disk cache of converted artefacts (`~/.cache/kvserve`, or $KVSERVE_CACHE).

Converting a GGUF file (parsing 262k vocabulary entries, dequantizing every tensor, building a
tokenizer) takes tens of seconds; the results are stored once, keyed by the source file's
path, size and mtime, so the next start only memory-maps a safetensors file.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

# Bump when the cached format or the conversion changes, so stale entries are not reused.
CACHE_VERSION = 1


def cache_root() -> Path:
    root = os.environ.get("KVSERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvserve"


def entry_dir(kind: str, source: Path) -> Path:
    """A folder private to one version of one source file."""
    st = source.stat()
    key = f"{CACHE_VERSION}|{source.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / kind / f"{source.stem}-{digest}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write then rename, so a crash never leaves a half-written cache file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
