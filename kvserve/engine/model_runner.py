"""ModelRunner: a scheduled step (sequences and how many tokens each feeds) -> flat tensors ->
one forward pass -> logits for the sequences that sample."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from kvserve.model.attention import AttentionMetadata, DecodeBatch, KVCache, SeqAttention
from kvserve.model.base import CausalLM


@dataclass
class StepInput:
    """One sequence's share of a step: feed `token_ids` at positions start_pos.. ; after the
    step its context covers positions [0, start_pos + len(token_ids)), whose K/V live in the
    blocks of `block_table` (logical block i -> physical block id)."""

    token_ids: Seq[int]
    start_pos: int
    block_table: Seq[int]
    needs_logits: bool = True
    num_logits: int = 1  # logits for this many last tokens (1 + k when verifying k draft tokens)


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
        indices [num_logits] of the rows whose logits are needed (each sequence's last
        `num_logits` tokens, in input order)."""
        bs = self.block_size
        ids, positions, slots, seqs, logit_rows = [], [], [], [], []
        decodes: list[tuple[int, int, Seq[int]]] = []  # (row, context length, block table)
        for inp in inputs:
            n = len(inp.token_ids)
            if n == 0:
                raise ValueError("a scheduled sequence must feed at least one token")
            end = inp.start_pos + n
            q_start = len(ids)
            ids.extend(inp.token_ids)
            positions.extend(range(inp.start_pos, end))
            if n == 1:  # decode: one new slot, computed in Python (no per-sequence tensors)
                p = inp.start_pos
                if len(inp.block_table) <= p // bs:
                    raise ValueError(f"block table has {len(inp.block_table)} blocks, {end} tokens need more")
                slots.append(inp.block_table[p // bs] * bs + p % bs)
                decodes.append((q_start, end, inp.block_table))
            else:
                ctx_slots = self._ctx_slots(inp.block_table, end)
                slots.extend(ctx_slots[inp.start_pos:end].tolist())
                seqs.append(SeqAttention(q_start, n, ctx_slots))
            if inp.needs_logits:
                if not 1 <= inp.num_logits <= n:
                    raise ValueError(f"num_logits must be in [1, {n}], got {inp.num_logits}")
                logit_rows.extend(range(q_start + n - inp.num_logits, q_start + n))
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), seqs=seqs, decode=self._decode_batch(decodes))
        return self._tensor(ids), self._tensor(positions), meta, self._tensor(logit_rows)

    def _decode_batch(self, decodes: list[tuple[int, int, Seq[int]]]) -> DecodeBatch | None:
        if not decodes:
            return None
        width = max(-(-length // self.block_size) for _, length, _ in decodes)
        tables = [list(table[:width]) + [0] * (width - min(width, len(table))) for _, _, table in decodes]
        lens = [length for _, length, _ in decodes]
        return DecodeBatch(rows=self._tensor([r for r, _, _ in decodes]),
                           block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
                           lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
                           block_size=self.block_size, max_len=max(lens))

    @torch.inference_mode()
    def execute(self, inputs: Seq[StepInput], num_layers: int | None = None) -> torch.Tensor:
        """Run one forward pass; returns logits [sum of num_logits over sequences needing
        logits, vocab] in the model's dtype (the sampler upcasts what it needs to fp32).

        `num_layers`: exit after that many layers (a self-speculative draft); only those layers'
        K/V are written."""
        input_ids, positions, meta, logit_rows = self.prepare(inputs)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, num_layers=num_layers)
        if logit_rows.numel() == 0:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, logit_rows), upcast=False)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Seq[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer before the forward."""
        if not pairs:
            return
        src = torch.cat([torch.arange(s * block_size, (s + 1) * block_size) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * block_size, (d + 1) * block_size) for _, d in pairs])
        self.kv_cache.copy_slots(src.to(self.device), dst.to(self.device))
