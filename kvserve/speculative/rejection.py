"""Lossless speculative sampling: verify draft tokens against the target model's logits.

The acceptance rule of Leviathan et al. / Chen et al.: draft token x drawn from q is kept with
probability min(1, p(x) / q(x)); at the first rejection one token is drawn from
normalize(max(0, p - q)) and the step stops; when every draft is kept, a bonus token is drawn
from the next target row. The emitted tokens are then distributed exactly as when sampling
from p alone. Greedy rows reduce to "keep drafts while they equal the argmax".

p is the target distribution after the same temperature / top-k / top-p / min-p processing the
normal sampler applies (`filter_logits`). Penalties (repetition, frequency, presence,
min_tokens) are not applied here: they depend on each row's prefix, so the caller applies them
to `target_logits` first if it wants them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.sampling.sampler import filtered_softmax, sample_from_probs
from kvserve.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each random row samples from.

    logits: [M, V], any float dtype; params: M random (temperature > 0) parameter sets.
    Returns [M, V] fp32: softmax(filter_logits(logits)), i.e. temperature, top-k, top-p and
    min-p exactly as the normal sampler applies them (`filtered_softmax`, through the sampler's
    C kernel on the CPU); filtered tokens get probability 0.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(
            f"logits must be [M, V] with M={len(params)} rows, got {tuple(logits.shape)}"
        )
    if any(p.greedy for p in params):
        raise ValueError("processed_probs is only defined for random rows (temperature > 0)")
    return filtered_softmax(logits, params)


def sample_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of probs [M, V] (non-negative, row sums > 0); returns [M] long.

    The normal sampler's inverse-CDF draw (`sample_from_probs`): rows need not be normalised,
    a seeded row draws from its own generator, a probability-0 token is never returned.
    """
    if probs.dim() != 2 or probs.shape[0] != len(generators):
        raise ValueError(
            f"probs must be [M, V] with M={len(generators)} rows, got {tuple(probs.shape)}"
        )
    return sample_from_probs(probs, generators)


@dataclass
class SpecVerifyResult:
    """Per sequence: the emitted tokens (accepted drafts, then one correction or bonus token)."""

    token_ids: list[list[int]]  # len(token_ids[i]) == num_accepted[i] + 1
    num_accepted: list[int]


