"""CUDA graphs of decode steps: one captured forward pass per batch-size bucket.

A decode step of a small model on a GPU is a few hundred short kernels; launched one by one from
Python, the launches, not the GPU, set the pace. A graph captured once per bucket (1, 2, 4, 8, then
every multiple of 8 up to max_num_seqs, vLLM's scheme) replays all of them with one call.

What a replay reads is fixed at capture: static input tensors (token ids, positions, the slots
this step writes, block tables and context lengths per KV layer group). Each step fills them
with one host-to-device copy per dtype from pinned buffers; rows past the step's batch are
padding that writes its K/V into a page of its own (`pad_block`, outside the block manager's
pool) and attends to that page alone. Attention's kernel reads the lengths from memory and has
a fixed grid (kernels/triton_attention.py), so one graph serves every context length.

The graph ends with the logits and their argmax: a greedy step copies back only the tokens.

Multi-step decoding (`num_scheduler_steps` K > 1, vLLM's multi-step scheduling): a second graph
per bucket runs K greedy steps back to back, each step's argmax the next step's token. The host
writes every step's positions, slots and lengths into the buffers up front (the scheduler
reserved the slots of all K positions), so a step inside the graph only reads views of them: no
index arithmetic between the layers' kernels. The host schedules, fills the buffers, syncs and
detokenizes once per K tokens instead of once per token, so its time leaves batch-1 decode's
critical path. A row reserved fewer steps (`steps`, near max_tokens) goes idle after them: it
writes into the padding page and its tokens are dropped.

On another device nothing is captured and `run` calls the same step on the same static
tensors eagerly: the tests hold that path to the engine's plain one on the CPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from kvserve.accel.cuda_gemv import graph_capture
from kvserve.model.attention import AttentionMetadata, DecodeBatch, KVCache
from kvserve.model.base import CausalLM

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_num_seqs (which is always a bucket)."""
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    buckets += list(range(8, max_num_seqs, 8))
    return buckets + [max_num_seqs]


@dataclass
class _Graph:
    size: int  # B, the bucket
    steps: int  # decode steps per replay: 1, or K for a multi-step graph
    graph: torch.cuda.CUDAGraph | None  # None off CUDA: the step runs eagerly
    # [1 + K * (1 + G), B] int64 on the device: token ids, then per step its positions and its
    # slots per group
    longs: torch.Tensor
    # [K * B + G * B * W] int32 on the device: each step's context lengths, then the block
    # tables [G, B, W]
    ints: torch.Tensor
    host_longs: torch.Tensor  # pinned mirrors of the two
    host_ints: torch.Tensor
    logits: torch.Tensor | None  # [B, vocab] outputs of the last replay (single-step graphs)
    tokens: torch.Tensor | None  # [B] int64, or [K, B] for a multi-step graph
    copied: torch.cuda.Event | None  # recorded after the copies out of the pinned buffers


