"""Decode-step matmuls on weights packed once for kvserve/kernels/panel_gemm.c (CPU, fp32).

A decode step multiplies a few rows (one per running sequence) by every weight matrix; MKL's
sgemm re-packs the weight on each call and is slow for a handful of rows. The engine keeps a
packed copy of each fp32 weight (one more copy of the weights in memory) and sends inputs of any
number of rows through the kernel, prefill chunks included: on a 2-core Zen 3 it matched or
beat MKL at 256-512 rows as well (1.0-1.45x per matrix, a 512-token prefill 1.24x faster); on an
AVX-512 Xeon it was measured up to 128 rows only.

A packed copy remembers the weight it came from (storage and in-place version counter) and is
rebuilt when that changes, so pruning, SmoothQuant or training the model afterwards does not leave
it stale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.accel.fused_linear import linear_sharing
from kvserve.model.attention import Attention
from kvserve.model.layers import GatedMLP


class Panels:
    """Weights [N_i, K] fp32 packed, stacked by rows, for the panel kernel (one weight, or q/k/v
    or gate/up that read the same input: one call, each output column the FMA chain it would be
    alone); `matmul` repacks when any of them has changed."""

    def __init__(self, weights: tuple[torch.Tensor, ...], packed: torch.Tensor):
        self.weights = weights
        self.rows = sum(w.shape[0] for w in weights)
        self.packed = packed
        self._stamp = self._stamp_of(weights)

    @property
    def weight(self) -> torch.Tensor:
        """The (first) weight packed here."""
        return self.weights[0]

    @staticmethod
    def _stamp_of(weights: tuple[torch.Tensor, ...]) -> tuple:
        return tuple((w.data_ptr(), w._version, w.dtype) for w in weights)

    @staticmethod
    def _pack(weights: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        if len({w.shape[1:] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            return None
        return kernels.pack_panels(weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights]))

    @classmethod
    def pack(cls, *weights: torch.Tensor) -> Panels | None:
        packed = cls._pack(weights)
        return None if packed is None else cls(weights, packed)

    def refresh(self) -> bool:
        """Repack when a weight changed since packing; False when they no longer pack (not fp32 / CPU)."""
        if self._stamp_of(self.weights) != self._stamp:
            repacked = self._pack(self.weights)
            if repacked is None:
                return False
            self.packed, self._stamp = repacked, self._stamp_of(self.weights)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [..., K] @ the stacked weights^T (+ bias) -> [..., sum N_i]; None where the kernel does
        not apply (no rows, another dtype or device, autograd) and PyTorch's matmul should."""
        if torch.compiler.is_compiling():  # the traced graph multiplies with the Linear's own weight
            return None
        k = self.weights[0].shape[1]
        rows = x.numel() // k if k else 0
        if (rows == 0 or x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in self.weights)))):
            return None
        if not self.refresh():
            return None
        y = kernels.panel_matmul(x.reshape(rows, k), self.packed, self.rows)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.rows)


class PanelLinear(nn.Linear):
    """An nn.Linear with its weight also packed (`panels`): decode-sized inputs use the kernel."""

    panels: Panels | None  # None: packed with its siblings (fused_panels), called alone only for prefill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = None if self.panels is None else self.panels.matmul(x, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y


def fused_panels(current: Panels | None, *linears: nn.Module) -> Panels | None:
    """One packed copy of bias-free PanelLinears that read the same input (q/k/v, gate/up),
    their own copies dropped; `current` when it already stacks these weights (engines sharing a
    model pack once), None (nothing changed) when they are not all such layers."""
    if not linears or any(type(m) is not PanelLinear or m.bias is not None for m in linears):
        return None
    weights = tuple(m.weight for m in linears)
    if current is not None and len(current.weights) == len(weights) and all(
            a is b for a, b in zip(current.weights, weights)):  # identity: == on tensors is elementwise
        return current
    panels = Panels.pack(*weights)
    if panels is not None:
        for m in linears:
            m.panels = None
    return panels


def use_panel_kernels(model: nn.Module, head_only: bool = False) -> int:
    """Pack every fp32 CPU nn.Linear of `model` (replaced in the module tree by a PanelLinear
    holding the same parameters: same state_dict) and a tied LM head (`model.head_panels`, used by
    `compute_logits`). Returns how many matrices were packed: 0 without the kernel. `head_only`:
    the LM head alone (a compiled forward pass multiplies the body's weights with PyTorch's
    matmul)."""
    count = 0
    named = [("lm_head", getattr(model, "lm_head", None))] if head_only else list(model.named_modules())
    for name, m in named:  # (lm_head None: a tied head)
        if type(m) is PanelLinear:
            count += 1
        elif type(m) is nn.Linear:
            panels = Panels.pack(m.weight)
            if panels is None:
                continue
            model.set_submodule(name, linear_sharing(PanelLinear, m, panels=panels))
            count += 1
    # q/k/v and gate/up as one call each: the k and v matrices alone are too small to stream fast.
    for m in () if head_only else model.modules():
        if isinstance(m, Attention) and m.computes_kv:
            m.qkv_panels = fused_panels(m.qkv_panels, m.q_proj, m.k_proj, m.v_proj)
        elif isinstance(m, GatedMLP):
            m.gate_up_panels = fused_panels(m.gate_up_panels, m.gate_proj, m.up_proj)
    if getattr(model, "lm_head", False) is None and hasattr(model, "embed_tokens"):
        head = getattr(model, "head_panels", None)
        if head is None or head.weight is not model.embed_tokens.weight:
            model.head_panels = Panels.pack(model.embed_tokens.weight)
        count += model.head_panels is not None  # (a model packed before keeps its copies)
    return count


def packed_head(model: nn.Module) -> Panels | None:
    """The packed copy `compute_logits` multiplies the head with (panel kernel), or None."""
    head = getattr(model, "lm_head", False)
    if head is None:
        return getattr(model, "head_panels", None)
    if type(head) is PanelLinear and head.bias is None:
        return head.panels
    return None

