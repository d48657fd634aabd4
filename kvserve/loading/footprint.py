"""What a model's weights will hold in memory, read from the file's tensor headers before anything
loads, so an engine that cannot fit is refused with the numbers instead of running the machine
out of memory halfway through a load.

The figures are the resident bytes once loaded, by how the weights are kept:
- "gguf" (a GGUF's own blocks): the file's tensor bytes (memory-mapped);
- "float": every element in `dtype`, twice on the CPU in fp32 when the packed decode copy is kept
  (kvserve/accel/panels.py); with dtype "auto" a bf16 / fp16 HF checkpoint's matrices at their
  16 bits (kvserve/weights/half.py) and the rest in fp32;
- "int8" / "int4": the quantized weights, plus the float bytes held while the load quantizes
  them block by block (kvserve/loading/streamed.py): the peak of the start;
- an HF folder already quantized or N:M-compressed: its files' bytes.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf_file import GGUFFile
from kvserve.loading.hf import read_hf_config
from kvserve.loading.loader import AUTO, compute_dtype, keeps_16bit, resolve_dtype
from kvserve.loading.quantized import read_quantization_config
from kvserve.loading.sparse_nm import read_sparsity_config
from kvserve.model.config import ModelConfig
from kvserve.model.state_cache import StateCache
from kvserve.weights.quantize import ENGINE_INT4_GROUPS

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def file_tensors(path: Path) -> tuple[int, int]:
    """(elements, stored bytes) of every tensor in a .gguf file or an HF folder's *.safetensors,
    from the headers alone."""
    tensors = tensor_list(path)
    return sum(math.prod(shape) for _, shape, _ in tensors), sum(b for _, _, b in tensors)


def state_pool_bytes(mc: ModelConfig, num_slots: int, dtype: torch.dtype) -> int:
    """The recurrent state pool of a hybrid model (kvserve/model/state_cache.py): `num_slots`
    sequences' conv states in `dtype` and SSM states in fp32, over every Mamba layer; 0 without."""
    if not mc.is_hybrid:
        return 0
    conv, ssm = mc.state_elements_per_layer()
    return num_slots * StateCache.bytes_per_slot(len(mc.mamba_layers), conv, ssm, dtype)


def state_pool_footprint(path: Path, num_slots: int, dtype: torch.dtype | str, device: str = "cpu") -> int:
    """`state_pool_bytes` of the HF folder at `path` (0 for anything else, or a config the load
    will refuse with its own message)."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return 0
    try:
        mc = read_hf_config(path)
    except ModelLoadError:
        return 0
    return state_pool_bytes(mc, num_slots, compute_dtype(dtype, device))


def tensor_list(path: Path) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape as [out, in] for a matrix, stored bytes) of every tensor of a .gguf file or an
    HF folder's *.safetensors, from the headers alone."""
    if path.suffix == ".gguf":
        try:
            return _gguf_tensors(path)
        except (ValueError, OSError, struct.error, KeyError, RecursionError) as e:  # a corrupt or hostile header
            raise ModelLoadError(path, f"unreadable GGUF header ({e})") from None
    out = []
    for f in sorted(path.glob("*.safetensors")):
        for name, info in _safetensors_header(f).items():
            if name == "__metadata__":
                continue
            shape = tuple(info["shape"])
            out.append((name, shape, math.prod(shape) * _SAFETENSORS_BYTES.get(info["dtype"], 4)))
    return out


def _gguf_tensors(path: Path) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, bytes) of a GGUF's tensors from its header, leaving out the metadata's
    arrays (a 262k vocabulary this needs none of)."""
    return [(t.name, tuple(reversed(t.shape)), t.n_bytes)  # ggml lists the inner dimension first
            for t in GGUFFile(path, values=False).tensors]


def _safetensors_header(f: Path) -> dict:
    try:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            return json.loads(fh.read(size))
    except (OSError, struct.error, ValueError) as e:
        raise ModelLoadError(f, f"unreadable safetensors header ({e})") from None


def weight_footprint(path: Path, weights: str, dtype: torch.dtype | str, pack: bool) -> int:
    """Bytes the weights of `path` will hold once loaded as `weights` (see the module doc);
    `dtype` as load_model takes it ("auto": a 16-bit HF checkpoint keeps its matrices in 16 bits)."""
    tensors = tensor_list(path)
    elements = sum(math.prod(shape) for _, shape, _ in tensors)
    if weights == "gguf" or (path.is_dir() and (read_quantization_config(path) or read_sparsity_config(path))):
        return sum(b for _, _, b in tensors)
    if weights in ("int8", "int4"):
        return quantized_bytes(tensors, weights) + streaming_transient(tensors, path.suffix == ".gguf")
    if isinstance(dtype, str) and dtype == AUTO:
        if path.is_dir() and keeps_16bit(dtype, "cpu", path, read_hf_config(path)):
            # 16-bit matrices as stored (kvserve/weights/half.py); norms and biases in fp32; no packed copy
            return sum(b if len(shape) == 2 and b == 2 * math.prod(shape) else 4 * math.prod(shape)
                       for _, shape, b in tensors)
        dtype = torch.float32
    dtype = resolve_dtype(dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    return elements * size * (2 if pack and dtype == torch.float32 else 1)


def _int4_group(tensors: list[tuple[str, tuple[int, ...], int]]) -> int:
    """The group the engine's int4 takes (kvserve/weights/quantize.py engine_rtn_settings)."""
    widths = {shape[1] for _, shape, _ in tensors if len(shape) == 2}
    return next((g for g in ENGINE_INT4_GROUPS if all(w % g == 0 for w in widths)), ENGINE_INT4_GROUPS[-1])


def quantized_bytes(tensors: list[tuple[str, tuple[int, ...], int]], weights: str) -> int:
    """What EngineConfig.weights int8 / int4 keeps: every matrix [N, K] (linears, the head, the
    embedding; a tied table once) as the int kernels store it, int8 codes + a bf16 scale per row,
    or 4-bit codes + bf16 (scale, zero) per group (rows the int4 kernel cannot take: int8 codes +
    fp32 scales and zeros); the rest (norms, biases) in fp32."""
    group = _int4_group(tensors)
    total = 0
    for _, shape, _ in tensors:
        n = math.prod(shape)
        if len(shape) != 2:
            total += 4 * n
        elif weights == "int8":
            total += n + 2 * shape[0]
        elif shape[0] % 16 == 0 and shape[1] % group == 0:
            total += n // 2 + 4 * (shape[1] // group) * shape[0]
        else:
            total += n + 8 * -(-shape[1] // group) * shape[0]
    return total


def streaming_transient(tensors: list[tuple[str, tuple[int, ...], int]], fp32_cache: bool) -> int:
    """The float bytes held beside the quantized weights while a load quantizes them
    (kvserve/loading/streamed.py): the embedding and head as read (fp32 from a GGUF's cache) until
    they are quantized last, plus the larger of one block's fp32 weights and the RTN temporaries
    of the largest of them (its fp32 copy, codes, their conversions and packing: about 6 fp32
    copies at the peak measured for int8 and int4)."""
    blocks: dict[str, int] = {}
    ends = largest_end = 0
    for name, shape, b in tensors:
        n = math.prod(shape)
        parts = name.removeprefix("model.").split(".")
        if parts[0] in ("layers", "blk") and len(parts) > 1:
            blocks[parts[1]] = blocks.get(parts[1], 0) + 4 * n
        elif len(shape) == 2:
            ends += 4 * n if fp32_cache else b
            largest_end = max(largest_end, n)
    return ends + max(max(blocks.values(), default=0), 6 * 4 * largest_end)
