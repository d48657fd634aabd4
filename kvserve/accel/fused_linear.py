"""q/k/v of an attention layer and gate/up of a gated MLP as one float matmul each.

On CUDA a decode step's matmuls are matrix-vector products that each pay a launch and a ramp-up
before they stream at full bandwidth: one product over the concatenated rows reads the same
bytes in one kernel instead of three or two. The fused weight is the only copy: the original
layers' weights become views of its rows, so `state_dict`, saving and a self-speculative draft
see the model as before, and no memory is added.

(The CPU packs its own fused panels, accel/panels.py; low-bit layers fuse in accel/fused_quant.py.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention import Attention
from kvserve.model.layers import GatedMLP


class FusedLinear(nn.Module):
    """torch.cat([p(x) for p in parts], -1) as one F.linear. Its tensors are non-persistent
    buffers: the parts (views of their rows) are what the state dict holds."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.gemv = None  # a small-batch kernel choice (accel/cuda_gemv.py GemvChoice), set on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None:
            return self.gemv.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_sharing(cls: type[nn.Linear], linear: nn.Linear, **attrs) -> nn.Linear:
    """An instance of the nn.Linear subclass `cls` holding `linear`'s own parameters (the same
    tensors under the same state_dict keys) and the fast path's `attrs`: how a fast path swaps a
    layer's forward."""
    m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    m.weight = linear.weight
    if linear.bias is not None:
        m.bias = linear.bias
    m.train(linear.training)
    for name, value in attrs.items():
        setattr(m, name, value)
    return m


def concat_linears(parts: list[nn.Module]) -> FusedLinear | None:
    """One FusedLinear for plain float nn.Linear parts of one input width, the parts' weights (and
    biases) rebound to views of it; None when the parts are not that."""
    if not all(type(p) is nn.Linear for p in parts):
        return None
    first = parts[0].weight
    if any(p.weight.dtype != first.dtype or p.in_features != parts[0].in_features for p in parts):
        return None
    if len({p.bias is None for p in parts}) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([p.weight for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        row = 0
        for p in parts:
            n = p.out_features
            p.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
            row += n
    return FusedLinear(weight, bias)


def fuse_linear_projections(model: nn.Module) -> int:
    """Fuse q/k/v (layers computing their own K/V) and gate/up of every block, in place;
    returns how many fused layers were made."""
    made = 0
    for m in model.modules():
        if isinstance(m, Attention) and m.computes_kv and m.qkv_proj is None:
            m.qkv_proj = concat_linears([m.q_proj, m.k_proj, m.v_proj])
            made += m.qkv_proj is not None
        elif isinstance(m, GatedMLP) and m.gate_up_proj is None:
            m.gate_up_proj = concat_linears([m.gate_proj, m.up_proj])
            made += m.gate_up_proj is not None
    return made
