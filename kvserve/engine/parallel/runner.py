"""The tensor-parallel step: rank 0 (the engine's runner) broadcasts each step's inputs, every
rank runs the same ModelRunner forward at its local shapes (joining the all-reduces inside the
model), and rank 0 gathers the logits, or for greedy steps each rank's (max, argmax) of its
vocabulary rows. The scheduler, block manager and sampler stay on rank 0 alone.

Any failure inside a step ends the group: once a rank raised mid-step the ranks may wait in
different collectives, so the error is a TensorParallelError and the workers are stopped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.engine.parallel.group import ParallelGroup, TensorParallelError
from kvserve.model.attention import KVCache
from kvserve.model.base import CausalLM

log = logging.getLogger(__name__)


@dataclass
class StepMessage:
    """What rank 0 broadcasts per step: the block copies (copy-on-write) to make first, the
    runner's inputs, and whether only each row's argmax is wanted."""

    copies: list[tuple[int, int]]
    inputs: list[StepInput]
    greedy: bool


class TensorParallelRunner(ModelRunner):
    """A ModelRunner over one rank's shard. On rank 0 `execute` / `execute_greedy` drive the
    workers; a worker calls `run_step` with what rank 0 sent."""

    use_decode_plan = False  # the C plan has no all-reduce between its layers
    has_greedy_screen = False  # greedy rows under grammars take the gathered logits (each rank holds a vocabulary shard)

    def __init__(self, group: ParallelGroup, model: CausalLM, kv_cache: KVCache, block_size: int,
                 device: torch.device | str = "cpu"):
        super().__init__(model, kv_cache, block_size, device)
        self.group = group
        self._copies: list[tuple[int, int]] = []

    def copy_blocks(self, pairs: Seq[tuple[int, int]], block_size: int) -> None:
        """Rank 0: kept for the next step's message, so every rank copies before that forward."""
        self._copies = list(pairs)

    def execute(self, inputs: Seq[StepInput], num_layers: int | None = None) -> torch.Tensor:
        if num_layers is not None:
            raise ValueError("an early exit (num_layers) is not supported under tensor parallelism")
        return self._drive(inputs, greedy=False)

    def execute_greedy(self, inputs: Seq[StepInput]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        out = self._drive(inputs, greedy=True)
        return (out, None) if out.dtype == torch.int64 else (None, out)

    def _drive(self, inputs: Seq[StepInput], greedy: bool) -> torch.Tensor:
        msg = StepMessage(self._copies, list(inputs), greedy)
        self._copies = []
        self.group.check()
        try:
            self.group.send_object(("step", msg))
            return self.run_step(msg)
        except TensorParallelError:
            self.group.abort()
            raise
        except Exception as exc:  # the ranks may now wait in different collectives
            log.exception("tensor-parallel rank 0 failed inside a step")
            self.group.failure = f"tensor-parallel rank 0 failed inside a step: {type(exc).__name__}: {exc}"
            self.group.abort()
            raise TensorParallelError(self.group.failure) from exc

    @torch.inference_mode()
    def run_step(self, msg: StepMessage) -> torch.Tensor | None:
        """One step on this rank: on rank 0 the logits [rows, vocab] (model dtype), or for a greedy
        step the tokens [rows] int64; None on the other ranks."""
        ModelRunner.copy_blocks(self, msg.copies, self.block_size)
        hidden = self._forward(msg.inputs, None)
        vocab = self.model.config.vocab_size
        if hidden.shape[0] == 0:  # (every rank sees the same inputs, so every rank stops here)
            return hidden.new_empty((0, vocab), dtype=torch.float32)
        local = self.model.compute_logits(hidden, upcast=False)
        return self._argmax(local) if msg.greedy else self._logits(local, vocab)

    def _logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        parts = self.group.gather(local.contiguous())
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab]

    def _argmax(self, local: torch.Tensor) -> torch.Tensor | None:
        """Each row's first maximum over the whole vocabulary (torch.argmax's rule): the ranks'
        own maxima and their ids, and of those the first rank's among equal values."""
        emb = self.model.embed_tokens
        best = local[:, :emb.valid].max(dim=-1)
        pair = torch.stack([best.values.double(), (best.indices + emb.start).double()], dim=1)
        parts = self.group.gather(pair)
        if parts is None:
            return None
        both = torch.stack(parts)  # [ranks, rows, 2]
        rank = both[:, :, 0].argmax(dim=0)  # the first (lowest-id) rank among equal maxima
        return both[rank, torch.arange(both.shape[1], device=both.device), 1].long()
