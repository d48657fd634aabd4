"""Round-to-nearest (RTN) quantization and the grid primitives the other methods reuse.

`grid_qparams` (scale/zero from a range), `compute_qparams` (min-max range of a matrix at the
spec's granularity), `quantize` / `dequantize` / `fake_quantize` (codes <-> values on a given
grid) are written for any leading shape so GPTQ can call them on one column or one group at a
time and AWQ on clipped ranges.

Shapes: x [..., K] with scale/zero [..., G] means K / G consecutive columns share a scale
(G = 1: per row; G = K: one scale per element, e.g. GPTQ quantizing a single column [out, 1]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.weights.spec import (
    LayerStats,
    QuantizedWeight,
    QuantSpec,
    dequantize,
    expand_params,
    group_view,
)


def grid_qparams(xmin: torch.Tensor, xmax: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point from a value range.

    xmin, xmax [...] float -> scale [...] float32, zero [...] int32 (None when spec.sym).
    Symmetric: s = max(|xmin|, |xmax|) / qmax. Asymmetric: the range is widened to include 0,
    s = (xmax - xmin) / (2^b - 1), z = round(-xmin / s) (clamped to the code range). An empty
    range (all zeros) gets s = 1, so every value maps to the zero code and back to 0 exactly.
    The scale is rounded to spec.scale_dtype (kept in float32) before the zero point is chosen.
    """
    xmin, xmax = xmin.float(), xmax.float()
    if spec.sym:
        amax = torch.maximum(xmin.abs(), xmax.abs())
        scale = _round_scale(amax / spec.qmax, spec.scale_dtype)
        return torch.where(amax > 0, scale, torch.ones_like(scale)), None
    xmin = torch.clamp(xmin, max=0.0)
    xmax = torch.clamp(xmax, min=0.0)
    scale = _round_scale((xmax - xmin) / (spec.qmax - spec.qmin), spec.scale_dtype)
    scale = torch.where(xmax > xmin, scale, torch.ones_like(scale))
    zero = torch.clamp(torch.round(-xmin / scale), spec.qmin, spec.qmax).to(torch.int32)
    return scale, zero


def _round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round positive scales to `dtype` (no-op for float32), never to 0 or inf."""
    if dtype == torch.float32:
        return scale
    info = torch.finfo(dtype)
    return scale.clamp(info.tiny, info.max).to(dtype).float()


def compute_qparams(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max grid of a matrix at the spec's granularity.

    w [out, in] -> scale [out, G] float32, zero [out, G] int32 or None (G = spec.num_groups(in)).
    Per-tensor repeats the one scale down the rows so every granularity has the same shape.
    """
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    w = w.float()
    out, k = w.shape
    if spec.granularity == "tensor":
        scale, zero = grid_qparams(w.min().reshape(1, 1), w.max().reshape(1, 1), spec)
        return scale.expand(out, 1).contiguous(), None if zero is None else zero.expand(out, 1).contiguous()
    wg = group_view(w, spec.num_groups(k))  # [out, G, K/G]
    return grid_qparams(wg.amin(-1), wg.amax(-1), spec)


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec,
             g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Values -> integer codes: clamp(round(x / s) + z, qmin, qmax).

    x [..., K], scale/zero [..., G] -> codes [..., K] int32. Rounding is half-to-even.
    """
    xf = x.float()
    shaped = xf if g_idx is not None else group_view(xf, scale.shape[-1])
    q = torch.round(shaped / expand_params(scale, g_idx))
    if zero is not None:
        q = q + expand_params(zero, g_idx)
    return torch.clamp(q, spec.qmin, spec.qmax).to(torch.int32).reshape(x.shape)


def fake_quantize(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """RTN round trip in floating point: w [out, in] -> dequantize(quantize(w)) [out, in] float32."""
    scale, zero = compute_qparams(w, spec)
    return dequantize(quantize(w, scale, zero, spec), scale, zero)


def quantize_rtn(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """w [out, in] -> QuantizedWeight on the min-max grid of `spec`."""
    scale, zero = compute_qparams(w, spec)
    return QuantizedWeight(quantize(w, scale, zero, spec), scale, zero, spec)


@dataclass
class RTNQuantizer:
    """`LayerQuantizer` for round-to-nearest: no calibration, stats are ignored."""

    spec: QuantSpec
    needs_calibration: bool = False

    def quantize_layer(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedWeight:
        return quantize_rtn(weight, self.spec)
