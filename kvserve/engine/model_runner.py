"""ModelRunner: a scheduled step (sequences and how many tokens each feeds) -> flat tensors ->
one forward pass -> logits for the sequences that sample."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence as Seq

import torch

from kvserve import kernels
from kvserve.accel.compiled import compile_step, run_compiled
from kvserve.accel.decode_plan import run_decode_plan
from kvserve.accel.greedy_head import greedy_tokens, head_screen, top_k_logits
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.model.attention import (
    AttentionMetadata,
    DecodeBatch,
    KeptRows,
    KVCache,
    SeqAttention,
)
from kvserve.model.base import CausalLM
from kvserve.model.state_cache import RecurrentMetadata, SeqState, StateCache
from kvserve.model.streaming import PagedStreamingAttention, StreamPolicy


@dataclass
class StepInput:
    """One sequence's share of a step: feed `token_ids` at positions start_pos.. ; after the
    step its context covers positions [0, start_pos + len(token_ids)), whose K/V live in the
    blocks of `block_table` (logical block i -> physical block id) for KV layer group 0, and of
    `group_tables` for groups 1.. (several groups: sliding-window release; see KVCache)."""

    token_ids: Seq[int]
    start_pos: int
    block_table: Seq[int]
    needs_logits: bool = True
    num_logits: int = 1  # logits for this many last tokens (1 + k when verifying k draft tokens)
    group_tables: Seq[Seq[int]] = ()
    # Final hidden states of the `num_hidden` rows just before the logit rows (prompt logprobs,
    # embeddings: `ModelRunner.execute_hidden`); 0 on the plain path.
    num_hidden: int = 0
    # A hybrid model's recurrent layers: the sequence's slot of the state pool (continued from
    # its state when start_pos > 0, from zeros at 0).
    state_slot: int | None = None

    @property
    def tables(self) -> list[Seq[int]]:
        return [self.block_table, *self.group_tables]

    @property
    def num_kept(self) -> int:
        """Rows whose final hidden states the pass returns: the hidden rows, then the logit rows."""
        return (self.num_logits if self.needs_logits else 0) + self.num_hidden


class ModelRunner:
    use_decode_plan = True  # small steps (<= 8 rows) through accel/decode_plan.py where it applies

    def __init__(self, model: CausalLM, kv_cache: KVCache, block_size: int, device: torch.device | str = "cpu",
                 stream_policies: list[StreamPolicy] | None = None, compile: bool = False,
                 state_cache: StateCache | None = None):
        """`stream_policies`: StreamingLLM, one policy per layer (None: the model's own
        attention). Then the pool holds pre-RoPE keys and every sequence, decodes included,
        gets a per-sequence attention view (see kvserve/model/streaming.py). `compile`: full
        forward passes through torch.compile (EngineConfig.compile; the model is not changed,
        so engines sharing it may differ). `state_cache`: a hybrid model's recurrent state pool;
        each input then names its slot (StepInput.state_slot)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = torch.device(device)
        self._block_offsets = torch.arange(block_size, device=self.device)
        self.stream_policies = stream_policies
        self.state_cache = state_cache
        self._rotary = [model.rotary[t] if t in model.rotary else None for t in model.config.layer_types]
        self.compiled = compile_step(model) if compile else None
        self.graphs: DecodeGraphs | None = None  # CUDA: captured decode steps (set by the engine)

    def _ctx_slots(self, block_table: Seq[int], ctx_len: int) -> torch.Tensor:
        """Slot of each logical position [ctx_len]: block_table[p // bs] * bs + p % bs.
        Released entries (NULL_BLOCK, < 0) map to page 0: attention never reads them."""
        need = -(-ctx_len // self.block_size)
        if len(block_table) < need:
            raise ValueError(f"block table has {len(block_table)} blocks, {ctx_len} tokens need {need}")
        blocks = torch.tensor(block_table[:need], dtype=torch.long, device=self.device).clamp_(min=0)
        return (blocks[:, None] * self.block_size + self._block_offsets).view(-1)[:ctx_len]

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prepare(self, inputs: Seq[StepInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step: input_ids, positions [T]; per KV layer group the slot_mapping [T]
        and per-sequence attention views; indices of the rows whose final hidden states are
        needed (each sequence's last `num_kept` tokens: its logit rows, after its hidden rows
        when it asks for some; in input order)."""
        bs, num_groups = self.block_size, self.kv_cache.num_groups
        ids, positions, logit_rows = [], [], []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        seqs: list[list[SeqAttention]] = [[] for _ in range(num_groups)]
        decodes: list[tuple[int, int, list[Seq[int]]]] = []  # (row, context length, block table per group)
        for inp in inputs:
            n = len(inp.token_ids)
            if n == 0:
                raise ValueError("a scheduled sequence must feed at least one token")
            tables = inp.tables
            if len(tables) != num_groups:
                raise ValueError(f"{len(tables)} block tables for {num_groups} KV layer groups")
            end = inp.start_pos + n
            q_start = len(ids)
            ids.extend(inp.token_ids)
            positions.extend(range(inp.start_pos, end))
            if n == 1 and self.stream_policies is None:  # decode: one new slot per group, in Python
                blk, off = divmod(inp.start_pos, bs)
                for g, table in enumerate(tables):
                    if len(table) <= blk or table[blk] < 0:
                        raise ValueError(f"block table has no block for position {inp.start_pos} (group {g})")
                    slots[g].append(table[blk] * bs + off)
                decodes.append((q_start, end, tables))
            else:
                masks: dict = {}  # shared by the groups: masks depend on positions only
                for g, table in enumerate(tables):
                    if min(table[inp.start_pos // bs:-(-end // bs)], default=0) < 0:
                        raise ValueError(f"block table has a released block where positions {inp.start_pos}.. go")
                    ctx_slots = self._ctx_slots(table, end)
                    slots[g].extend(ctx_slots[inp.start_pos:end].tolist())
                    seqs[g].append(SeqAttention(q_start, n, ctx_slots, masks))
            if inp.needs_logits and not 1 <= inp.num_logits <= n:
                raise ValueError(f"num_logits must be in [1, {n}], got {inp.num_logits}")
            kept = inp.num_kept
            if kept:
                if inp.num_hidden < 0 or kept > n:
                    raise ValueError(f"{inp.num_hidden} hidden rows and the logit rows exceed the {n} tokens fed")
                logit_rows.extend(range(q_start + n - kept, q_start + n))
        batches = self._decode_batches(decodes, num_groups)
        metas = [AttentionMetadata(slot_mapping=self._tensor(slots[g]), seqs=seqs[g], decode=batches[g])
                 for g in range(num_groups)]
        meta = metas[0]
        if num_groups > 1:
            meta = AttentionMetadata(slot_mapping=meta.slot_mapping, seqs=meta.seqs, decode=meta.decode, groups=metas)
        if self.state_cache is not None:
            meta.recurrent = self._recurrent(inputs)
        return self._tensor(ids), self._tensor(positions), meta, self._tensor(logit_rows)

    def _recurrent(self, inputs: Seq[StepInput]) -> RecurrentMetadata:
        """Each sequence's state slot for the recurrent layers: single-token inputs as one batched
        update (prepare's decode rule), the others one chunk scan each; a chunk at position 0
        starts from zero state (a new or recomputed sequence)."""
        seqs: list[SeqState] = []
        rows, slots, has_state = [], [], []
        q_start = 0
        for inp in inputs:
            if inp.state_slot is None or not 0 <= inp.state_slot < self.state_cache.num_slots:
                raise ValueError(f"a hybrid model's input needs a state slot in [0, {self.state_cache.num_slots}), "
                                 f"got {inp.state_slot}")
            n = len(inp.token_ids)
            if n == 1 and self.stream_policies is None:
                rows.append(q_start)
                slots.append(inp.state_slot)
                has_state.append(inp.start_pos > 0)
            else:
                seqs.append(SeqState(q_start, n, inp.state_slot, inp.start_pos > 0))
            q_start += n
        rec = RecurrentMetadata(self.state_cache, seqs)
        if rows:
            rec.decode_rows, rec.decode_slots = self._tensor(rows), self._tensor(slots)
            rec.decode_has_state = torch.tensor(has_state, dtype=torch.bool, device=self.device)
        return rec

    def _decode_batches(self, decodes: list[tuple[int, int, list[Seq[int]]]],
                        num_groups: int) -> list[DecodeBatch | None]:
        """One DecodeBatch per layer group, sharing rows and lengths."""
        if not decodes:
            return [None] * num_groups
        width = max(-(-length // self.block_size) for _, length, _ in decodes)
        lens = [length for _, length, _ in decodes]
        rows = self._tensor([r for r, _, _ in decodes])
        lens_t = torch.tensor(lens, dtype=torch.int32, device=self.device)
        # One tensor [groups, B, width] from one list (a torch.tensor call per group costs more),
        # then a contiguous [B, width] view per group.
        padded = [list(ts[g][:width]) + [0] * (width - min(width, len(ts[g])))
                  for g in range(num_groups) for _, _, ts in decodes]
        tables = torch.tensor(padded, dtype=torch.int32, device=self.device).view(num_groups, len(decodes), width)
        return [DecodeBatch(rows=rows, block_tables=tables[g], lens=lens_t, block_size=self.block_size,
                            max_len=max(lens)) for g in range(num_groups)]

    @torch.inference_mode()
    def execute(self, inputs: Seq[StepInput], num_layers: int | None = None) -> torch.Tensor:
        """Run one forward pass; returns logits [sum of num_logits over sequences needing
        logits, vocab] in the model's dtype (the sampler upcasts what it needs to fp32).

        `num_layers`: exit after that many layers (a self-speculative draft); only those layers'
        K/V are written."""
        replayed = self._replay(inputs, num_layers)
        if replayed is not None:
            return replayed[1]
        hidden = self._forward(inputs, num_layers)
        if hidden.shape[0] == 0:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden, upcast=False)

    @torch.inference_mode()
    def execute_final_hidden(self, inputs: Seq[StepInput], num_layers: int | None = None) -> torch.Tensor:
        """The final hidden states [logit rows, hidden] (normed) of one forward pass, for a caller
        that applies a head of its own (a draft's vocabulary subset); `num_layers` as in `execute`."""
        return self._forward(inputs, num_layers)

    @property
    def has_greedy_screen(self) -> bool:
        """The model's head has an int8 screen (kvserve/accel/greedy_head.py): greedy tokens,
        masked or not, come without the full logits."""
        return head_screen(self.model) is not None

    @property
    def screen_top_k(self) -> tuple[int, int, int]:
        """(the largest top-k, the most rows, the most touched tokens) of a step the head's screen
        serves (`execute_top_k`); (0, 0, 0): none."""
        if not self.has_greedy_screen:
            return 0, 0, 0
        return kernels.SCREEN_MAX_TOP_K, kernels.SCREEN_TOP_K_MAX_ROWS, kernels.SCREEN_MAX_TOUCHED

    @torch.inference_mode()
    def execute_greedy(self, inputs: Seq[StepInput], allowed: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A forward pass whose logit rows all want only their argmax: (tokens [rows] int64, None)
        where the model's greedy screen applies (the argmax of the logits `execute` returns,
        without computing them), else (None, those logits). allowed: [rows, ceil(V / 32)] int32,
        the tokens each row may take (grammars' masks): the argmax over those."""
        replayed = self._replay(inputs, None) if allowed is None else None  # (a graph's argmax is unmasked)
        if replayed is not None:
            return replayed[0], None
        hidden = self._forward(inputs, None)
        tokens = greedy_tokens(self.model, hidden, allowed) if hidden.shape[0] else None
        if tokens is not None:
            return tokens, None
        if hidden.shape[0] == 0:
            return None, hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return None, self.model.compute_logits(hidden, upcast=False)

    @torch.inference_mode()
    def execute_top_k(self, inputs: Seq[StepInput], top_k: list[int], touched: list[list[int]] | None = None
                      ) -> torch.Tensor:
        """A forward pass whose logit row i is sampled from its top_k[i] largest logits alone, after
        its penalties change the logits of its touched[i] tokens: through the model's screen, fp32
        logits [rows, vocab] equal to `execute`'s at those tokens (and any within 2^-20 of the
        k-th), -inf elsewhere; without one, `execute`'s."""
        hidden = self._forward(inputs, None)
        logits = top_k_logits(self.model, hidden, top_k, touched) if hidden.shape[0] else None
        if logits is not None:
            return logits
        if hidden.shape[0] == 0:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden, upcast=False)

    @torch.inference_mode()
    def execute_steps(self, inputs: Seq[StepInput], steps: Seq[int]) -> list[list[int]] | None:
        """Multi-step greedy decoding: plain decode inputs, input i taking steps[i] decode steps
        in one replay of the captured K-step graph (its slots already reserved) -> each input's
        steps[i] argmax tokens; None where no such graph applies (the engine then decodes one
        step; kvserve/engine/cuda_graphs.py)."""
        g = self.graphs
        if g is None or g.num_steps == 1 or max(steps) != g.num_steps or not g.applies(inputs):
            return None
        tokens = g.run_steps(inputs, steps).t().tolist()  # the one sync for K tokens a row
        return [row[:n] for row, n in zip(tokens, steps)]

    @torch.inference_mode()
    def execute_hidden(self, inputs: Seq[StepInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward pass where some inputs want `num_hidden` rows' final hidden states besides
        their logits: (logits [logit rows, vocab] as `execute` returns them, hidden [sum of
        num_hidden, hidden] in input order). The plain paths (captured graphs, the greedy
        screen) are skipped: they keep the logit rows only."""
        hidden = self._forward(inputs, None)
        logit_idx: list[int] = []
        hidden_idx: list[int] = []
        at = 0
        for inp in inputs:
            hidden_idx.extend(range(at, at + inp.num_hidden))
            logit_idx.extend(range(at + inp.num_hidden, at + inp.num_kept))
            at += inp.num_kept
        rows = hidden.index_select(0, self._tensor(hidden_idx))
        if not logit_idx:
            return hidden.new_empty((0, self.model.config.vocab_size)), rows
        return self.model.compute_logits(hidden.index_select(0, self._tensor(logit_idx)), upcast=False), rows

    def _replay(self, inputs: Seq[StepInput], num_layers: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(argmax tokens, logits) of a plain decode step from its captured CUDA graph; None
        where there is none (not CUDA, an early exit, a step that is not plain decode)."""
        if self.graphs is None or num_layers is not None or not self.graphs.applies(inputs):
            return None
        return self.graphs.run(inputs)

    def _forward(self, inputs: Seq[StepInput], num_layers: int | None) -> torch.Tensor:
        """The final hidden states [rows needing logits, hidden] of one forward pass. A pass of
        several sequences that raises leaves the recurrent states it read as they were (the engine
        reruns the step a sequence at a time, which must start from the same states)."""
        if self.state_cache is None or len(inputs) == 1:  # (a lone sequence's failure ends its request)
            return self._forward_pass(inputs, num_layers)
        saved = self.state_cache.save([inp.state_slot for inp in inputs if inp.start_pos > 0])
        try:
            return self._forward_pass(inputs, num_layers)
        except BaseException:
            self.state_cache.restore(saved)
            raise

    def _forward_pass(self, inputs: Seq[StepInput], num_layers: int | None) -> torch.Tensor:
        input_ids, positions, meta, logit_rows = self.prepare(inputs)
        if self.stream_policies is not None:  # StreamingLLM owns pool writes and rotation
            meta.custom = PagedStreamingAttention(self.kv_cache, meta, positions, self.stream_policies, self._rotary)
        # The last layer past its K/V write for the logit rows only (KeptRows); None: every row,
        # the rows picked after the final norm.
        keep = self._kept_rows(inputs, meta, logit_rows, input_ids.shape[0])
        if self.compiled is not None and num_layers is None and meta.custom is None:
            hidden = run_compiled(self.model, self.compiled, input_ids, positions, self.kv_cache, meta, keep)
            return hidden if keep is not None else hidden.index_select(0, logit_rows)
        if num_layers is None and keep is None and self.use_decode_plan:  # a small step: one C call
            hidden = run_decode_plan(self.model, input_ids, positions, self.kv_cache, meta)
            if hidden is not None:
                return hidden.index_select(0, logit_rows)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, num_layers=num_layers, keep=keep)
        return hidden if keep is not None else hidden.index_select(0, logit_rows)

    def _kept_rows(self, inputs: Seq[StepInput], meta: AttentionMetadata, logit_rows: torch.Tensor,
                   num_rows: int) -> KeptRows | None:
        """The attention metadata of the kept rows alone (each sequence's last num_kept
        queries: its hidden rows and logit rows), for the last layer; None where every row is
        kept (decode steps), a decode row is not, or StreamingLLM's attention owns the step."""
        if self.stream_policies is not None or logit_rows.shape[0] == num_rows:
            return None
        spans: list[tuple[int, int]] = []  # (first kept row, kept rows) of each multi-token input
        decode_rows: list[int] = []
        kept = 0
        for inp in inputs:
            k = inp.num_kept
            if len(inp.token_ids) == 1:  # a decode row (prepare's rule): in the step's DecodeBatch
                if k == 0:
                    return None
                decode_rows.append(kept)
            else:
                spans.append((kept, k))
            kept += k
        rows = self._tensor(decode_rows)
        masks: list[dict] = [{} for _ in spans]  # per sequence, shared by the groups as in prepare
        metas = []
        for m in meta.groups or [meta]:
            seqs = [SeqAttention(first, k, s.ctx_slots, masks[i])
                    for i, (s, (first, k)) in enumerate(zip(m.seqs, spans)) if k]
            decode = None if m.decode is None else replace(m.decode, rows=rows, _groups={})
            metas.append(AttentionMetadata(slot_mapping=m.slot_mapping, seqs=seqs, decode=decode))
        kept_meta = metas[0]
        if len(metas) > 1:
            kept_meta = AttentionMetadata(slot_mapping=kept_meta.slot_mapping, seqs=kept_meta.seqs,
                                          decode=kept_meta.decode, groups=metas)
        return KeptRows(logit_rows, kept_meta)

    @torch.inference_mode()
    def copy_states(self, pairs: Seq[tuple[int, int]]) -> None:
        """Forks (n > 1): each child's state slot gets its parent's states, before the forward."""
        if pairs and self.state_cache is not None:
            self.state_cache.copy_slots(pairs)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Seq[tuple[int, int]], block_size: int) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer before the forward."""
        if not pairs:
            return
        src = torch.cat([torch.arange(s * block_size, (s + 1) * block_size) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * block_size, (d + 1) * block_size) for _, d in pairs])
        self.kv_cache.copy_slots(src.to(self.device), dst.to(self.device))
