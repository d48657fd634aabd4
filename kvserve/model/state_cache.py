"""The recurrent state pool of a hybrid model, beside the paged KV pool.

A Mamba layer keeps no K/V: per sequence it carries a conv state (the last d_conv - 1 inputs of
its causal conv) and an SSM state ([heads, head_dim, d_state]), both of a size fixed whatever the
sequence's length. The engine holds them in a fixed pool of state slots, one slot per running
sequence (the block manager hands them out, pure Python, as it hands out pages); a step tells each
recurrent layer, per sequence, which slot to read and update (`RecurrentMetadata`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


class StateCache:
    """conv[j] [num_slots, conv_dim, d_conv - 1] and ssm[j] [num_slots, heads, head_dim, d_state]
    for the j-th recurrent layer. The SSM state is kept in fp32 whatever the model computes in (it
    accumulates over the whole sequence); the conv state holds inputs, in the model's dtype."""

    def __init__(self, layers: Sequence[int], num_slots: int, conv_dim: int, d_conv: int, num_heads: int,
                 head_dim: int, d_state: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 ssm_dtype: torch.dtype = torch.float32):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.layers = tuple(layers)
        self.num_slots = num_slots
        self.dtype, self.ssm_dtype = dtype, ssm_dtype
        self.conv = [torch.zeros(num_slots, conv_dim, d_conv - 1, dtype=dtype, device=device) for _ in self.layers]
        self.ssm = [torch.zeros(num_slots, num_heads, head_dim, d_state, dtype=ssm_dtype, device=device)
                    for _ in self.layers]
        self._index = {layer: j for j, layer in enumerate(self.layers)}

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_elements: int, ssm_elements: int, dtype: torch.dtype,
                       ssm_dtype: torch.dtype = torch.float32) -> int:
        """One sequence's state over `num_layers` recurrent layers (see ModelConfig.state_elements_per_layer)."""
        return num_layers * (conv_elements * dtype.itemsize + ssm_elements * ssm_dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)

    @property
    def slot_nbytes(self) -> int:
        return self.nbytes // self.num_slots

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and SSM pools of a recurrent layer."""
        j = self._index[layer]
        return self.conv[j], self.ssm[j]

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Fork (n > 1): each (src, dst) pair gives dst a copy of src's state in every layer."""
        if not pairs:
            return
        device = self.conv[0].device if self.conv else "cpu"
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for t in self.conv + self.ssm:
            t[dst] = t[src]

    def save(self, slots: Sequence[int]) -> list[torch.Tensor] | None:
        """Copies of the slots' states, for `restore` after a failed forward pass (a pass updates
        the states layer by layer, and a rerun must start from the states before it)."""
        if not slots:
            return None
        idx = torch.tensor(list(slots), dtype=torch.long, device=self.conv[0].device)
        return [idx] + [t.index_select(0, idx) for t in self.conv + self.ssm]

    def restore(self, saved: list[torch.Tensor] | None) -> None:
        if saved is None:
            return
        idx, *copies = saved
        for t, c in zip(self.conv + self.ssm, copies):
            t.index_copy_(0, idx, c)


@dataclass
class SeqState:
    """One multi-token sequence's share of a step for the recurrent layers: rows [q_start,
    q_start + q_len) of the flat batch continue the state in `slot` (from zeros when `has_state`
    is False: the chunk starts at position 0)."""

    q_start: int
    q_len: int
    slot: int
    has_state: bool


@dataclass
class RecurrentMetadata:
    """What the recurrent layers need for one step (built by the model runner)."""

    cache: StateCache
    seqs: list[SeqState]  # prefill chunks: one scan each
    decode_rows: torch.Tensor | None = None  # [B] int64: single-token sequences, one batched update
    decode_slots: torch.Tensor | None = None  # [B] int64
    decode_has_state: torch.Tensor | None = None  # [B] bool (False: a one-token prompt, zero state)
