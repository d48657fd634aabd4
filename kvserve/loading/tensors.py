"""`TensorFiles`: the tensors of one or more safetensors files under the model's names, read one
at a time, so a loader can place or quantize a tensor before it reads the next instead of
holding a whole state dict.

`get` returns safetensors' memory-mapped tensor (no copy; its pages stay mapped, so resident,
while the file is open); `read` copies one tensor out of the file with plain reads, so a
streaming load that drops each tensor after use holds no more than it keeps (with the mapping,
every page read stays in the process's RSS until the file is closed: a whole checkpoint's worth
by the last block)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from kvserve.loading.errors import ModelLoadError


# safetensors dtype names -> torch
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class TensorFiles:
    """name -> tensor over safetensors files. `rename(key)` gives a stored key's model name, or
    None to skip it (a tied lm_head, say). Unreadable files and duplicate names are named in a
    ModelLoadError."""

    def __init__(self, files: list[Path], rename: Callable[[str], str | None] = lambda key: key):
        self._handles: dict[Path, object] = {}
        self._headers: dict[Path, dict] = {}
        self._data_start: dict[Path, int] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        for f in files:
            handle = self._open(f)
            try:
                keys = list(handle.keys())
            except Exception as e:  # SafetensorError on a bad header
                raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
            for key in keys:
                name = rename(key)
                if name is None:
                    continue
                if name in self._where:
                    raise ModelLoadError(f, f"tensor {key!r} is also in {self._where[name][0].name}")
                self._where[name] = (f, key)

    def _open(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except Exception as e:  # SafetensorError on truncation / bad headers, OSError
                raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
        return self._handles[f]

    def names(self) -> list[str]:
        return list(self._where)

    def file(self, name: str) -> Path:
        """The file holding `name`."""
        return self._where[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        f, key = self._where[name]
        return tuple(self._handles[f].get_slice(key).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` (converted to `dtype` when given), read from its file now."""
        f, key = self._where[name]
        try:
            t = self._handles[f].get_tensor(key)
        except Exception as e:  # a file cut short after its header
            raise ModelLoadError(f, f"not a readable safetensors file (tensor {key!r}: {e})") from None
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` copied out of its file with plain reads (not mapped: see the module
        doc), converted to `dtype` when given."""
        f, key = self._where[name]
        info = self._header(f)[key]  # (safe_open has validated it)
        kind, shape, (start, end) = info.get("dtype"), tuple(info.get("shape", ())), info.get("data_offsets", (0, -1))
        if kind not in _DTYPES or end - start != math.prod(shape) * _DTYPES[kind].itemsize:
            raise ModelLoadError(f, f"tensor {key!r}: dtype {kind!r}, shape {shape} and offsets {start}..{end} "
                                    f"do not agree")
        buf = torch.empty(end - start, dtype=torch.uint8)
        with f.open("rb") as fh:
            fh.seek(self._data_start[f] + start)
            got = fh.readinto(buf.numpy()) if end > start else 0
        if got != end - start:
            raise ModelLoadError(f, f"not a readable safetensors file (tensor {key!r} is cut short)")
        t = buf.view(_DTYPES[kind]).reshape(shape)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def _header(self, f: Path) -> dict:
        """The file's JSON header (read once), and where its data starts."""
        if f not in self._headers:
            with f.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                self._headers[f] = json.loads(fh.read(size))
            self._data_start[f] = 8 + size
        return self._headers[f]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, read (as stored)."""
        return {name: self.get(name) for name in self._where}
