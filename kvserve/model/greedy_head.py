"""Greedy tokens from an fp32 LM head without computing every logit (kvserve/kernels/greedy_head.c).

A greedy row needs only the argmax of its logits. An int8 copy of the head bounds every logit
rigorously; the few tokens that can still be the maximum get their fp32 logit from the head's
packed copy, computed as the panel kernel computes it, so the token is bitwise the one the full
logits give. On Gemma 3 270M (262,144 x 640) the copy is 168 MB more memory and a step reads a
quarter of the fp32 head's bytes.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvserve import kernels


class Panels(Protocol):
    """What the screen reads of a packed head (model/panels.py's Panels, which builds it)."""

    weights: tuple[torch.Tensor, ...]
    packed: torch.Tensor
    rows: int

    @property
    def weight(self) -> torch.Tensor: ...

    def refresh(self) -> bool: ...


class GreedyHead:
    """The screen of a packed fp32 head (`Panels` of one weight [V, K]); rebuilt when the weight
    changes in place."""

    def __init__(self, panels: Panels, screen: kernels.HeadScreen):
        self.panels = panels
        self.screen = screen
        self._source = panels.packed  # Panels.refresh repacks into a new tensor: the screen follows it

    @property
    def weight(self) -> torch.Tensor:
        return self.panels.weight

    @property
    def nbytes(self) -> int:
        """Bytes a step reads through the screen: the int8 copy and the per-token bound terms."""
        s = self.screen
        return sum(t.numel() * t.element_size() for t in (s.q, s.scale, s.c1, s.c2))

    @classmethod
    def pack(cls, panels: Panels) -> GreedyHead | None:
        if len(panels.weights) != 1:
            return None
        screen = kernels.pack_head_screen(panels.packed, panels.rows)
        return None if screen is None else cls(panels, screen)

    def _current(self) -> bool:
        if not self.panels.refresh():
            return False
        if self.panels.packed is not self._source:
            screen = kernels.pack_head_screen(self.panels.packed, self.panels.rows)
            if screen is None:
                return False
            self.screen, self._source = screen, self.panels.packed
        return True

    def tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, list[int]] | None:
        """hidden [N, K] -> (tokens [N] int64, rows the screen left at -1 for the caller to compute
        in full), or None where the screen does not apply (another dtype or device)."""
        if (hidden.dim() != 2 or hidden.dtype != torch.float32 or hidden.device.type != "cpu"
                or hidden.shape[1] != self.weight.shape[1] or hidden.shape[0] == 0 or not self._current()):
            return None
        tokens = kernels.screen_argmax(hidden, self.panels.packed, self.panels.rows, self.screen)
        return tokens, (tokens < 0).nonzero().flatten().tolist()