class DecodeGraphs:
    """Captured decode steps of `model` over `kv_cache`, for batches of up to max_num_seqs."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, block_size: int, max_model_len: int,
                 max_num_seqs: int, pad_block: int, num_steps: int = 1):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.groups = kv_cache.num_groups
        self.width = -(-max_model_len // block_size)  # block table entries a sequence can use
        self.pad_block = pad_block
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.buckets = batch_buckets(max_num_seqs)
        self.num_steps = num_steps  # K: steps of a multi-step graph (1: none captured)
        self.graphs: dict[int, _Graph] = {}
        self.multi: dict[int, _Graph] = {}  # the K-step graphs, per bucket
        self.pool = None
        # arange(B) and B zeros (the first attended position without a window) per bucket, made
        # before its capture: no kernel in the graph for them
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        for b in reversed(self.buckets):
            self.graphs[b] = self._capture(b, 1)
            if self.num_steps > 1:
                self.multi[b] = self._capture(b, self.num_steps)
        if self.cuda:
            torch.cuda.synchronize()

    def applies(self, inputs: Seq) -> bool:
        """A plain decode step: one token and one logit row per sequence, few enough sequences."""
        return (0 < len(inputs) <= self.buckets[-1]
                and all(len(i.token_ids) == 1 and i.needs_logits and i.num_logits == 1 for i in inputs))

    def run(self, inputs: Seq) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step's bucket: (argmax tokens [n], logits [n, vocab]), views of the graph's
        outputs, valid until the next replay."""
        n = len(inputs)
        g = self.graphs[self._bucket(n)]
        self._fill(g, inputs)
        if g.graph is None:
            g.logits, g.tokens = self._step(g.longs, g.ints, g.size)
        else:
            self._replay(g)
        return g.tokens[:n], g.logits[:n]

    def run_steps(self, inputs: Seq, steps: Seq[int]) -> torch.Tensor:
        """K greedy decode steps of plain decode inputs in one replay, row i taking steps[i]
        (1..K, the longest K) of them, its slots for positions start_pos.. start_pos + steps[i] - 1
        already in its tables -> the argmax tokens [K, n], a view valid until the next replay
        (row i's first steps[i] are its tokens)."""
        n = len(inputs)
        if max(steps) != self.num_steps or min(steps) < 1:
            raise ValueError(f"a multi-step replay takes 1..{self.num_steps} steps a row, the longest "
                             f"{self.num_steps}; got {list(steps)}")
        g = self.multi[self._bucket(n)]
        self._fill(g, inputs, steps)
        if g.graph is None:
            g.tokens = self._steps(g.longs, g.ints, g.size, g.steps)
        else:
            self._replay(g)
        return g.tokens[:, :n]

    # ------------------------------------------------------------------ internals
    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @staticmethod
    def _replay(g: _Graph) -> None:
        g.longs.copy_(g.host_longs, non_blocking=True)
        g.ints.copy_(g.host_ints, non_blocking=True)
        g.copied.record()
        g.graph.replay()

    def _fill(self, g: _Graph, inputs: Seq, steps: Seq[int] | None = None) -> None:
        """Write the step into the pinned buffers: row i's token, and for each of the graph's
        steps its position, slots and context length, row i idle (its last position again, a
        padding-page slot) after its steps[i] (default 1). Table columns past a sequence's blocks
        keep stale values: no step reads past its reserved positions. (Scalar writes: at batch 1
        they cost a fifth of numpy's array ops, and this is on the step's critical path.)"""
        if g.copied is not None:
            g.copied.synchronize()  # the last step's copies have read the buffers
        longs, ints = g.host_longs.numpy(), g.host_ints.numpy()
        B, K, bs, G, W = g.size, g.steps, self.block_size, self.groups, self.width
        per_step = longs[1:].reshape(K, 1 + G, B)  # positions, then the slots of each group
        lens = ints[:K * B].reshape(K, B)
        tables = ints[K * B:].reshape(G, B, W)
        pad_slot = self.pad_block * bs
        for i, inp in enumerate(inputs):
            longs[0, i] = inp.token_ids[0]
            last = steps[i] - 1 if steps is not None else 0
            for grp, table in enumerate(inp.tables):
                used = min(len(table), W)
                tables[grp, i, :used] = table[:used]
            for k in range(K):
                pos = inp.start_pos + min(k, last)
                per_step[k, 0, i] = pos
                lens[k, i] = pos + 1
                blk, off = divmod(pos, bs)
                for grp, table in enumerate(inp.tables):
                    per_step[k, 1 + grp, i] = table[blk] * bs + off if k <= last else pad_slot
        n = len(inputs)
        if n < B:  # padding rows: their own page, a context of one position
            longs[0, n:] = 0
            per_step[:, 0, n:] = 0
            per_step[:, 1:, n:] = pad_slot
            lens[:, n:] = 1
            tables[:, n:, 0] = self.pad_block

    def _metadata(self, slots: Seq[torch.Tensor], lens: torch.Tensor, tables: torch.Tensor,
                  B: int) -> AttentionMetadata:
        """Attention metadata over static tensors: slots [B] per group, lens [B] int32, tables
        [G, B, W] (new objects: DecodeBatch caches tensors derived from the lengths, which must be
        computed inside the graph)."""
        if B not in self._rows:  # (the warm-up run before each capture makes them)
            self._rows[B] = (torch.arange(B, device=self.device),
                             torch.zeros(B, dtype=torch.int32, device=self.device))
        rows, zeros = self._rows[B]
        metas = [AttentionMetadata(slot_mapping=slots[grp], seqs=[],
                                   decode=DecodeBatch(rows=rows, block_tables=tables[grp], lens=lens,
                                                      block_size=self.block_size, max_len=None,
                                                      _starts={None: zeros}))
                 for grp in range(self.groups)]
        if self.groups == 1:
            return metas[0]
        first = metas[0]
        return AttentionMetadata(slot_mapping=first.slot_mapping, seqs=[], decode=first.decode, groups=metas)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(tokens, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden, upcast=False)

    def _step_inputs(self, longs: torch.Tensor, ints: torch.Tensor, B: int, i: int):
        """Step i's positions [B] and attention metadata, views of the static tensors."""
        G = self.groups
        K = (longs.shape[0] - 1) // (1 + G)
        per_step = longs[1:].view(K, 1 + G, B)[i]  # positions, then the slots of each group
        tables = ints[K * B:].view(G, B, self.width)
        return per_step[0], self._metadata(list(per_step[1:]), ints[i * B:(i + 1) * B], tables, B)

    def _step(self, longs: torch.Tensor, ints: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions, meta = self._step_inputs(longs, ints, B, 0)
        logits = self._forward(longs[0], positions, meta)
        return logits, logits.argmax(dim=-1)

    def _steps(self, longs: torch.Tensor, ints: torch.Tensor, B: int, K: int) -> torch.Tensor:
        """K greedy steps from the first step's tokens -> tokens [K, B], each step's argmax the
        next step's input."""
        token, out = longs[0], []
        for i in range(K):
            positions, meta = self._step_inputs(longs, ints, B, i)
            token = self._forward(token, positions, meta).argmax(dim=-1)
            out.append(token)
        return torch.stack(out)

    def _run(self, g: _Graph) -> None:
        """The graph's work on its static tensors, setting its outputs."""
        if g.steps == 1:
            g.logits, g.tokens = self._step(g.longs, g.ints, g.size)
        else:
            g.tokens = self._steps(g.longs, g.ints, g.size, g.steps)

    def _capture(self, B: int, K: int) -> _Graph:
        G, W = self.groups, self.width
        host_longs = torch.zeros(1 + K * (1 + G), B, dtype=torch.int64)
        host_ints = torch.zeros(K * B + G * B * W, dtype=torch.int32)
        if not self.cuda:  # the eager stand-in: the static tensors are the host buffers
            graph = _Graph(B, K, None, host_longs, host_ints, host_longs, host_ints, None, None, None)
            self._fill(graph, [])
            return graph
        host_longs, host_ints = host_longs.pin_memory(), host_ints.pin_memory()
        longs, ints = host_longs.to(self.device), host_ints.to(self.device)
        graph = _Graph(B, K, torch.cuda.CUDAGraph(), longs, ints, host_longs, host_ints, None, None,
                       torch.cuda.Event())
        self._fill(graph, [])  # every row padding
        longs.copy_(host_longs)
        ints.copy_(host_ints)
        with torch.inference_mode(), graph_capture():  # (graph_capture: the small-batch kernels chosen)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self._run(graph)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph.graph, pool=self.pool):
                self._run(graph)
        return graph
