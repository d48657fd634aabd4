"""Batched token sampling: penalties, greedy/random selection, logprobs (vLLM semantics).

Processing order per row (as vLLM): logit_bias -> min_tokens masking -> repetition penalty ->
frequency/presence penalties -> the grammar's token mask (structured outputs) -> greedy argmax,
or temperature -> top-k -> top-p -> min-p -> sample. Logprobs are always computed from the raw
logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve import kernels
from kvserve.sampling.structured import GrammarState, apply_masks
from kvserve.sampling_params import SamplingParams


@dataclass
class SamplingRequest:
    """One row of the logits batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Per-sequence RNG for seeded requests; None -> the global torch RNG.
    generator: torch.Generator | None = None
    # Structured outputs: the sequence's grammar, whose mask the row is sampled under.
    grammar: GrammarState | None = None


@dataclass
class ScreenedRows:
    """A step whose rows draw from their few largest logits (`Sampler.screened_top_k`): per row,
    its top-k (1: greedy) and the tokens its penalties or logit biases change."""

    top_k: list[int]
    touched: list[list[int]]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float | None]  # log-softmax of the raw logits at the chosen token
    top_logprobs: list[dict[int, float] | None]  # top-`params.logprobs` raw logprobs, None if not asked


def _needs_min_tokens_mask(req: SamplingRequest) -> bool:
    return len(req.output_token_ids) < req.params.min_tokens


def _needs_penalties(req: SamplingRequest) -> bool:
    """The row's logits change before selection (so no greedy path may skip them)."""
    p = req.params
    return (
        p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or bool(p.logit_bias)
        or _needs_min_tokens_mask(req)
    )


def penalizes(p: SamplingParams) -> bool:
    """Repetition / presence / frequency penalties: every position's logits depend on the tokens
    before it (so a speculative verification pass could not score drafts in one go)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _argmax_row(req: SamplingRequest) -> bool:
    """Greedy without logprobs or penalties: the argmax of the raw logits, under the row's
    grammar mask where it has one."""
    return req.params.greedy and req.params.logprobs is None and not _needs_penalties(req)


def _plain_greedy(req: SamplingRequest) -> bool:
    return req.grammar is None and _argmax_row(req)


def _penalize_row(row: torch.Tensor, req: SamplingRequest, eos_token_ids: Sequence[int]) -> None:
    """Apply logit_bias, min_tokens masking and penalties to one row in place. row: [V]."""
    p = req.params
    vocab = row.shape[0]
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device))
    if _needs_min_tokens_mask(req):
        # eos is masked even with ignore_eos: min_tokens promises that many real tokens.
        banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = list(req.prompt_token_ids) + list(req.output_token_ids)
        if seen:
            ids = torch.tensor(seen, dtype=torch.long, device=row.device).unique()
            vals = row[ids]
            # HF/vLLM: make seen tokens less likely whatever the sign of their logit.
            row[ids] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and req.output_token_ids:
        out = torch.tensor(list(req.output_token_ids), dtype=torch.long, device=row.device)
        ids, counts = out.unique(return_counts=True)
        # OpenAI: only generated tokens count, not the prompt.
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def touched_tokens(req: SamplingRequest, eos_token_ids: Sequence[int], vocab: int) -> list[int]:
    """The tokens whose logits `_penalize_row` may change in the row (sorted, in [0, vocab)): the
    logit_bias keys, the banned ends under min_tokens, the seen tokens of the penalties."""
    p = req.params
    ids: set[int] = set(p.logit_bias or ())
    if _needs_min_tokens_mask(req):
        ids.update(eos_token_ids)
        ids.update(p.stop_token_ids)
    if p.repetition_penalty != 1.0:
        ids.update(req.prompt_token_ids)
        ids.update(req.output_token_ids)
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        ids.update(req.output_token_ids)
    return sorted(t for t in ids if 0 <= t < vocab)


def apply_penalties(
    logits: torch.Tensor, requests: Sequence[SamplingRequest], eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Return logits [N, V] after logit_bias, min_tokens masking and penalties.

    Returns the input tensor itself (no copy) when no row needs any of them.
    """
    rows = [i for i, req in enumerate(requests) if _needs_penalties(req)]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        _penalize_row(out[i], requests[i], eos_token_ids)
    return out


def _col(values: list[float], ref: torch.Tensor) -> torch.Tensor:
    """A [M, 1] column tensor on ref's device and dtype."""
    return torch.tensor(values, dtype=ref.dtype, device=ref.device).unsqueeze(1)


