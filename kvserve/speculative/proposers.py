"""Draft-token proposers for speculative decoding, called by the engine once per step.

The scheduler has already reserved `k` slots after each decode sequence's last token (its
blocks cover positions up to num_tokens - 1 + k); a proposer fills up to k of them:

* `NgramDrafter`: prompt lookup, no model (q is a point mass on the drafted token).
* `ModelDrafter`: a model runs k single-token steps. Either a separate draft model with its own
  KV pool addressed through the SAME block tables (so blocks, prefix hits and copy-on-write
  cover both caches; a self draft, the target's own layers, also has the target's KV layer
  groups and tables), or the target itself exiting after its first L layers, whose K/V are
  exactly the target's own for those layers (no second cache; the verification pass rewrites
  the draft positions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol
from typing import Sequence as Seq

import torch

from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.sampling import SamplingRequest
from kvserve.sampling.sampler import apply_penalties
from kvserve.sequence import Sequence
from kvserve.speculative.draft_vocab import DraftVocabHead
from kvserve.speculative.ngram import NgramProposer
from kvserve.speculative.rejection import processed_probs, sample_probs


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V] fp32 draft distribution; None = point mass
    # Under a grammar: [len(token_ids) + 1, ceil(V / 32)] int32, the tokens allowed at each
    # verified position (`GrammarState.draft_masks`); None = every token.
    allowed: torch.Tensor | None = None

    def truncate(self, n: int) -> None:
        """Keep the first n draft tokens (their probabilities and the masks of their n + 1 rows)."""
        del self.token_ids[n:]
        if self.probs is not None:
            self.probs = self.probs[:n]
        if self.allowed is not None:
            self.allowed = self.allowed[:n + 1]


class Drafter(Protocol):
    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Draft]:
        """Up to ks[i] draft tokens for each decode sequence seqs[i]."""


class NgramDrafter:
    def __init__(self, k: int, min_n: int, max_n: int):
        self.proposer = NgramProposer(k, min_n=min_n, max_n=max_n)

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Draft]:
        return [Draft(self.proposer.propose(s.all_token_ids, k) if k else []) for s, k in zip(seqs, ks)]


class ModelDrafter:
    """Autoregressive drafts from a (cheaper) model.

    `separate_cache`: the runner's model has its own KV pool, which may lag the target's: the
    first draft step feeds every token from `seq.num_draft_computed` on (catch-up: the prompt on
    a sequence's first decode, the tokens accepted last step), so its K/V end up complete.
    Otherwise (early exit) the target computed everything before the last token.
    """

    def __init__(self, runner: ModelRunner, num_layers: int | None = None, separate_cache: bool = False,
                 eos_token_ids: Seq[int] = (), head: DraftVocabHead | None = None):
        self.runner = runner
        self.num_layers = num_layers
        self.separate_cache = separate_cache
        self.eos_token_ids = list(eos_token_ids)  # the ends min_tokens bans
        self.head = head  # a head over a subset of the vocabulary (None: the model's own)

    def _logits(self, inputs: list[StepInput]) -> torch.Tensor:
        """The draft's logits [rows, V] for one step."""
        if self.head is None:
            return self.runner.execute(inputs, num_layers=self.num_layers)
        return self.head(self.runner.execute_final_hidden(inputs, num_layers=self.num_layers))

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        for step in range(max(ks, default=0)):
            active = [i for i in active if ks[i] > step]
            if not active:
                break
            inputs = [self._input(seqs[i], drafts[i].token_ids, step) for i in active]
            logits = self._logits(inputs)
            tokens, rows = self._pick(logits, [seqs[i] for i in active], [drafts[i].token_ids for i in active])
            for j, i in enumerate(active):
                drafts[i].token_ids.append(tokens[j])
                if rows is not None and rows[j] is not None:
                    probs[i].append(rows[j])
        for i, s in enumerate(seqs):
            if probs[i]:
                drafts[i].probs = torch.stack(probs[i])
            if self.separate_cache and drafts[i].token_ids:
                # K/V now cover the context and every draft token but the last (never fed).
                s.num_draft_computed = s.num_tokens + len(drafts[i].token_ids) - 1
        return drafts

    def _input(self, seq: Sequence, drafted: list[int], step: int) -> StepInput:
        last = seq.num_tokens - 1  # position of the last known token
        if step > 0:  # feed the previous draft token
            return StepInput([drafted[-1]], last + step, seq.block_table, group_tables=seq.group_block_tables)
        start = min(seq.num_draft_computed, last) if self.separate_cache else last
        return StepInput(seq.token_slice(start, last + 1), start, seq.block_table, group_tables=seq.group_block_tables)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]]
              ) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """Draft tokens for logits [B, V], after the bias, min_tokens and penalties the target
        applies at that position (the drafts so far count as output), so that a draft with the
        target's weights proposes the target's tokens: argmax for greedy rows, a sample from the
        processed distribution (kept as q for the acceptance test) for random rows."""
        logits = apply_penalties(logits, [SamplingRequest(s.params, s.prompt_token_ids, s.output_token_ids + d)
                                          for s, d in zip(seqs, drafted)], self.eos_token_ids)
        tokens = logits.max(dim=-1).indices
        random_rows = [j for j, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return tokens.tolist(), None
        idx = torch.tensor(random_rows, device=logits.device)
        q = processed_probs(logits[idx], [seqs[j].params for j in random_rows])
        tokens[idx] = sample_probs(q, [seqs[j].generator for j in random_rows])
        rows: list[torch.Tensor | None] = [None] * len(seqs)
        for n, j in enumerate(random_rows):
            rows[j] = q[n]
        return tokens.tolist(), rows
