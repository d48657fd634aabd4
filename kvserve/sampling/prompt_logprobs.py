"""Prompt logprobs (vLLM's `prompt_logprobs`, what `echo` with `logprobs` reports) from the final
hidden states of a prefill chunk.

A chunk of T rows would need [T, vocab] logits at once (2048 x 262144 fp32 is 2 GiB for Gemma
3), so they are computed ROWS_PER_BLOCK rows at a time, reduced to what the request asked for
(the prompt token's logprob and rank, the top-N alternatives) and dropped. Logprobs are those of
the raw logits, as for sampled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

ROWS_PER_BLOCK = 64  # 64 x 262144 fp32 logits = 64 MiB at a time


@dataclass
class RowLogprobs:
    """One position: the next prompt token's logprob and rank (1: the argmax), and the top-N."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def prompt_logprobs(hidden: torch.Tensor, targets: Sequence[int], num_top: int,
                    logits_fn: Callable[[torch.Tensor], torch.Tensor]) -> list[RowLogprobs]:
    """hidden [R, d] (row i predicts targets[i]) -> one RowLogprobs per row; `logits_fn` maps
    hidden rows to their logits (the model's LM head, soft-capping included)."""
    if hidden.shape[0] != len(targets):
        raise ValueError(f"{hidden.shape[0]} hidden rows for {len(targets)} target tokens")
    out: list[RowLogprobs] = []
    for start in range(0, len(targets), ROWS_PER_BLOCK):
        logits = logits_fn(hidden[start:start + ROWS_PER_BLOCK]).float()
        tgt = torch.tensor(targets[start:start + ROWS_PER_BLOCK], dtype=torch.long, device=logits.device)
        chosen = logits.gather(1, tgt.unsqueeze(1))
        lse = logits.logsumexp(dim=-1, keepdim=True)
        ranks = ((logits > chosen).sum(dim=-1) + 1).tolist()
        lps = (chosen - lse).squeeze(1).tolist()
        k = min(num_top, logits.shape[1])
        if k:
            vals, ids = logits.topk(k, dim=-1)
            top_lps, top_ids = (vals - lse).tolist(), ids.tolist()
        else:
            top_lps = top_ids = [[] for _ in lps]
        out.extend(RowLogprobs(lp, r, i, v) for lp, r, i, v in zip(lps, ranks, top_ids, top_lps))
    return out
