"""`QuantLinear`: a linear layer that stores low-bit weights and multiplies with them.

Three execution paths ("kernels"), picked per layer by `choose_kernel`:

* "int4": codes of 2..4 bits, group-wise (per-channel and per-tensor grids too, as groups that
  repeat one scale), through PyTorch's CPU kernels `_convert_weight_to_int4pack_for_cpu` +
  `_weight_int4pack_mm_for_cpu`. Weights: 4 bits each (packed two per byte in the kernel's
  tiled layout, see packing.py) + a [K/g, N, 2] table of scales and float zero points. The
  kernel computes W = (u - 8) * s + zf with unsigned codes u in [0, 15]: a symmetric code q is
  stored as u = q + 8 with zf = 0; an asymmetric one as u = q with zf = s * (8 - z). Needs
  out_features % 16 == 0 and a kernel group size of 32, 64, 128 or 256 dividing in_features.
  A 2- or 3-bit grid runs here exactly (its codes are a subset of 0..15) but occupies 4 bits.
* "int8": codes of up to 8 bits with one scale per output row (per-channel or per-tensor),
  through `_weight_int8pack_mm` (int8 [N, K] weights, scales [N]). Asymmetric grids store
  q - 2^(b-1) (signed) and subtract the rank-1 term (x . 1) * s * (z - 2^(b-1)) in fp32.
* "dequant": the exact fallback for everything else (5..8-bit group-wise grids, shapes the
  kernels reject, act-order `g_idx`, non-CPU devices): int8 codes (1 byte per weight, shifted to
  signed like "int8") + float32 scales/zeros; every forward dequantizes the weight in chunks of
  output rows into the activation dtype and calls F.linear per chunk. Exact (it multiplies by
  precisely s * (q - z)) but not fast: it reads the codes and writes a float copy each call.

Activations: with torch 2.13 the CPU int4/int8 kernels are fast only with bfloat16 activations
(on an AMD EPYC with AVX-512 BF16, fp32 and fp16 inputs took a scalar loop, 10-25x slower than
an fp32 GEMV; on a Zen 3 without AVX-512 the bf16 ones ran 1.7x slower than an fp32 matmul at
512 rows). So by default (`act_dtype=torch.bfloat16`) an fp32 model's activations are rounded to
bf16 for PyTorch's kernels and their output converted back; the scales/zeros table is stored in
that dtype. `act_dtype=float32` keeps the kernels in fp32 (slow, but equal to F.linear with
`dequantized_weight()` to fp32 rounding). The "dequant" path always computes in the input's
dtype. `use_gemv_kernel` (the engine's `--weights` path) moves int8 / int4 layers onto kvserve's
own C kernels, which compute in fp32 throughout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.weights.packing import (
    check_cpu_int4_shape,
    cpu_int4_block_n,
    cpu_int4_pack,
    cpu_int4_rows,
    from_cpu_int4_layout,
)
from kvserve.weights.rtn import dequantize
from kvserve.weights.spec import QuantizedWeight, QuantSpec

KERNELS = ("int4", "int8", "dequant")
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts
_DEQUANT_CHUNK = 1 << 22  # weights dequantized at once by the fallback (16 MiB of fp32)
# Rows up to which the C kernels multiply directly; more dequantize to fp32 (use_gemv_kernel).
GEMV_MAX_ROWS = 64  # up to here they beat PyTorch's int kernels per row (ARCHITECTURE.md)


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def int4_group_size(spec: QuantSpec, in_features: int) -> int | None:
    """The int4 kernel's group size for this grid, or None when the kernel cannot express it.
    A group-wise grid keeps its own size; a per-row grid repeats its scale over the largest
    accepted group size that divides in_features."""
    if spec.granularity == "group":
        g = spec.group_size
        return g if g in INT4_GROUP_SIZES and in_features % g == 0 else None
    return next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)


def choose_kernel(spec: QuantSpec, out_features: int, in_features: int, g_idx: torch.Tensor | None = None,
                  device: torch.device | str = "cpu") -> str:
    """The fastest path that computes this grid exactly (see the module docstring)."""
    if torch.device(device).type != "cpu" or g_idx is not None:
        return "dequant"
    if (spec.bits <= 4 and _has_op("_weight_int4pack_mm_for_cpu") and out_features % 16 == 0
            and in_features % 2 == 0 and int4_group_size(spec, in_features) is not None):
        return "int4"
    # _weight_int8pack_mm (torch 2.13) returns garbage or crashes for batches of > 1 row when
    # in_features is not a multiple of 16 (found by tests/test_weights_option.py).
    if spec.num_groups(in_features) == 1 and _has_op("_weight_int8pack_mm") and in_features % 16 == 0:
        return "int8"
    return "dequant"


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as low-bit codes (see the module docstring for the paths).

    Buffers (the state dict a saved folder will hold), N = out_features, K = in_features:
      int4:    qweight uint8 [N, K/2] (CPU tiled layout), scales_and_zeros [K/g, N, 2] act_dtype
      int8:    qweight int8 [N, K], scales [N] act_dtype, zero_offset [N] float32 (asymmetric only)
      dequant: qweight int8 [N, K], scales [N, G] float32, zeros [N, G] float32 (asymmetric
               only), g_idx [K] int64 (act-order only)
      bias [N] in the model's dtype when the layer has one.
    Build one with `QuantLinear.from_quantized(qw, bias)`; the constructor allocates empty
    buffers of the right shapes (for loading a saved state dict).
    """

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, kernel: str,
                 act_dtype: torch.dtype = torch.bfloat16, bias: bool = False,
                 bias_dtype: torch.dtype = torch.float32, has_g_idx: bool = False):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.in_features, self.out_features = in_features, out_features
        self.spec, self.kernel, self.act_dtype = spec, kernel, act_dtype
        n, k = out_features, in_features
        g = spec.num_groups(k)
        self.offset = 0 if spec.sym else 1 << (spec.bits - 1)  # stored int8 codes are q - offset
        self.group_size = 0
        if kernel == "int4":
            if spec.bits > 4:
                raise ValueError(f"kernel int4 holds at most 4-bit codes, got bits={spec.bits}")
            check_cpu_int4_shape(n, k)
            gs = int4_group_size(spec, k)
            if gs is None:
                raise ValueError(f"kernel int4: no group size in {INT4_GROUP_SIZES} fits {spec.label()} "
                                 f"with in_features {k}")
            self.group_size = gs
            self.register_buffer("qweight", torch.empty(n, k // 2, dtype=torch.uint8))
            self.register_buffer("scales_and_zeros", torch.empty(k // gs, n, 2, dtype=act_dtype))
        elif kernel == "int8":
            if g != 1:
                raise ValueError(f"kernel int8 takes one scale per output row, got {spec.label()}")
            self.register_buffer("qweight", torch.empty(n, k, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(n, dtype=act_dtype))
            self.register_buffer("zero_offset", None if spec.sym else torch.empty(n, dtype=torch.float32))
        else:
            self.register_buffer("qweight", torch.empty(n, k, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(n, g, dtype=torch.float32))
            self.register_buffer("zeros", None if spec.sym else torch.empty(n, g, dtype=torch.float32))
            self.register_buffer("g_idx", torch.empty(k, dtype=torch.int64) if has_g_idx else None)
        self.register_buffer("bias", torch.empty(n, dtype=bias_dtype) if bias else None)
        # fp32 scales for the batch-1 int8 C kernel (kvserve/kernels/lowbit_gemv.c), made by
        # `use_gemv_kernel`; None: PyTorch's kernels for every batch.
        self._gemv: torch.Tensor | None = None

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                       act_dtype: torch.dtype = torch.bfloat16, kernel: str = "auto") -> "QuantLinear":
        """Pack a canonical QuantizedWeight [N, K] for `kernel` ("auto": `choose_kernel`)."""
        n, k = qw.shape
        spec = qw.spec
        device = qw.codes.device
        if kernel == "auto":
            kernel = choose_kernel(spec, n, k, qw.g_idx, device)
        if qw.g_idx is not None and kernel != "dequant":
            raise ValueError(f"kernel {kernel} needs contiguous groups; a g_idx (act-order) layer runs on 'dequant'")
        layer = cls(k, n, spec, kernel, act_dtype, bias is not None,
                    bias.dtype if bias is not None else torch.float32, qw.g_idx is not None)
        codes, scale = qw.codes, qw.scale.float()
        zero = None if qw.zero is None else qw.zero.to(torch.int32)
        with torch.no_grad():
            if kernel == "int4":
                u = codes + 8 if spec.sym else codes  # unsigned 0..15
                reps = k // layer.group_size // scale.shape[1]  # per-row grids repeat their scale
                s = scale.repeat_interleave(reps, dim=1)  # [N, K/g]
                zf = torch.zeros_like(s) if zero is None else s * (8 - zero.repeat_interleave(reps, dim=1)).float()
                layer.qweight = cpu_int4_pack(u)
                layer.scales_and_zeros = torch.stack([s, zf], dim=-1).transpose(0, 1).contiguous().to(act_dtype)
            elif kernel == "int8":
                layer.qweight = (codes - layer.offset).to(torch.int8).contiguous()
                layer.scales = scale[:, 0].to(act_dtype).contiguous()
                if zero is not None:  # s * (z - offset), with the scale the kernel really uses
                    layer.zero_offset = layer.scales.float() * (zero[:, 0] - layer.offset).float()
            else:
                layer.qweight = (codes - layer.offset).to(torch.int8).contiguous()
                layer.scales = scale.contiguous()
                if zero is not None:
                    layer.zeros = (zero - layer.offset).float().contiguous()
                if qw.g_idx is not None:
                    layer.g_idx = qw.g_idx.to(torch.int64).contiguous()
            if bias is not None:
                layer.bias = bias.detach().clone()
        return layer

    # --- views of the stored weight ------------------------------------------------------------

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the forward multiplies by, [N, K] float32 (scales as stored)."""
        if self.kernel == "int4":
            u = from_cpu_int4_layout(self.qweight).float()
            sz = self.scales_and_zeros.float()
            s = sz[..., 0].t().repeat_interleave(self.group_size, dim=1)
            zf = sz[..., 1].t().repeat_interleave(self.group_size, dim=1)
            return (u - 8) * s + zf
        if self.kernel == "int8":
            w = self.qweight.float() * self.scales.float()[:, None]
            return w if self.zero_offset is None else w - self.zero_offset[:, None]
        return dequantize(self.qweight, self.scales, self.zeros, g_idx=self.g_idx)

    def dequantized_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """dequantized_weight()[rows] [T, K] float32, bit for bit, reading only those rows (the
        embedding lookup of kvserve.weights.embedding.QuantEmbedding)."""
        rows = rows.reshape(-1).to(torch.int64)
        if self.kernel == "int4":
            u = cpu_int4_rows(self.qweight, rows).float()
            sz = self.scales_and_zeros[:, rows].float()  # [K/g, T, 2]
            s = sz[..., 0].t().repeat_interleave(self.group_size, dim=1)
            zf = sz[..., 1].t().repeat_interleave(self.group_size, dim=1)
            return (u - 8) * s + zf
        if self.kernel == "int8":
            w = self.qweight[rows].float() * self.scales[rows].float()[:, None]
            return w if self.zero_offset is None else w - self.zero_offset[rows][:, None]
        zeros = None if self.zeros is None else self.zeros[rows]
        return dequantize(self.qweight[rows], self.scales[rows], zeros, g_idx=self.g_idx)

    def quantized_weight(self) -> QuantizedWeight:
        """Back to canonical codes/scales/zeros (scales as stored, e.g. bf16-rounded)."""
        spec = self.spec
        if self.kernel == "int4":
            u = from_cpu_int4_layout(self.qweight)
            sz = self.scales_and_zeros.float()
            s, zf = sz[..., 0].t().contiguous(), sz[..., 1].t()
            g = spec.num_groups(self.in_features)
            step = s.shape[1] // g
            scale = s[:, ::step].contiguous()
            if spec.sym:
                return QuantizedWeight(u - 8, scale, None, spec)
            zero = torch.round(8 - zf[:, ::step] / scale).to(torch.int32)
            return QuantizedWeight(u, scale, zero, spec)
        codes = self.qweight.to(torch.int32) + self.offset
        if self.kernel == "int8":
            scale = self.scales.float()[:, None]
            zero = None if self.zero_offset is None else \
                (torch.round(self.zero_offset[:, None] / scale) + self.offset).to(torch.int32)
            return QuantizedWeight(codes, scale, zero, spec)
        zero = None if self.zeros is None else (self.zeros + self.offset).to(torch.int32)
        return QuantizedWeight(codes, self.scales.clone(), zero, spec, self.g_idx)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of every stored tensor (codes, scales, zeros, bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.label()}, "
                f"kernel={self.kernel}, act_dtype={str(self.act_dtype).removeprefix('torch.')}, "
                f"bias={self.bias is not None}")

    # --- forward -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        y = self._kernel_forward(x2) if self._gemv is not None else None
        if y is not None:
            y = y.to(x.dtype)
        elif self.kernel == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(self.act_dtype).contiguous(), self.qweight,
                                                           self.group_size, self.scales_and_zeros).to(x.dtype)
        elif self.kernel == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(self.act_dtype).contiguous(), self.qweight, self.scales)
            if self.zero_offset is not None:
                y = (y.float() - x2.float().sum(-1, keepdim=True) * self.zero_offset)
            y = y.to(x.dtype)
        else:
            y = self._dequant_matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def use_gemv_kernel(self) -> bool:
        """Run this int8 / int4 layer on kvserve's C kernels (kvserve/kernels/lowbit_gemv.c),
        reading the same buffers: up to GEMV_MAX_ROWS rows (decode steps, short prompts) stream
        the weights once with every row computed as it would be alone (1.7-2x PyTorch's kernels
        at one row); more rows (prefill) multiply by the weight dequantized to fp32 a chunk at a
        time with PyTorch's fp32 matmul, which beat the int kernels' bf16 arithmetic on a CPU
        without native bf16. Both compute in fp32, activations included, so the layer is F.linear
        by `dequantized_weight()` up to fp32 rounding (PyTorch's kernels round activations and
        outputs to bf16: a rounding that tiny differences upstream flip, and logits that tie).
        False: an asymmetric int8 layer (its offset is subtracted outside PyTorch's kernel) or
        another kernel."""
        if self.kernel == "int8" and self.zero_offset is None:
            self._gemv = self.scales.float().contiguous()
            return True
        if self.kernel == "int4" and self.scales_and_zeros.dtype in (torch.bfloat16, torch.float32):
            self._gemv = self.scales_and_zeros.contiguous()
            return True
        return False

    def _kernel_forward(self, x2: torch.Tensor) -> torch.Tensor | None:
        """x2 [M, K] -> [M, N] fp32 on the C kernels (see use_gemv_kernel); None where they do not apply."""
        if x2.device.type != "cpu":
            return None
        x2 = x2.float()
        if x2.shape[0] > GEMV_MAX_ROWS:
            return self._dequantized_matmul(x2)
        if self.kernel == "int4":
            return kernels.int4_gemv(x2, self.qweight, self._gemv, self.group_size, cpu_int4_block_n())
        return kernels.int8_gemv(x2, self.qweight, self._gemv)

    def _dequantized_matmul(self, x2: torch.Tensor) -> torch.Tensor | None:
        """x2 [M, K] fp32 @ dequantized_weight()^T, dequantizing _DEQUANT_CHUNK weights at a time."""
        n, k = self.out_features, self.in_features
        step = max(1, _DEQUANT_CHUNK // k)
        if self.kernel == "int4":
            bn = cpu_int4_block_n()
            step = max(bn, step - step % bn)
        outs = []
        for a in range(0, n, step):
            b = min(n, a + step)
            if self.kernel == "int4":
                w = kernels.int4_dequant(self.qweight, self._gemv, self.group_size, cpu_int4_block_n(), a, b)
                if w is None:
                    return None
            else:
                w = self.qweight[a:b].float() * self._gemv[a:b, None]
            outs.append(F.linear(x2, w))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _dequant_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N]: dequantize a chunk of output rows at a time, F.linear each."""
        rows = max(1, _DEQUANT_CHUNK // self.in_features)
        outs = []
        for a in range(0, self.out_features, rows):
            zeros = None if self.zeros is None else self.zeros[a:a + rows]
            w = dequantize(self.qweight[a:a + rows], self.scales[a:a + rows], zeros, g_idx=self.g_idx)
            outs.append(F.linear(x2, w.to(x2.dtype)))
        return torch.cat(outs, dim=-1)


def use_gemv_kernels(model: nn.Module) -> int:
    """`QuantLinear.use_gemv_kernel` on every layer of `model`; returns how many took it (int8)."""
    return sum(m.use_gemv_kernel() for m in model.modules() if isinstance(m, QuantLinear))
