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
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError) as e:
            raise ModelLoadError(path, f"unreadable GGUF header ({e})") from None
        return sum(int(t.n_elements) for t in reader.tensors), sum(int(t.n_bytes) for t in reader.tensors)
    elements = stored = 0
    for f in sorted(path.glob("*.safetensors")):
        for name, info in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = math.prod(info["shape"])
            elements += n
            stored += n * _SAFETENSORS_BYTES.get(info["dtype"], 4)
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
