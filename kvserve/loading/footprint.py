"""What a model's weights will hold in memory, read from the file's tensor headers before anything
loads, so an engine that cannot fit is refused with the numbers instead of running the machine
out of memory halfway through a load.

The figures are the resident bytes once loaded, by how the weights are kept:
- "gguf" (a GGUF's own blocks): the file's tensor bytes (memory-mapped);
- "float": every element in `dtype`, twice on the CPU in fp32 when the packed decode copy is kept
  (kvserve/accel/panels.py);
- "int8" / "int4": the fp32 load they are quantized from (the peak of the start);
- an HF folder already quantized or N:M-compressed: its files' bytes.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import gguf
import torch

from kvserve.loading.errors import ModelLoadError
from kvserve.loading.quantized import read_quantization_config
from kvserve.loading.sparse_nm import read_sparsity_config

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def file_tensors(path: Path) -> tuple[int, int]:
    """(elements, stored bytes) of every tensor in a .gguf file or an HF folder's *.safetensors,
    from the headers alone."""
    if path.suffix == ".gguf":
        try:
            return _gguf_tensors(path)
        except (ValueError, OSError, struct.error, KeyError, RecursionError) as e:  # a corrupt or hostile header
            raise ModelLoadError(path, f"unreadable GGUF header ({e})") from None
    elements = stored = 0
    for f in sorted(path.glob("*.safetensors")):
        for name, info in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = math.prod(info["shape"])
            elements += n
            stored += n * _SAFETENSORS_BYTES.get(info["dtype"], 4)
    return elements, stored


# GGUF metadata value types of fixed size (gguf.GGUFValueType numbers -> bytes); 8: string, 9: array
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_tensors(path: Path) -> tuple[int, int]:
    """(elements, bytes) of a GGUF's tensors from its header, skipping the metadata without
    building it (gguf.GGUFReader makes an object of each of a 262k vocabulary's strings: hundreds
    of MB at its peak, for numbers this needs none of)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} (1 is not read)")
        pos = 24

        def skip_value(kind: int, pos: int) -> int:
            if kind == 8:
                return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
            if kind == 9:
                elem, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if elem in _GGUF_SIZES:
                    return pos + count * _GGUF_SIZES[elem]
                for _ in range(count):
                    pos = skip_value(elem, pos)
                return pos
            return pos + _GGUF_SIZES[kind]

        for _ in range(n_kv):
            pos += 8 + struct.unpack_from("<Q", m, pos)[0]  # the key
            (kind,) = struct.unpack_from("<I", m, pos)
            pos = skip_value(kind, pos + 4)
        elements = stored = 0
        for _ in range(n_tensors):
            pos += 8 + struct.unpack_from("<Q", m, pos)[0]  # the name
            (n_dims,) = struct.unpack_from("<I", m, pos)
            if n_dims > 4:  # ggml's GGML_MAX_DIMS
                raise ValueError(f"a tensor of {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            (kind,) = struct.unpack_from("<I", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 4 + 8
            n = math.prod(dims)
            values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            elements += n
            stored += n // values * size
        return elements, stored


def _safetensors_header(f: Path) -> dict:
    try:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            return json.loads(fh.read(size))
    except (OSError, struct.error, ValueError) as e:
        raise ModelLoadError(f, f"unreadable safetensors header ({e})") from None


def weight_footprint(path: Path, weights: str, dtype: torch.dtype, pack: bool) -> int:
    """Bytes the weights of `path` will hold once loaded as `weights` (see the module doc)."""
    elements, stored = file_tensors(path)
    if weights == "gguf" or (path.is_dir() and (read_quantization_config(path) or read_sparsity_config(path))):
        return stored
    if weights in ("int8", "int4"):
        return elements * 4
    size = torch.empty(0, dtype=dtype).element_size()
    return elements * size * (2 if pack and dtype == torch.float32 else 1)
