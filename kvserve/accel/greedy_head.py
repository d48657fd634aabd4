"""Greedy tokens from an fp32 LM head without computing every logit (kvserve/kernels/greedy_head.c).

A greedy row needs only the argmax of its logits (a top-k row, only its k largest). An int8 copy of the head bounds every logit
rigorously; the few tokens that can still be the maximum get their fp32 logit from the head's
packed copy, computed as the panel kernel computes it, so the token is bitwise the one the full
logits give. On Gemma 3 270M (262,144 x 640) the copy is 168 MB more memory and a step reads a
quarter of the fp32 head's bytes.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from kvserve import kernels
from kvserve.accel.panels import Panels, packed_head


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

    def _takes(self, hidden: torch.Tensor) -> bool:
        """hidden is rows the screen computes (fp32 CPU [N > 0, K]) and the screen is current."""
        return (hidden.dim() == 2 and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
                and hidden.shape[1] == self.weight.shape[1] and hidden.shape[0] > 0 and self._current())

    def tokens(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, list[int]] | None:
        """hidden [N, K] -> (tokens [N] int64, rows the screen left at -1 for the caller to compute
        in full), or None where the screen does not apply (another dtype or device). allowed: each
        row's allowed tokens (`kernels.screen_argmax`)."""
        if not self._takes(hidden):
            return None
        tokens = kernels.screen_argmax(hidden, self.panels.packed, self.panels.rows, self.screen, allowed)
        return tokens, (tokens < 0).nonzero().flatten().tolist()

    def top_k_logits(self, hidden: torch.Tensor, top_k: list[int], touched: list[list[int]] | None = None
                     ) -> tuple[torch.Tensor, list[int]] | None:
        """hidden [N, K], top_k [N] -> (logits [N, V]: each row's logits of its top-k tokens and
        any near them, and of its touched tokens, -inf elsewhere (`kernels.screen_top_k`); rows
        left for the caller to compute in full), or None where the screen does not apply."""
        if not self._takes(hidden):
            return None
        return kernels.screen_top_k(hidden, self.panels.packed, self.panels.rows, self.screen, top_k, touched)


# model -> its screen: kept beside the model (the model class knows nothing of fast paths);
# engines sharing a model share its screen.
_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def screen_head(model: nn.Module) -> GreedyHead | None:
    """Give a model whose head is packed (fp32, kvserve/accel/panels.py) its greedy screen, kept
    while the packed head stays the same; returns it (None: no packed head, no kernel)."""
    panels = packed_head(model)
    current = _SCREENS.get(model)
    if panels is not None and (current is None or current.panels is not panels):
        current = GreedyHead.pack(panels)
        if current is None:
            _SCREENS.pop(model, None)
        else:
            _SCREENS[model] = current
    return current


def head_screen(model: nn.Module) -> GreedyHead | None:
    """The model's greedy screen (None when it has none)."""
    return _SCREENS.get(model)


def drop_head_screen(model: nn.Module) -> None:
    """Greedy rows of this model compute their full logits again."""
    _SCREENS.pop(model, None)


def _usable_screen(model: nn.Module) -> GreedyHead | None:
    """The model's screen where its logits are the packed head's products as they are (no
    soft-capping) and the head is still the one it was built from."""
    screen = _SCREENS.get(model)
    if screen is None or model.config.final_logit_softcapping or screen.panels is not packed_head(model):
        return None
    return screen


def greedy_tokens(model: nn.Module, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor | None:
    """hidden [N, hidden] -> [N] int64, each row's first index of the maximum of
    model.compute_logits(hidden) (bitwise the same logits), through the head's int8 screen; None
    where there is none (no packed fp32 head, logit soft-capping). allowed: [N, ceil(V / 32)]
    int32, the tokens each row may take (a grammar's mask): the maximum over those alone."""
    screen = _usable_screen(model)
    found = None if screen is None else screen.tokens(hidden, allowed)
    if found is None:
        return None
    tokens, unsettled = found
    if unsettled:  # rare: too many near-ties, a zero row, a row allowing nothing; their full logits
        idx = torch.tensor(unsettled)
        logits = model.compute_logits(hidden.index_select(0, idx), upcast=False)
        if allowed is not None:
            kernels.apply_token_bitmask(logits, allowed.index_select(0, idx), list(range(len(unsettled))))
        picked = kernels.argmax_rows(logits)
        tokens[idx] = logits.max(dim=-1).indices if picked is None else picked
    return tokens


def top_k_logits(model: nn.Module, hidden: torch.Tensor, top_k: list[int], touched: list[list[int]] | None = None
                 ) -> torch.Tensor | None:
    """hidden [N, hidden], top_k [N] (1 .. kernels.SCREEN_MAX_TOP_K) -> fp32 logits [N, V] that
    equal model.compute_logits(hidden) (bitwise) at each row's top_k largest tokens and at any
    token within 2^-20 of the k-th, -inf elsewhere: what a row sampled under top-k (then
    temperature, top-p, min-p) draws from, through the head's int8 screen; None where there is
    none (as `greedy_tokens`). touched [N]: each row's tokens that penalties or logit biases will
    change (distinct, in [0, V)): computed too, and the top_k covered is then that of the row after
    those changes, whatever they are."""
    screen = _usable_screen(model)
    found = None if screen is None else screen.top_k_logits(hidden, top_k, touched)
    if found is None:
        return None
    logits, unsettled = found
    if unsettled:  # rare: a zero row, too many candidates; their full logits
        idx = torch.tensor(unsettled)
        logits[idx] = model.compute_logits(hidden.index_select(0, idx), upcast=False).float()
    return logits
