"""ModelRunner: a scheduled step (sequences and how many tokens each feeds) -> flat tensors ->
one forward pass -> logits for the sequences that sample."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from kvserve.model.attention import AttentionMetadata, DecodeGroup, KVCache, SeqAttention
from kvserve.model.base import CausalLM

DECODE_GROUP = 16  # decode sequences per attention call


@dataclass
class StepInput:
    """One sequence's share of a step: feed `token_ids` at positions start_pos.. ; after the
    step its context covers positions [0, start_pos + len(token_ids)), whose K/V live in the
    blocks of `block_table` (logical block i -> physical block id)."""

    token_ids: Seq[int]
    start_pos: int
    block_table: Seq[int]
    needs_logits: bool = True


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, block_size: int, device: torch.device | str = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = torch.device(device)
        self._block_offsets = torch.arange(block_size, device=self.device)

    def _ctx_slots(self, block_table: Seq[int], ctx_len: int) -> torch.Tensor:
        """Slot of each logical position [ctx_len]: block_table[p // bs] * bs + p % bs."""
        need = -(-ctx_len // self.block_size)
        if len(block_table) < need:
            raise ValueError(f"block table has {len(block_table)} blocks, {ctx_len} tokens need {need}")
        blocks = torch.tensor(block_table[:need], dtype=torch.long, device=self.device)
        return (blocks[:, None] * self.block_size + self._block_offsets).view(-1)[:ctx_len]

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, inputs: Seq[StepInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step: input_ids, positions, slot_mapping [T]; per-sequence attention views;
        indices [num_logits] of the rows whose logits are needed (each sequence's last token)."""
        ids, positions, slots, seqs, logit_rows = [], [], [], [], []
        decodes: list[tuple[int, torch.Tensor]] = []  # (row, ctx slots) of single-token sequences
        for inp in inputs:
            n = len(inp.token_ids)
            if n == 0:
                raise ValueError("a scheduled sequence must feed at least one token")
            end = inp.start_pos + n
            ctx_slots = self._ctx_slots(inp.block_table, end)
            q_start = len(ids)
            ids.extend(inp.token_ids)
            positions.extend(range(inp.start_pos, end))
            slots.append(ctx_slots[inp.start_pos:end])
            if n == 1:
                decodes.append((q_start, ctx_slots))
            else:
                seqs.append(SeqAttention(q_start, n, ctx_slots))
            if inp.needs_logits:
                logit_rows.append(q_start + n - 1)
        meta = AttentionMetadata(slot_mapping=torch.cat(slots), seqs=seqs, decode_groups=self._group(decodes))
        return self._tensor(ids), self._tensor(positions), meta, self._tensor(logit_rows)

    def _group(self, decodes: list[tuple[int, torch.Tensor]]) -> list[DecodeGroup]:
        """Sort decodes by context length and cut them into groups of DECODE_GROUP: one attention
        call per group instead of per sequence, with little padding inside a group."""
        decodes = sorted(decodes, key=lambda d: len(d[1]))
        return [DecodeGroup(self._tensor([r for r, _ in chunk]), [c for _, c in chunk])
                for chunk in (decodes[i:i + DECODE_GROUP] for i in range(0, len(decodes), DECODE_GROUP))]

    @torch.inference_mode()
    def execute(self, inputs: Seq[StepInput]) -> torch.Tensor:
        """Run one forward pass; returns fp32 logits [num sequences needing logits, vocab]."""
        input_ids, positions, meta, logit_rows = self.prepare(inputs)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if logit_rows.numel() == 0:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, logit_rows))

    @torch.inference_mode()
    def copy_blocks(self, pairs: Seq[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer before the forward."""
        if not pairs:
            return
        src = torch.cat([torch.arange(s * block_size, (s + 1) * block_size) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * block_size, (d + 1) * block_size) for _, d in pairs])
        self.kv_cache.copy_slots(src.to(self.device), dst.to(self.device))
