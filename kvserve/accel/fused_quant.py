"""Fusing the low-bit projections that read the same input: q/k/v of an attention layer and
gate/up of a gated MLP become one QuantLinear each (rows concatenated; codes and scales as
stored, so the product is the same), one kernel call instead of three or two.

For the engine's `--weights int8|int4` path, where a batch-1 decode step is ~126 small kernel
calls and the per-call cost counts. fp32 layers are left alone: MKL's GEMM was no faster on the
fused shapes (docs/ARCHITECTURE.md, "Measured decisions").
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import Attention
from kvserve.model.layers import GatedMLP
from kvserve.weights.linear import QuantLinear
from kvserve.weights.packing import cpu_int4_block_n


def concat_rows(parts: list[nn.Module]) -> QuantLinear | None:
    """One QuantLinear computing torch.cat([p(x) for p in parts], -1), or None when the parts do
    not share a kernel (int8 / int4), grid, input width and activation dtype, carry a bias, or (int4)
    have a row count that is not a whole number of the kernel layout's row tiles."""
    if not all(isinstance(p, QuantLinear) for p in parts):
        return None
    first = parts[0]
    same = all(p.kernel == first.kernel and p.spec == first.spec and p.in_features == first.in_features
               and p.act_dtype == first.act_dtype and p.group_size == first.group_size for p in parts)
    if not same or first.kernel not in ("int8", "int4") or any(p.bias is not None for p in parts):
        return None
    if first.kernel == "int4" and any(p.out_features % cpu_int4_block_n() for p in parts):
        return None  # a short last tile is laid out differently: it cannot sit in the middle
    n = sum(p.out_features for p in parts)
    fused = QuantLinear(first.in_features, n, first.spec, first.kernel, first.act_dtype)
    with torch.no_grad():
        fused.qweight = torch.cat([p.qweight for p in parts])  # whole tiles: rows stay rows
        if first.kernel == "int4":
            fused.scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1)  # [K/g, N, 2]
        else:
            fused.scales = torch.cat([p.scales for p in parts])
            if first.zero_offset is not None:
                fused.zero_offset = torch.cat([p.zero_offset for p in parts])
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v (layers that compute their own K/V) and gate/up of every block, in place;
    returns how many fused layers were made."""
    made = 0
    for m in model.modules():
        if isinstance(m, Attention) and m.computes_kv and m.qkv_proj is None:
            fused = concat_rows([m.q_proj, m.k_proj, m.v_proj])
            if fused is not None:
                m.qkv_proj, m.q_proj, m.k_proj, m.v_proj = fused, None, None, None
                made += 1
        elif isinstance(m, GatedMLP) and m.gate_up_proj is None:
            fused = concat_rows([m.gate_proj, m.up_proj])
            if fused is not None:
                m.gate_up_proj, m.gate_proj, m.up_proj = fused, None, None
                made += 1
    return made
