"""A draft's vocabulary cut to the tokens that matter: the head of a draft model scores only the
N most frequent tokens of a corpus (frequency-ranked drafting, FR-Spec, Zhao et al. 2025).

Why: with a large vocabulary the LM head dominates a small model's decode step (Gemma 3 270M:
262144 x 640, 168M of its 268M parameters), so a draft that keeps the whole head costs nearly a
target step. The 13404 distinct tokens of WikiText-2's validation text are 88.8% of its test
text's tokens, and the head over them is 20x smaller.

Lossless: the draft proposes from its subset only (q = 0 elsewhere); the target verifies every
draft as before, so a token outside the subset is simply never drafted, and the output is the
target's.

The file (`kvserve draft-vocab` writes it) is JSON: {"vocab_size": V, "token_ids": [...]}, the
ids most frequent first; `draft_vocab_size` keeps its first N.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn


def read_draft_vocab(path: str | Path, vocab_size: int, size: int | None = None) -> torch.Tensor:
    """The draft vocabulary file's first `size` token ids (all of them when None) -> [N] int64,
    checked against the model's vocabulary (ValueError naming the file otherwise)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"draft_vocab: {path} not found (write one with `kvserve draft-vocab`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"draft_vocab: {path} is not a draft vocabulary JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("token_ids"), list):
        raise ValueError(f"draft_vocab: {path} has no \"token_ids\" list")
    ids = data["token_ids"]
    if data.get("vocab_size") != vocab_size:
        raise ValueError(f"draft_vocab: {path} was made for a vocabulary of {data.get('vocab_size')!r} tokens; "
                         f"the model has {vocab_size}")
    if not ids or any(type(t) is not int or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"draft_vocab: {path}: token_ids must be a non-empty list of ids in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"draft_vocab: {path}: token_ids repeats an id")
    if size is not None:
        if not 1 <= size <= len(ids):
            raise ValueError(f"draft_vocab_size must be in [1, {len(ids)}] (the ids in {path}), got {size}")
        ids = ids[:size]
    return torch.tensor(ids, dtype=torch.long)


def rank_tokens(token_streams: Iterable[Iterable[int]], size: int, vocab_size: int,
                always: Iterable[int] = ()) -> list[int]:
    """The `size` most frequent ids of the streams (ties: the lower id first), after the `always`
    ids (a model's end-of-sequence tokens: a draft can then propose the end)."""
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    counts: Counter[int] = Counter()
    for stream in token_streams:
        counts.update(stream)
    first = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))
    seen = set(first)
    rest = sorted((t for t in counts if 0 <= t < vocab_size and t not in seen), key=lambda t: (-counts[t], t))
    return (first + rest)[:size]


def write_draft_vocab(path: str | Path, token_ids: list[int], vocab_size: int, source: str) -> None:
    """The file `read_draft_vocab` reads; `source` says what the ranking was counted on."""
    Path(path).write_text(json.dumps({"vocab_size": vocab_size, "source": source, "token_ids": token_ids}))


def head_rows(model: nn.Module, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's rows for token_ids [N] as a dense float matrix [N, hidden] (and the bias
    [N] or None): the embedding's rows for a tied head, dequantized for a low-bit one."""
    head = model.lm_head
    source = model.embed_tokens if head is None else head
    if hasattr(source, "dequantized_rows"):  # low-bit or GGUF-block storage
        weight = source.dequantized_rows(token_ids)
    elif isinstance(getattr(source, "weight", None), torch.Tensor):
        weight = source.weight.index_select(0, token_ids.to(source.weight.device))
    else:
        raise ValueError(f"draft_vocab: the draft's head ({type(source).__name__}) has no rows to take a subset of")
    bias = getattr(head, "bias", None)
    return weight, None if bias is None else bias.index_select(0, token_ids.to(bias.device))


class DraftVocabHead(nn.Module):
    """A draft's LM head over a subset of the vocabulary: hidden [B, hidden] -> logits [B, V] in
    the weight's dtype, -inf outside the subset (so the draft's argmax and its sampled q never
    leave it, and the rest of the drafter is unchanged)."""

    def __init__(self, model: nn.Module, token_ids: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        weight, bias = head_rows(model, token_ids)
        device = weight.device
        # [hidden, N] contiguous: MKL's fp32 GEMV reads a column-major head fastest.
        self.weight_t = weight.to(dtype).t().contiguous()
        self.bias = None if bias is None else bias.to(dtype)
        self.token_ids = token_ids.to(device)
        self.vocab_size = model.config.vocab_size
        self.softcap = model.config.final_logit_softcapping

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = hidden.to(self.weight_t.dtype) @ self.weight_t  # [B, N]
        if self.bias is not None:
            sub = sub + self.bias
        if self.softcap:
            sub = torch.tanh(sub / self.softcap) * self.softcap
        logits = sub.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.token_ids] = sub
        return logits
