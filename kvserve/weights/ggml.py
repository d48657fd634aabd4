"""GGUF's quantized blocks as runtime weights: `GGMLLinear` keeps a weight's bytes as the file
stores them (Q4_0 ... Q6_K, F16, BF16; memory-mapped by the loader), never an fp32 copy.

A weight [N, K] is N rows of K / QK blocks (QK = 32, or 256 for the K-quants), each a few fp16
scales and packed codes. The C kernels of kvserve/kernels/ggml_blocks.c dequantize a block at a
time exactly as ggml does (the `gguf` package's dequantizer is the tests' oracle, value for
value), so a layer computes with the same weights as the fp32 model the file dequantizes to:

- activations "int8" (the default; llama.cpp's arithmetic), for Q4_0, Q5_0, Q8_0, Q4_K, Q5_K and
  Q6_K: each activation row is quantized to int8 per 32 values and the blocks' integer codes meet
  it in integer dot products (kernels/ggml_int8.c): up to `INT8_ROW_KERNEL_MAX_ROWS` rows one
  row at a time, more (decode batches, prefill) as a GEMM over 16 weight rows at once. Against the
  float model's products the error is that of the activations' rounding: about 2e-3 of
  sum |x| |w| (tests/test_ggml_blocks.py bounds it);
- activations "float" (and the other types): the float model's products. Up to
  `GEMV_MAX_ROWS` rows (decode steps): one pass over the blocks, each dequantized once and
  multiplied with every row in fp32 (16 lanes per row, then summed); more rows (prefill):
  `DEQUANT_ROWS` weight rows at a time dequantized to fp32 and multiplied by PyTorch's matmul, so
  the transient fp32 copy stays small.

Either way a row's result does not depend on the rows beside it. Without a C compiler every
layer dequantizes with the `gguf` package (numpy; slow) and computes in float.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from kvserve import kernels

T = gguf.GGMLQuantizationType
# The types these layers hold (ggml's type numbers); F32 only as a tied head's table.
GGML_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
INT8_TYPES = (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)  # the int8-activation kernel's
ACTIVATIONS = ("int8", "float")
INT8_ROW_KERNEL_MAX_ROWS = 12  # int8 activations: up to this many rows per-row kernel, more the GEMM (ggml_int8.c)
GEMV_MAX_ROWS = 64  # rows of activations the block kernel takes in one call
DEQUANT_ROWS = 4096  # weight rows dequantized at once on the prefill path


def row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes of one weight row of `in_features` values in this type (ValueError if not whole blocks)."""
    values, size = gguf.GGML_QUANT_SIZES[T(ggml_type)]
    if in_features % values:
        raise ValueError(f"{T(ggml_type).name}: {in_features} values are not whole blocks of {values}")
    return in_features // values * size


def dequantize_rows(raw: torch.Tensor, ggml_type: int, in_features: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64 [n]) of a weight held as blocks, raw uint8 [out_features, row bytes], in
    fp32 [n, in_features]: kernels/ggml_blocks.c (ggml's values), else the `gguf` package."""
    out = kernels.ggml_dequant(raw, int(ggml_type), in_features, rows)
    if out is None:
        picked = raw.index_select(0, rows.to(torch.int64)).numpy()
        out = torch.from_numpy(np.asarray(gguf_dequantize(picked, T(ggml_type)), dtype=np.float32))
    return out.reshape(rows.numel(), in_features)


class GGMLLinear(nn.Module):
    """y = x @ W^T (+ bias) with W held as GGUF blocks: `raw` uint8 [out_features, row bytes].

    `out_order` (int64 [out_features], optional): output i is the file's row out_order[i], for a
    file that stores the rows in another order than the model reads them (llama.cpp's Llama q / k
    rows, each head's rotary halves interleaved): the outputs are gathered after each product
    instead of the weight being copied in the model's order (a copy would sit in memory beside
    the mapped file pages it was read from)."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, activations: str = "int8", out_order: torch.Tensor | None = None):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        ggml_type = T(ggml_type)
        if ggml_type not in GGML_TYPES:
            raise ValueError(f"GGUF tensor type {ggml_type.name} is not supported (supported: "
                             f"{', '.join(t.name for t in GGML_TYPES)})")
        if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_features, row_bytes(ggml_type, in_features)):
            raise ValueError(f"{ggml_type.name} [{out_features}, {in_features}] needs uint8 bytes of shape "
                             f"({out_features}, {row_bytes(ggml_type, in_features)}), got {raw.dtype} "
                             f"{tuple(raw.shape)}")
        self.ggml_type, self.activations = ggml_type, activations
        self.in_features, self.out_features = in_features, out_features
        if out_order is not None and (out_order.dtype != torch.int64 or tuple(out_order.shape) != (out_features,)):
            raise ValueError(f"out_order must be int64 of shape ({out_features},), got {out_order.dtype} "
                             f"{tuple(out_order.shape)}")
        self.register_buffer("raw", raw)
        self.register_buffer("bias", bias)
        self.register_buffer("out_order", out_order)

    @property
    def int8_path(self) -> bool:
        """Whether products quantize the activations to int8 (kernels/ggml_int8.c)."""
        return self.activations == "int8" and self.ggml_type in INT8_TYPES

    @property
    def weight_nbytes(self) -> int:
        return self.raw.numel() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.ggml_type.name}, "
                f"activations={self.activations}")

    def dequantized_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Weight rows `rows` (int64 [n], the model's order) in fp32 [n, in_features]."""
        if self.out_order is not None:
            rows = self.out_order.index_select(0, rows.to(torch.int64))
        return dequantize_rows(self.raw, self.ggml_type, self.in_features, rows)

    def dequantized_weight(self) -> torch.Tensor:
        """W in fp32 [out_features, in_features] (a full copy: for tests and conversions)."""
        return self.dequantized_rows(torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = None
        if self.int8_path:
            y = kernels.ggml_q8_matmul(x2.float(), self.raw, int(self.ggml_type), self.out_features)
        if y is None and x2.shape[0] <= GEMV_MAX_ROWS:
            y = kernels.ggml_gemv(x2.float(), self.raw, int(self.ggml_type), self.out_features)
        if y is None:
            y = self._dequantized_matmul(x2.float())
        elif self.out_order is not None:  # (the dequantized path reads rows in the model's order)
            y = y.index_select(1, self.out_order)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _dequantized_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] fp32 @ W^T, DEQUANT_ROWS weight rows at a time."""
        out = x2.new_empty(x2.shape[0], self.out_features)
        for n0 in range(0, self.out_features, DEQUANT_ROWS):
            n1 = min(n0 + DEQUANT_ROWS, self.out_features)
            out[:, n0:n1] = F.linear(x2, self.dequantized_rows(torch.arange(n0, n1)))
        return out
