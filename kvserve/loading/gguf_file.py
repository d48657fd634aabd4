"""A GGUF file's header read in one pass: metadata values and tensor descriptions.

gguf-py's `GGUFReader` makes a numpy view of every part of every metadata value, so Gemma 3's
262k-token vocabulary takes it ~20 s and hundreds of MB to open; this reads the same values
with `struct` over a memory map (docs/ARCHITECTURE.md, measured decisions) and gives the fields
and tensors this package reads. gguf-py still names the tensor types and dequantizes.

Layout (little- or big-endian, versions 2 and 3): magic "GGUF", version u32, tensor count u64,
metadata count u64; the metadata as (key string, type u32, value); each tensor as (name, n_dims
u32, dims u64 (fastest axis first), type u32, offset u64); the tensor data from the next
multiple of `general.alignment` (default 32), each offset relative to that start.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

# Metadata value types (gguf.GGUFValueType) -> struct code of a scalar; 8: string, 9: array.
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types whose tensor data reads as typed numbers; the others (quantized blocks, bf16) as bytes.
_PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class Unreadable:
    """A metadata value whose bytes do not decode (a string that is not UTF-8): the error is
    raised by whoever reads that key, so a file is not refused for a key nobody uses."""

    reason: str


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest axis first
    data_offset: int  # from the start of the file
    n_bytes: int
    _buf: Any = field(repr=False, compare=False)
    _order: str = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """The stored data, read-only over the file: typed and shaped [..., shape[0]] for plain
        types; bytes shaped [..., bytes of a row] for block-quantized ones (what
        gguf.quants.dequantize takes)."""
        dims = tuple(reversed(self.shape))
        plain = _PLAIN_TYPES.get(int(self.tensor_type))
        if plain is None:
            return np.frombuffer(self._buf, np.uint8, self.n_bytes, self.data_offset).reshape(
                gguf.quant_shape_to_byte_shape(dims, self.tensor_type))
        dtype = np.dtype(plain).newbyteorder(self._order)
        return np.frombuffer(self._buf, dtype, math.prod(dims), self.data_offset).reshape(dims)


class GGUFFile:
    """`fields`: every metadata value by key (int, float, bool, str, or a list of them; an
    `Unreadable` where the bytes do not decode); `types`: each key's value type and, for an
    array, its elements'; `tensors`: in file order. `values=False` leaves out the arrays' values
    (a vocabulary) for a caller that needs only the tensors.

    Malformed files raise ValueError or struct.error saying where."""

    def __init__(self, path: str | Path, values: bool = True):
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._size = len(self._buf)
        if self._buf[:4] != GGUF_MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        self._order = "<"
        (version,) = struct.unpack_from("<I", self._buf, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            (version,) = struct.unpack_from(">I", self._buf, 4)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (readable: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        self.version = version
        n_tensors, n_kv = self._unpack("QQ", 8)
        pos = 24
        self.fields: dict[str, Any] = {}
        self.types: dict[str, tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (kind,) = self._unpack("I", pos)
            start = pos + 4
            if key in self.types:
                raise ValueError(f"metadata key {key!r} appears twice")
            if values or kind != _ARRAY:
                self.fields[key], pos = self._value(kind, start)
            else:
                pos = self._skip(kind, start)
            elem = self._unpack("I", start)[0] if kind == _ARRAY else None
            self.types[key] = (gguf.GGUFValueType(kind), None if elem is None else gguf.GGUFValueType(elem))
        infos, pos = self._tensor_infos(n_tensors, pos)
        self.data_start = _align(pos, self._alignment())
        self.tensors = self._place(infos)

    # -- primitives -------------------------------------------------------------------------------

    def _unpack(self, codes: str, pos: int) -> tuple:
        return struct.unpack_from(self._order + codes, self._buf, pos)

    def _need(self, end: int, what: str) -> None:
        if end > self._size:
            raise ValueError(f"{what} runs past the end of the file (truncated)")

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = self._unpack("Q", pos)
        end = pos + 8 + n
        self._need(end, "a string")
        return str(self._buf[pos + 8:end], "utf-8"), end

    def _skip(self, kind: int, pos: int) -> int:
        """The position after a value of `kind` at pos (its bytes bounds-checked)."""
        if kind in _SCALAR_CODES:
            end = pos + struct.calcsize(_SCALAR_CODES[kind])
        elif kind == _STRING:
            end = pos + 8 + self._unpack("Q", pos)[0]
        elif kind == _ARRAY:
            elem, count = self._unpack("IQ", pos)
            pos += 12
            if elem in _SCALAR_CODES:
                end = pos + count * struct.calcsize(_SCALAR_CODES[elem])
            else:
                if elem not in (_STRING, _ARRAY):
                    raise ValueError(f"unknown metadata value type {elem}")
                for _ in range(count):  # each element at least 8 bytes: a huge count meets the end
                    pos = self._skip(elem, pos)
                end = pos
        else:
            raise ValueError(f"unknown metadata value type {kind}")
        self._need(end, "a metadata value")
        return end

    def _value(self, kind: int, pos: int) -> tuple[Any, int]:
        """(the value of `kind` at pos, or an `Unreadable`; the position after it)."""
        try:
            return self._decode(kind, pos)
        except UnicodeDecodeError as e:
            return Unreadable(f"a string that is not UTF-8 ({e})"), self._skip(kind, pos)

    def _decode(self, kind: int, pos: int) -> tuple[Any, int]:
        """(the value of `kind` at pos, the position after it), its bytes bounds-checked."""
        code = _SCALAR_CODES.get(kind)
        if code is not None:
            return self._unpack(code, pos)[0], pos + struct.calcsize(code)
        if kind == _STRING:
            return self._string(pos)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        elem, count = self._unpack("IQ", pos)
        pos += 12
        code = _SCALAR_CODES.get(elem)
        if code is not None:  # numbers in one read
            end = pos + count * struct.calcsize(code)
            self._need(end, "a metadata value")
            return np.frombuffer(self._buf, np.dtype(code).newbyteorder(self._order), count, pos).tolist(), end
        out = []
        if elem == _STRING:  # (a vocabulary: the loop that matters)
            buf, q = self._buf, struct.Struct(self._order + "Q")
            for _ in range(count):  # (each string at least 8 bytes: a huge count meets the end)
                (n,) = q.unpack_from(buf, pos)
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
                pos += 8 + n
            self._need(pos, "a metadata value")  # (the last string may have run past it)
            return out, pos
        for _ in range(count):
            value, pos = self._decode(elem, pos)
            out.append(value)
        return out, pos

    # -- tensors ----------------------------------------------------------------------------------

    def _tensor_infos(self, count: int, pos: int) -> tuple[list[tuple], int]:
        """(name, type, dims, offset from the data start, bytes) of each tensor, and the position
        after their descriptions."""
        infos, names = [], set()
        for _ in range(count):
            name, pos = self._string(pos)
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            (n_dims,) = self._unpack("I", pos)
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = self._unpack(f"{n_dims}Q", pos + 4)
            kind, offset = self._unpack("IQ", pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            try:
                ggml_type = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"tensor {name!r} has an unknown ggml type {kind}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            if n_dims and dims[0] % block:
                raise ValueError(f"tensor {name!r}: its rows of {dims[0]} are not whole {ggml_type.name} blocks")
            infos.append((name, ggml_type, dims, offset, math.prod(dims) // block * type_size))
        return infos, pos

    def _alignment(self) -> int:
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment must be a power of two, got {align!r}")
        return align

    def _place(self, infos: list[tuple]) -> list[GGUFTensor]:
        """The tensors at their offsets in the file, each one's bytes within it."""
        tensors = []
        for name, ggml_type, dims, offset, n_bytes in infos:
            start = self.data_start + offset
            self._need(start + n_bytes, f"tensor {name!r}")
            tensors.append(GGUFTensor(name, ggml_type, tuple(dims), start, n_bytes, self._buf, self._order))
        return tensors


def _align(pos: int, alignment: int) -> int:
    return -(-pos // alignment) * alignment