def _apply_top_k(x: torch.Tensor, top_k: list[int]) -> None:
    """Keep, per row, the tokens >= the k-th largest value (ties kept). x: [M, V], in place."""
    vocab = x.shape[1]
    rows = [i for i, k in enumerate(top_k) if 0 < k < vocab]
    if not rows:
        return
    idx = torch.tensor(rows, device=x.device)
    sub = x[idx]
    ks = torch.tensor([top_k[i] for i in rows], device=x.device)
    # topk of the largest k only: no full sort of the vocabulary.
    top_vals = sub.topk(int(ks.max()), dim=-1).values
    kth = top_vals.gather(1, (ks - 1).unsqueeze(1))
    x[idx] = sub.masked_fill(sub < kth, float("-inf"))


# Top-p first looks at this many best tokens; real LM distributions almost always reach p
# inside them, which avoids sorting the whole vocabulary (~20 ms for 262144 entries on CPU).
TOP_P_CANDIDATES = 1024


def _top_p_rows(sub: torch.Tensor, p: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over the m best tokens of each row. sub: [R, V], p: [R, 1].

    Returns (filtered rows [R, V], covered [R] bool); a row is exact only where covered,
    i.e. where its m best tokens already hold mass >= p.
    """
    vals, order = (torch.sort(sub, dim=-1, descending=True) if m == sub.shape[1] else sub.topk(m, dim=-1))
    probs = (vals - sub.logsumexp(dim=-1, keepdim=True)).exp()
    cum = probs.cumsum(dim=-1)
    # Drop a token once the strictly more likely ones reach p; the best token has 0 < p.
    drop = (cum - probs) >= p
    out = torch.full_like(sub, float("-inf"))
    out.scatter_(1, order, vals.masked_fill(drop, float("-inf")))
    return out, cum[:, -1] >= p.squeeze(1)


def _apply_top_p(x: torch.Tensor, top_p: list[float]) -> None:
    """Keep the smallest set of most likely tokens whose mass reaches p. x: [M, V], in place."""
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return
    vocab = x.shape[1]
    idx = torch.tensor(rows, device=x.device)
    p = _col([top_p[i] for i in rows], x)
    sub = x[idx]
    out, covered = _top_p_rows(sub, p, min(TOP_P_CANDIDATES, vocab))
    if not bool(covered.all()):
        rest = (~covered).nonzero().squeeze(1)  # flat distributions: sort the whole row
        out[rest] = _top_p_rows(sub[rest], p[rest], vocab)[0]
    x[idx] = out


def _apply_min_p(x: torch.Tensor, min_p: list[float]) -> None:
    """Drop tokens with prob < min_p * max prob. x: [M, V], in place."""
    rows = [i for i, p in enumerate(min_p) if p > 0.0]
    if not rows:
        return
    idx = torch.tensor(rows, device=x.device)
    sub = x[idx]
    probs = sub.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * _col([min_p[i] for i in rows], probs)
    x[idx] = sub.masked_fill(probs < threshold, float("-inf"))


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for random rows. logits: [M, V] -> new [M, V].

    Filtered-out tokens are -inf; the result is what the row samples from via softmax.
    """
    x = logits / _col([p.temperature for p in params], logits)
    _apply_top_k(x, [p.top_k for p in params])
    _apply_top_p(x, [p.top_p for p in params])
    _apply_min_p(x, [p.min_p for p in params])
    return x


def _sample_from(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of softmax(x) [M, V] with the uniform numbers u [M]; [M] long."""
    return inverse_cdf(x.softmax(dim=-1), u)


def uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per row, float64 [M]: each seeded row from its own generator
    (so its token does not depend on the other rows), the others from the global RNG."""
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            u[i] = torch.rand((), dtype=torch.float64, device=device, generator=gen)
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of probs [M, V] (non-negative, row sums > 0, not necessarily
    normalised: the draw is scaled by each row's total) at the uniform number u [M]: the first
    whose float64 cumulative sum exceeds u * total. One random draw instead of V exponentials
    (~20x cheaper at V=262144)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    # right=True: the first index whose cdf exceeds the target, so a p=0 token is never hit.
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    overflow = tokens >= probs.shape[1]  # u * total rounded up to the total
    if bool(overflow.any()):
        last_kept = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
        tokens = torch.where(overflow, last_kept, tokens)
    return tokens


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of probs [M, V] (see `inverse_cdf`), one uniform draw per row
    (`uniforms`); returns [M] long."""
    return inverse_cdf(probs, uniforms(generators, probs.device))


def _kernel_settings(params: Sequence[SamplingParams], vocab: int) -> tuple[list, list, list, list]:
    """Per row: temperature, top-k (0: off), top-p, min-p, as kernels/sampling.c takes them."""
    return ([p.temperature for p in params], [p.top_k if 0 < p.top_k < vocab else 0 for p in params],
            [p.top_p for p in params], [p.min_p for p in params])


def filtered_softmax(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """softmax(filter_logits(logits, params)): the distribution each random row samples from,
    logits [M, V] any float dtype -> [M, V] fp32. On the CPU through kvserve's C kernel (no
    sort of the vocabulary), a row it leaves (a NaN) and every row elsewhere the torch way."""
    x = logits.float()
    got = kernels.filtered_probs(x, list(range(x.shape[0])), *_kernel_settings(params, x.shape[1]))
    if got is None:
        return filter_logits(x, params).softmax(dim=-1)
    probs, failed = got
    if bool(failed.any()):
        left = failed.nonzero().flatten()
        probs[left] = filter_logits(x[left], [params[i] for i in left.tolist()]).softmax(dim=-1)
    return probs


def sample_rows(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """A random token for each row `rows[j]` of logits [N, V] under params[j] (temperature,
    top-k, top-p, min-p) -> [len(rows)] long. fp32 rows on the CPU take kvserve's C kernel,
    which draws the token of the torch path (`filter_logits`, then `inverse_cdf`) for the same
    uniform number without the [M, V] temporaries or a sort; the rest, and any row the kernel
    leaves (a NaN), take the torch path."""
    u = uniforms(generators, logits.device)
    tokens = kernels.sample_rows(logits, rows, *_kernel_settings(params, logits.shape[1]), u)
    if tokens is None:  # (every row of the batch: no gather copy)
        x = logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows, device=logits.device)]
        return _sample_from(filter_logits(x, params), u)
    left = (tokens < 0).nonzero().flatten().tolist()
    if left:
        x = logits[torch.tensor([rows[j] for j in left])]
        tokens[left] = _sample_from(filter_logits(x, [params[j] for j in left]), u[left])
    return tokens


def _grammar_masked(raw: torch.Tensor, processed: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """`processed` with each constrained row's grammar mask applied, in place: the step's logits
    rows are read again only for logprobs, so they are copied first only when a constrained row
    asks for logprobs (which come from the raw logits). A row left with no token at all
    (min_tokens banning the EOS that a complete grammar allows alone) takes the grammar's mask
    over its raw logits: the grammar wins."""
    if processed is raw and any(r.grammar is not None and r.params.logprobs is not None for r in requests):
        processed = raw.clone()
    states = [r.grammar for r in requests]
    apply_masks(processed, states)
    banned = [i for i, r in enumerate(requests) if r.grammar is not None and _needs_min_tokens_mask(r)]
    if banned:  # only min_tokens can empty a row, and it made `processed` a copy of `raw`
        idx = torch.tensor(banned, device=raw.device)
        dead = idx[processed[idx].amax(dim=1) == float("-inf")]
        if dead.numel():
            fresh = raw[dead].clone()
            apply_masks(fresh, [states[i] for i in dead.tolist()])
            processed[dead] = fresh
    return processed


class Sampler:
    """Picks the next token for every row of a logits batch."""

    def __init__(self, eos_token_ids: Sequence[int]):
        self.eos_token_ids = list(eos_token_ids)

    @staticmethod
    def greedy_only(requests: list[SamplingRequest]) -> bool:
        """Every request takes the argmax of its raw logits and reports no logprobs: the engine
        may pick the tokens without the logits (kvserve/accel/greedy_head.py)."""
        return all(_plain_greedy(r) for r in requests)

    @staticmethod
    def argmax_rows(requests: list[SamplingRequest]) -> bool:
        """Every request takes the argmax of its raw logits (under its grammar's mask where it has
        one) and reports no logprobs: the engine may pick the tokens through the greedy screen
        with the masks (`token_bitmask`), without the logits."""
        return all(_argmax_row(r) for r in requests)

    @staticmethod
    def screen_ks(requests: list[SamplingRequest], vocab_size: int, max_k: int) -> list[int] | None:
        """Each row's k where `screened_top_k` may serve the rows, its touched tokens not yet
        counted; else None."""
        ks = []
        for r in requests:
            if r.grammar is not None or r.params.logprobs is not None:
                return None
            k = 1 if r.params.greedy else r.params.top_k
            if not 0 < k <= min(max_k, vocab_size - 1):
                return None
            ks.append(k)
        return None if all(_plain_greedy(r) for r in requests) else ks

    def screened_top_k(self, requests: list[SamplingRequest], vocab_size: int, max_k: int, max_touched: int
                       ) -> ScreenedRows | None:
        """Where every row draws from its few largest logits alone: greedy rows (k = 1) and random
        rows under top-k <= max_k, none with a grammar or logprobs (which read other logits), at
        least one of them random or with penalties (plain greedy steps have the greedy screen):
        each row's k and its touched tokens, at most max_touched in all (each costs an exact
        logit), so that the engine may compute only those logits (kvserve/accel/greedy_head.py);
        else None."""
        ks = self.screen_ks(requests, vocab_size, max_k)  # the cheap checks first: most steps fail here
        if ks is None:
            return None
        touched: list[list[int]] = []
        budget = max_touched
        for r in requests:
            row: list[int] = []
            if _needs_penalties(r):
                # (a bound first: the distinct tokens of a long prompt or output are not counted)
                p = r.params
                seen = (len(r.prompt_token_ids) if p.repetition_penalty != 1.0 else 0) + \
                    (len(r.output_token_ids) if penalizes(p) else 0)
                if seen > 4 * max_touched + 64:
                    return None
                row = touched_tokens(r, self.eos_token_ids, vocab_size)
                budget -= len(row)
                if budget < 0:
                    return None
            touched.append(row)
        return ScreenedRows(ks, touched)

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        """logits: [N, V] float (one row per request) -> one token per row."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [N, V] with N={len(requests)} rows, got {tuple(logits.shape)}"
            )
        if all(_plain_greedy(r) for r in requests):  # the common case: no fp32 copy of [N, V]
            n = len(requests)
            # fp32 on the CPU: kvserve's C kernel (memory speed; torch's max reads ~4 GB/s here).
            # Else max(dim).indices, not argmax: same first-index tie rule, but torch's CPU argmax
            # over bf16 is ~6x slower than max (27 vs 4.7 ms for [64, 262144] here).
            picked = kernels.argmax_rows(logits)
            tokens = (logits.max(dim=-1).indices if picked is None else picked).tolist()
            return SamplerOutput(token_ids=tokens, logprobs=[None] * n, top_logprobs=[None] * n)
        raw = logits.float()
        processed = apply_penalties(raw, requests, self.eos_token_ids)
        if any(r.grammar is not None for r in requests):  # no mask work for unconstrained batches
            processed = _grammar_masked(raw, processed, requests)
        tokens = self._select(processed, requests)
        return self._with_logprobs(raw, tokens, requests)

    def _select(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        """Greedy rows: argmax; random rows: filter and sample. logits [N, V] -> [N] long."""
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        # One argmax over the whole batch covers the common all-greedy case.
        tokens = logits.argmax(dim=-1) if len(random_rows) < len(requests) else None
        if not random_rows:
            return tokens
        picked = sample_rows(logits, random_rows, [requests[i].params for i in random_rows],
                             [requests[i].generator for i in random_rows])
        if tokens is None:  # all rows random
            return picked
        tokens[torch.tensor(random_rows, device=logits.device)] = picked
        return tokens

    def token_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, requests: list[SamplingRequest]
    ) -> SamplerOutput:
        """Logprobs of given tokens [N] under raw logits [N, V] (speculative tokens chosen by
        the rejection sampler); computed only for requests that asked for them."""
        return self._with_logprobs(raw.float() if any(r.params.logprobs is not None for r in requests) else raw,
                                   tokens, requests)

    def _with_logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, requests: list[SamplingRequest]
    ) -> SamplerOutput:
        """Logprobs from the raw logits [N, V]; tokens [N]."""
        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * len(requests)
        top: list[dict[int, float] | None] = [None] * len(requests)
        asked = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not asked:  # the common case: a logsumexp over [N, 262144] costs ~1 ms per row
            return SamplerOutput(token_ids=token_list, logprobs=logprobs, top_logprobs=top)
        idx = torch.tensor(asked, device=raw.device)
        rows = raw[idx]
        # logsumexp instead of log_softmax: no second [M, V] tensor.
        lse = rows.logsumexp(dim=-1)
        chosen = (rows.gather(1, tokens[idx].unsqueeze(1)).squeeze(1) - lse).tolist()
        wanted = [min(requests[i].params.logprobs, raw.shape[1]) for i in asked]
        vals = ids = None
        if max(wanted) > 0:
            vals, ids = rows.topk(max(wanted), dim=-1)
            vals, ids = (vals - lse.unsqueeze(1)).tolist(), ids.tolist()
        for j, i in enumerate(asked):
            logprobs[i] = chosen[j]
            top[i] = dict(zip(ids[j][: wanted[j]], vals[j][: wanted[j]])) if wanted[j] else {}
        return SamplerOutput(token_ids=token_list, logprobs=logprobs, top_logprobs=top)
