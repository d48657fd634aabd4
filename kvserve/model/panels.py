"""Decode-step matmuls on weights packed once for kvserve/kernels/panel_gemm.c (CPU, fp32).

A decode step multiplies a few rows (one per running sequence) by every weight matrix; MKL's
sgemm re-packs the weight on each call and is slow for a handful of rows. The engine keeps a
packed copy of each fp32 weight (one more copy of the weights in memory) and sends inputs of up
to MAX_PANEL_ROWS rows through the kernel; prefill chunks (more rows) stay on PyTorch's matmul.

A packed copy remembers the weight it came from (storage and in-place version counter) and is
rebuilt when that changes, so pruning, SmoothQuant or training the model afterwards does not leave
it stale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels

MAX_PANEL_ROWS = 128  # the kernel matched or beat MKL up to here (docs/BENCHMARKS.md, issue 9)


class Panels:
    """`weight` [N, K] fp32 packed for the panel kernel; `matmul` repacks when it has changed."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor):
        self.weight = weight
        self.packed = packed
        self._stamp = self._stamp_of(weight)

    @staticmethod
    def _stamp_of(weight: torch.Tensor) -> tuple[int, int, torch.dtype]:
        return weight.data_ptr(), weight._version, weight.dtype

    @classmethod
    def pack(cls, weight: torch.Tensor) -> Panels | None:
        packed = kernels.pack_panels(weight)
        return None if packed is None else cls(weight, packed)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [..., K] @ weight^T (+ bias) -> [..., N]; None where the kernel does not apply (more
        than MAX_PANEL_ROWS rows, another dtype or device, autograd) and PyTorch's matmul should."""
        w = self.weight
        k = w.shape[1]
        rows = x.numel() // k if k else 0
        if (not 0 < rows <= MAX_PANEL_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return None
        if self._stamp_of(w) != self._stamp:
            repacked = kernels.pack_panels(w)
            if repacked is None:  # no longer fp32 / CPU
                return None
            self.packed, self._stamp = repacked, self._stamp_of(w)
        y = kernels.panel_matmul(x.reshape(rows, k), self.packed, w.shape[0])
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], w.shape[0])


class PanelLinear(nn.Linear):
    """An nn.Linear with its weight also packed (`panels`): decode-sized inputs use the kernel."""

    panels: Panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.panels.matmul(x, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y


def use_panel_kernels(model: nn.Module) -> int:
    """Pack every fp32 CPU nn.Linear of `model` (turned into PanelLinear in place: same
    parameters, same state_dict) and a tied LM head (`model.head_panels`, used by
    `compute_logits`). Returns how many matrices were packed: 0 without the kernel."""
    count = 0
    for m in model.modules():
        if type(m) is PanelLinear:
            count += 1
        elif type(m) is nn.Linear:
            panels = Panels.pack(m.weight)
            if panels is None:
                continue
            m.__class__ = PanelLinear  # keeps the module's parameters, hooks and place in the tree
            m.panels = panels
            count += 1
    if getattr(model, "lm_head", False) is None and hasattr(model, "embed_tokens"):
        head = getattr(model, "head_panels", None)
        if head is None or head.weight is not model.embed_tokens.weight:
            model.head_panels = Panels.pack(model.embed_tokens.weight)
        count += model.head_panels is not None  # (a model packed before keeps its copies)
    return count