def _validate(
    target_logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> None:
    """Raise ValueError on inconsistent shapes, lengths or out-of-vocabulary draft tokens."""
    n = len(draft_token_ids)
    for name, seq in (("draft_probs", draft_probs), ("params", params), ("generators", generators)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries, expected {n} (one per sequence)")
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [rows, V], got {tuple(target_logits.shape)}")
    rows, vocab = target_logits.shape
    expected = sum(len(d) + 1 for d in draft_token_ids)
    if rows != expected:
        raise ValueError(
            f"target_logits has {rows} rows, expected sum(k_i + 1) = {expected} "
            f"for draft lengths {[len(d) for d in draft_token_ids]}"
        )
    for i, (drafts, q) in enumerate(zip(draft_token_ids, draft_probs)):
        if any(not 0 <= t < vocab for t in drafts):
            raise ValueError(
                f"draft_token_ids[{i}] has a token outside [0, {vocab}): {list(drafts)}"
            )
        if q is not None and tuple(q.shape) != (len(drafts), vocab):
            raise ValueError(
                f"draft_probs[{i}] must be [k_i, V] = [{len(drafts)}, {vocab}], "
                f"got {tuple(q.shape)}"
            )


def _verify_greedy(
    target_logits: torch.Tensor,
    seqs: list[int],
    starts: list[int],
    draft_token_ids: Sequence[Sequence[int]],
    all_rows: bool,
) -> dict[int, list[int]]:
    """Greedy sequences: keep drafts while they equal the row argmax. -> {seq: emitted tokens}.

    target_logits: [rows, V]; all_rows: every row belongs to a greedy sequence (no gather copy).
    """
    if all_rows:
        argmax = target_logits.max(dim=-1).indices.tolist()  # first index on ties, as the sampler
        local = starts
    else:
        rows = [starts[i] + j for i in seqs for j in range(len(draft_token_ids[i]) + 1)]
        idx = torch.tensor(rows, device=target_logits.device)
        argmax = target_logits[idx].max(dim=-1).indices.tolist()
        local, pos = [0] * len(starts), 0
        for i in seqs:
            local[i], pos = pos, pos + len(draft_token_ids[i]) + 1
    return {i: accept_greedy(draft_token_ids[i], argmax[local[i] : local[i] + len(draft_token_ids[i]) + 1])
            for i in seqs}


def accept_greedy(draft: Sequence[int], best: Sequence[int]) -> list[int]:
    """A greedy sequence's verification from the target's argmax rows: draft [k] tokens, best
    [k + 1] (row j: the argmax given drafts 0..j-1) -> the drafts kept while they equal the
    argmax, then the argmax at the first mismatch (or the bonus after all k)."""
    emitted: list[int] = []
    for token, top in zip(draft, best):
        if token != top:
            break
        emitted.append(token)
    emitted.append(best[len(emitted)])
    return emitted


def _verify_random(
    target_logits: torch.Tensor,
    seqs: list[int],
    starts: list[int],
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    all_rows: bool,
) -> dict[int, list[int]]:
    """Random sequences: the min(1, p/q) acceptance rule. -> {seq: emitted tokens}.

    target_logits: [rows, V]. Only the rows of `seqs` are turned into probabilities (P [R, V]
    fp32); then one [len(seqs), V] copy holds the rows the final token is drawn from.
    """
    device = target_logits.device
    ks = [len(draft_token_ids[i]) for i in seqs]
    local, pos = [], 0  # first row of each sequence inside P
    for k in ks:
        local.append(pos)
        pos += k + 1
    row_params = [params[i] for i, k in zip(seqs, ks) for _ in range(k + 1)]
    if all_rows:
        logits = target_logits
    else:
        rows = [starts[i] + j for i, k in zip(seqs, ks) for j in range(k + 1)]
        logits = target_logits[torch.tensor(rows, device=device)]
    p = processed_probs(logits, row_params)  # [R, V]
    del logits

    # Acceptance test for every draft token at once: accept x iff u * q(x) < p(x) (u ~ U[0, 1)).
    draft_rows = [off + j for off, k in zip(local, ks) for j in range(k)]
    draft_toks = [t for i in seqs for t in draft_token_ids[i]]
    accepted = [0] * len(seqs)
    if draft_rows:
        d_rows = torch.tensor(draft_rows, device=device)
        d_toks = torch.tensor(draft_toks, device=device)
        p_x = p[d_rows, d_toks].double()  # [D]
        q_x = torch.ones_like(p_x)  # one-hot draft (n-gram): q(x) = 1
        u = torch.empty_like(p_x)
        steps = torch.arange(max(ks), device=device)
        unseeded, at = [], 0
        for i, k in zip(seqs, ks):
            q = draft_probs[i]
            if k and q is not None:  # q(x_j) = q[j, x_j]; the copy casts to float64
                q_x[at : at + k] = q.to(device)[steps[:k], d_toks[at : at + k]]
            gen = generators[i]
            if k and gen is not None:
                u[at : at + k] = torch.rand(k, dtype=torch.float64, device=device, generator=gen)
            elif k:
                unseeded.extend(range(at, at + k))
            at += k
        if unseeded:
            u[torch.tensor(unseeded, device=device)] = torch.rand(
                len(unseeded), dtype=torch.float64, device=device
            )
        # p >= q accepts surely even if u * q rounds up to q; q == 0 always rejects.
        ok = ((q_x > 0) & ((p_x >= q_x) | (u * q_x < p_x))).tolist()
        at = 0
        for s, k in enumerate(ks):
            n = 0
            while n < k and ok[at + n]:
                n += 1
            accepted[s] = n
            at += k

    # The row each sequence draws its last token from: residual max(0, p - q) after a
    # rejection, the bonus row p otherwise.
    final_idx = torch.tensor([off + n for off, n in zip(local, accepted)], device=device)
    final = p[final_idx]  # [S, V] copy
    onehot_rows, onehot_toks, dense_rows, dense_q = [], [], [], []
    for s, (i, k, n) in enumerate(zip(seqs, ks, accepted)):
        if n == k:
            continue
        q = draft_probs[i]
        if q is None:
            onehot_rows.append(s)
            onehot_toks.append(draft_token_ids[i][n])
        else:
            dense_rows.append(s)
            dense_q.append(q[n].to(device=device, dtype=final.dtype))
    if onehot_rows:
        rows_t = torch.tensor(onehot_rows, device=device)
        final[rows_t, torch.tensor(onehot_toks, device=device)] = 0.0  # q is a point mass
    if dense_rows:
        idx = torch.tensor(dense_rows, device=device)
        final[idx] = (final[idx] - torch.stack(dense_q)).clamp_(min=0.0)
    empty = final.sum(dim=-1) <= 0  # p == q up to rounding: the residual has no mass
    if bool(empty.any()):
        final[empty] = p[final_idx[empty]]
    del p
    last = sample_probs(final, [generators[i] for i in seqs]).tolist()

    out: dict[int, list[int]] = {}
    for s, i in enumerate(seqs):
        out[i] = list(draft_token_ids[i][: accepted[s]]) + [last[s]]
    return out


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> SpecVerifyResult:
    """Verify the drafts of a batch of sequences against the target model.

    target_logits: [sum_i (k_i + 1), V], any float dtype. Sequence i owns k_i + 1 consecutive
        rows; its row j is the target's next-token distribution at draft j's position, i.e.
        given drafts 0..j-1 (row 0: after the last known token; row k_i: the bonus row).
    draft_token_ids: per sequence the k_i >= 0 proposed tokens.
    draft_probs: per sequence [k_i, V] fp32 probabilities the draft sampled from (processed
        with the same params), or None for a deterministic proposer (q one-hot on the draft).
        Ignored for greedy sequences.
    params / generators: per sequence; a None generator uses the global torch RNG.

    A seeded random sequence draws k_i uniforms then one more for its last token from its
    own generator, so its result does not depend on the rest of the batch.
    """
    _validate(target_logits, draft_token_ids, draft_probs, params, generators)
    starts, pos = [], 0
    for drafts in draft_token_ids:
        starts.append(pos)
        pos += len(drafts) + 1
    greedy = [i for i, p in enumerate(params) if p.greedy]
    rand = [i for i, p in enumerate(params) if not p.greedy]
    emitted: dict[int, list[int]] = {}
    if greedy:
        emitted.update(_verify_greedy(target_logits, greedy, starts, draft_token_ids, not rand))
    if rand:
        emitted.update(
            _verify_random(
                target_logits, rand, starts, draft_token_ids, draft_probs, params, generators,
                not greedy,
            )
        )
    tokens = [emitted[i] for i in range(len(params))]
    return SpecVerifyResult(token_ids=tokens, num_accepted=[len(t) - 1 for t in tokens])
