"""N:M compressed storage: `SparseNMLinear`.

A linear layer whose weight W [N, K] has at most n non-zeros in every group of m consecutive
inputs of a row (2:4, 4:8) is stored as

    values   [N, K * n / m]  the n kept weights of each group, in input order (a group with
                             fewer than n non-zeros stores some zeros, so the count is fixed);
    indices  uint8 [N, ceil(K * n / m * b / 8)]  the position (0..m-1) of each kept weight in
                             its group, b = ceil(log2 m) bits each (2 for 2:4, 3 for 4:8), packed
                             little end first along the row (4 per byte at 2 bits; at 3 bits
                             a code may straddle two bytes);

so a 2:4 fp32 layer takes 1/2 of the values plus 1/16 of the dense bytes in indices, and
`dense_weight()` rebuilds W exactly (bit for bit: values are copied, never recomputed).

Forward: on CUDA with a 2:4 layer in float16 / bfloat16, PyTorch's semi-structured sparse
tensors (`torch.sparse.to_sparse_semi_structured`, cuSPARSELt / CUTLASS) when this build has
them, converted once and cached. Everywhere else (CPU, 4:8, fp32) a DENSE FALLBACK: the weight
is rebuilt from values + indices on every call and multiplied densely. That is exact but not
faster than the dense model (it saves memory, not time); a warning is logged once per process.

Folders of such layers are written and read by kvserve/loading/sparse_nm.py.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

FORMAT = "kvserve-sparse-nm"
FORMAT_VERSION = 1
_warned_fallback = False


def index_bits(m: int) -> int:
    """Bits per in-group position: ceil(log2 m) (2 for m = 4, 3 for m = 8)."""
    return max(1, math.ceil(math.log2(m)))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, C] (integers in [0, 2^bits)) -> uint8 [R, ceil(C * bits / 8)], little end first."""
    r, c = codes.shape
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((codes.long().unsqueeze(-1) >> shifts) & 1).reshape(r, c * bits)  # bit j of code i at i*bits + j
    nbytes = -(-c * bits // 8)
    stream = F.pad(stream, (0, nbytes * 8 - c * bits))
    weights = (1 << torch.arange(8, dtype=torch.int64))
    return (stream.reshape(r, nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [R, B] -> int64 [R, count]."""
    r = packed.shape[0]
    stream = (packed.long().unsqueeze(-1) >> torch.arange(8, dtype=torch.int64, device=packed.device)) & 1
    stream = stream.reshape(r, -1)[:, :count * bits].reshape(r, count, bits)
    return (stream << torch.arange(bits, dtype=torch.int64, device=packed.device)).sum(-1)


def compress_nm(weight: torch.Tensor, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] with at most n non-zeros per group of m -> (values [N, K*n/m] in the
    weight's dtype, packed indices uint8). ValueError when the weight is not N:M sparse."""
    n, m = parse_pattern((n, m))
    rows, k = weight.shape
    if k % m:
        raise ValueError(f"N:M {n}:{m}: the input size {k} is not a multiple of {m}")
    if not is_nm(weight, n, m):
        raise ValueError(f"weight {tuple(weight.shape)} is not {n}:{m} sparse (a group of {m} inputs has more "
                         f"than {n} non-zeros)")
    groups = weight.detach().reshape(rows, k // m, m)
    # Non-zeros first, then the earliest zeros: exactly n positions per group, kept in input order.
    pos = torch.arange(m, device=weight.device)
    key = (groups != 0).to(torch.int64) * (2 * m) + (m - pos)
    idx = torch.topk(key, n, dim=2).indices.sort(dim=2).values
    values = torch.gather(groups, 2, idx).reshape(rows, k // m * n)
    return values.contiguous(), pack_bits(idx.reshape(rows, -1).cpu(), index_bits(m)).to(weight.device)


def decompress_nm(values: torch.Tensor, indices: torch.Tensor, n: int, m: int, in_features: int) -> torch.Tensor:
    """(values [N, K*n/m], packed indices) -> the dense weight [N, K] (exactly the stored values)."""
    rows = values.shape[0]
    idx = unpack_bits(indices, index_bits(m), in_features // m * n).reshape(rows, in_features // m, n)
    dense = torch.zeros(rows, in_features // m, m, dtype=values.dtype, device=values.device)
    dense.scatter_(2, idx.to(values.device), values.reshape(rows, in_features // m, n))
    return dense.reshape(rows, in_features)


def semi_structured_available() -> bool:
    return hasattr(torch, "sparse") and hasattr(torch.sparse, "to_sparse_semi_structured") and torch.cuda.is_available()


class SparseNMLinear(nn.Module):
    """y = x W^T + b with W [out, in] stored N:M-compressed (module docstring).

    Buffers: weight_values [out, in*n/m], weight_indices uint8 (packed positions), bias [out] or
    None. CPU (and any case the CUDA semi-structured path cannot take) runs a dense fallback:
    the weight is rebuilt each call; logged once.
    """

    def __init__(self, in_features: int, out_features: int, n: int, m: int, values: torch.Tensor,
                 indices: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.n, self.m = parse_pattern((n, m))
        if in_features % self.m:
            raise ValueError(f"SparseNMLinear: in_features {in_features} is not a multiple of {self.m}")
        want = (out_features, in_features // self.m * self.n)
        if tuple(values.shape) != want:
            raise ValueError(f"SparseNMLinear: weight_values has shape {tuple(values.shape)}, expected {want}")
        nbytes = -(-want[1] * index_bits(self.m) // 8)
        if tuple(indices.shape) != (out_features, nbytes) or indices.dtype != torch.uint8:
            raise ValueError(f"SparseNMLinear: weight_indices must be uint8 {(out_features, nbytes)}, got "
                             f"{indices.dtype} {tuple(indices.shape)}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_values", values)
        self.register_buffer("weight_indices", indices)
        self.register_buffer("bias", bias)
        self._sparse = None  # cached semi-structured weight (CUDA)
        self._sparse_key = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, pattern: tuple[int, int] | str) -> "SparseNMLinear":
        n, m = parse_pattern(pattern)
        values, indices = compress_nm(linear.weight.detach(), n, m)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(linear.in_features, linear.out_features, n, m, values, indices, bias)

    def dense_weight(self) -> torch.Tensor:
        """The dense weight [out, in] (exactly the stored values at their positions)."""
        return decompress_nm(self.weight_values, self.weight_indices, self.n, self.m, self.in_features)

    def _semi_structured(self, dtype: torch.dtype):
        """The cached CUDA semi-structured weight, or None when this case cannot use it."""
        if not (self.weight_values.is_cuda and (self.n, self.m) == (2, 4) and dtype in (torch.float16, torch.bfloat16)
                and semi_structured_available()):
            return None
        key = (dtype, self.weight_values.data_ptr())
        if self._sparse_key != key:
            try:
                self._sparse = torch.sparse.to_sparse_semi_structured(self.dense_weight().to(dtype))
            except (RuntimeError, ValueError) as e:  # shape / arch the kernels reject
                log.warning("SparseNMLinear: semi-structured sparse unavailable (%s); dense fallback", e)
                self._sparse = None
            self._sparse_key = key
        return self._sparse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sparse = self._semi_structured(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if sparse is not None:
            shape = x.shape
            return F.linear(x.reshape(-1, shape[-1]), sparse, bias).reshape(*shape[:-1], self.out_features)
        global _warned_fallback
        if not _warned_fallback:
            _warned_fallback = True
            log.warning("SparseNMLinear %d:%d: dense fallback (weights rebuilt per call; no sparse speed-up on %s)",
                        self.n, self.m, x.device.type)
        return F.linear(x, self.dense_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pattern={self.n}:{self.m}"


def nm_linear_names(model: nn.Module, pattern: tuple[int, int]) -> list[str]:
    """Names (ours, e.g. "layers.0.mlp.down_proj") of the block linears whose weight is N:M sparse."""
    n, m = pattern
    return [f"layers.{i}.{name}" for i, block in enumerate(model.layers) for name, mod in block.named_modules()
            if isinstance(mod, nn.Linear) and is_nm(mod.weight, n, m)]


def compress_model(model: nn.Module, pattern: tuple[int, int] | str) -> list[str]:
    """Replace, in place, every N:M-sparse nn.Linear of model.layers by a SparseNMLinear -> names."""
    nm = parse_pattern(pattern)
    names = nm_linear_names(model, nm)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, leaf, SparseNMLinear.from_linear(getattr(holder, leaf), nm))
    return names


def parse_pattern(text: str | tuple[int, int]) -> tuple[int, int]:
    """"2:4" -> (2, 4): n weights kept of every m consecutive inputs (0 < n < m)."""
    if isinstance(text, tuple):
        n, m = text
    else:
        try:
            a, b = str(text).split(":")
            n, m = int(a), int(b)
        except ValueError:
            raise ValueError(f"--pattern must be N:M (e.g. 2:4 or 4:8), got {text!r}") from None
    if not (0 < n < m):
        raise ValueError(f"--pattern N:M needs 0 < N < M, got {n}:{m}")
    return n, m


def is_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """True when every group of m consecutive inputs of every row has at most n non-zeros."""
    out, k = weight.shape
    if k % m:
        return False
    return bool(((weight.reshape(out, k // m, m) != 0).sum(2) <= n).all())
