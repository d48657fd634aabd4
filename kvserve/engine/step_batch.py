"""One engine step's flat batch: the model runner's inputs, which logits rows belong to which
sequence, which rows are sampled together, and the reruns a sequence at a time when a pass or a
sampling group fails (so that only the request that fails alone ends).

Pure bookkeeping over the scheduler's output; the engine owns the requests and the clock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvserve.engine.model_runner import StepInput
from kvserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from kvserve.sampling import Sampler, SamplerOutput, SamplingRequest, ScreenedRows
from kvserve.sampling.sampler import penalizes
from kvserve.sampling.structured import GrammarState, token_bitmask
from kvserve.sequence import Sequence
from kvserve.speculative.proposers import Draft

log = logging.getLogger(__name__)


def sampling_request(seq: Sequence) -> SamplingRequest:
    """The sampler's view of one sequence's logits row."""
    return SamplingRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, seq.grammar)


def draft_requests(seq: Sequence, draft: list[int]) -> list[SamplingRequest]:
    """The sampler's view of a drafted sequence's len(draft) + 1 verification rows: row j
    follows drafts 0..j-1, which its penalties and min_tokens count as output."""
    p = seq.params
    if not (penalizes(p) or p.min_tokens > len(seq.output_token_ids)):
        return [sampling_request(seq)] * (len(draft) + 1)  # every row alike
    out = list(seq.output_token_ids)
    return [SamplingRequest(p, seq.prompt_token_ids, out + draft[:j], seq.generator, seq.grammar)
            for j in range(len(draft) + 1)]


@dataclass
class HiddenRows:
    """Final hidden states a sequence wants from this pass (prompt logprobs, an embedding):
    `count` rows for positions start.., at `first` in `ModelRunner.execute_hidden`'s rows."""

    seq: Sequence
    first: int
    start: int
    count: int
    ends_prompt: bool  # an embedding's chunk that ends its prompt: it finishes after this pass


@dataclass
class StepBatch:
    """One pass's inputs, one per scheduled chunk, and the logits rows the engine reads back."""

    inputs: list[StepInput] = field(default_factory=list)
    samplers: list[Sequence] = field(default_factory=list)  # sequences that sample a token, at rows[i]
    rows: list[int] = field(default_factory=list)
    spec: list[tuple[ScheduledSeq, int]] = field(default_factory=list)  # drafted items, their first row
    num_rows: int = 0  # logits rows of the pass
    num_prompt_tokens: int = 0  # prompt tokens that go through the model (not cache hits)
    hidden: list[HiddenRows] = field(default_factory=list)  # empty on the plain path
    num_hidden_rows: int = 0


def build_batch(sched: SchedulerOutput, drafts: dict[int, Draft], now: float) -> StepBatch:
    """The scheduled chunks as one flat batch; stamps each sequence's first scheduled time.
    A drafted item feeds its last known token and its drafts and gets a logits row for each."""
    b = StepBatch()
    for item in sched.scheduled:
        seq = item.seq
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        start = seq.num_computed_tokens
        known = item.num_tokens - item.num_spec
        tokens = seq.token_slice(start, start + known)
        if item.num_spec:
            tokens = tokens + drafts[id(item)].token_ids
        b.num_prompt_tokens += max(0, min(start + known, seq.num_prompt_tokens) - start)
        needs_logits = item.needs_logits and seq.pooling is None  # an embedding samples nothing
        num_hidden = _hidden_rows(b, seq, start, start + known) if seq.wants_prompt_rows else 0
        b.inputs.append(StepInput(tokens, start, seq.block_table, needs_logits, max(1, item.num_logits),
                                  group_tables=seq.group_block_tables, num_hidden=num_hidden,
                                  state_slot=seq.state_slot))
        if seq.pooling is not None:
            continue
        if item.num_spec:
            b.spec.append((item, b.num_rows))
        elif item.needs_logits:
            b.samplers.append(seq)
            b.rows.append(b.num_rows)
        b.num_rows += item.num_logits
    return b


def _hidden_rows(b: StepBatch, seq: Sequence, start: int, end: int) -> int:
    """How many of the chunk [start, end)'s last rows (just before its logit row) `seq` wants the
    final hidden states of, recorded in `b.hidden`. Prompt logprobs: positions not yet scored
    whose next token is in the prompt. An embedding: every row not yet pooled (MEAN), or the
    prompt's last row (LAST); its chunk that ends the prompt is always recorded, so that it
    finishes. Rows already used (a chunk computed again after preemption or a failed step) are
    not asked for twice."""
    n = seq.num_prompt_tokens
    if end > n:
        return 0  # past the prompt (not reached: prompt rows are done before any output)
    if seq.pooling is None:
        first, end = max(start, len(seq.prompt_logprobs) - 1), min(end, n - 1)
        ends_prompt = False
    else:
        ends_prompt = end == n
        if seq.pooling.pooling_type == "MEAN":
            first = max(start, seq.pooled[1] if seq.pooled is not None else 0)
        else:
            first = end - 1 if ends_prompt else end
    count = max(0, end - first)
    if count or ends_prompt:
        b.hidden.append(HiddenRows(seq, b.num_hidden_rows, first, count, ends_prompt))
        b.num_hidden_rows += count
    return count


def _all_rows_sampled(b: StepBatch) -> bool:
    """Every logit row of the step is a sampler's row or a drafted item's, each once."""
    spec_rows = [r + j for it, r in b.spec for j in range(it.num_logits)]
    return bool(b.num_rows) and sorted(b.rows + spec_rows) == list(range(b.num_rows))


def argmax_only(b: StepBatch, sampler: Sampler) -> bool:
    """Every logit row of the step wants only its argmax: plain greedy sampling, or the
    verification of a plain greedy sequence's drafts (no logprobs, penalties or min_tokens)."""
    if not _all_rows_sampled(b):
        return False
    seqs = b.samplers + [it.seq for it, _ in b.spec]
    return sampler.greedy_only([sampling_request(s) for s in seqs])


def argmax_masks(b: StepBatch, sampler: Sampler, vocab_size: int,
                 draft_masks: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
    """A step whose logit rows all want only their argmax, some under a grammar: each row's
    allowed tokens ([rows, ceil(V / 32)] int32, in row order; a drafted item's rows take its
    draft's per-position masks, `draft_masks`: (first row, masks)); else None."""
    if not draft_masks and not any(s.grammar is not None for s in b.samplers):
        return None  # (first the cheap test: most steps hold no constrained row)
    if not _all_rows_sampled(b):
        return None
    if not sampler.argmax_rows([sampling_request(s) for s in b.samplers + [it.seq for it, _ in b.spec]]):
        return None
    states: list[GrammarState | None] = [None] * b.num_rows  # (drafted rows: their draft's masks)
    for row, seq in zip(b.rows, b.samplers):
        states[row] = seq.grammar
    allowed = token_bitmask(states, vocab_size)
    for row, masks in draft_masks:
        allowed[row:row + masks.shape[0]] = masks
    return allowed


def top_k_rows(b: StepBatch, sampler: Sampler, vocab_size: int, drafts: dict[int, Draft], max_k: int,
               max_rows: int, max_touched: int) -> ScreenedRows | None:
    """A step of 1 .. max_rows logit rows, without hidden rows, whose rows all draw from their few
    largest logits (`Sampler.screened_top_k`, k <= max_k, at most max_touched tokens changed by
    penalties; a drafted item's rows count the drafts before them): each row's k and touched
    tokens, in row order; else None."""
    if not 0 < b.num_rows <= max_rows or b.hidden or not _all_rows_sampled(b):
        return None
    requests: list[SamplingRequest] = [None] * b.num_rows  # type: ignore[list-item]
    for row, seq in zip(b.rows, b.samplers):
        requests[row] = sampling_request(seq)
    for it, row in b.spec:
        requests[row:row + it.num_logits] = draft_requests(it.seq, drafts[id(it)].token_ids)
    return sampler.screened_top_k(requests, vocab_size, max_k, max_touched)


def fit_drafts_to_screen(sched: SchedulerOutput, drafts: dict[int, Draft], sampler: Sampler, vocab_size: int,
                         max_k: int, max_rows: int) -> None:
    """Cut the drafts that would carry a step past the head's top-k screen (more than max_rows
    logit rows) where, without them, every row would take it: the longest drafts lose their last
    tokens first until the step fits. Past the screen, every row of a penalized or top-k step pays
    the full fp32 head and the body more rows, which mostly rejected drafts do not pay back
    (docs/BENCHMARKS.md); the tokens are the same either way."""
    items = [it for it in sched.scheduled if it.needs_logits]
    rows = sum(it.num_logits for it in items)
    if rows <= max_rows or len(items) > max_rows or not any(it.num_spec for it in items):
        return
    if sampler.screen_ks([sampling_request(it.seq) for it in items], vocab_size, max_k) is None:
        return
    drafted = [it for it in items if it.num_spec]
    for _ in range(rows - max_rows):  # one token off the longest draft at a time
        longest = max(drafted, key=lambda it: it.num_spec)
        longest.num_spec -= 1
        longest.num_tokens -= 1
    for it in drafted:
        drafts[id(it)].truncate(it.num_spec)
        seq = it.seq
        if seq.num_draft_computed is not None:  # a draft pool's K/V past the kept drafts is not the sequence's
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_tokens + it.num_spec - 1)


def sampling_groups(rows: list[int], samplers: list[Sequence]) -> list[tuple[list[int], list[Sequence]]]:
    """(logits rows, sequences) to sample together: every sequence with a row of its own in
    one batch, then the samples forked from one parent a parent at a time, each from the
    parent's row. A request's n first tokens never gather n copies of the whole batch's
    vocabulary rows (64 prompts x n 128 of Gemma's would be 8 GB of fp32)."""
    by_row: dict[int, list[Sequence]] = {}
    for row, seq in zip(rows, samplers):
        by_row.setdefault(row, []).append(seq)
    single = [(row, seqs[0]) for row, seqs in by_row.items() if len(seqs) == 1]
    groups = []
    if single:
        groups.append(([r for r, _ in single], [s for _, s in single]))
    groups += [([row] * len(seqs), seqs) for row, seqs in by_row.items() if len(seqs) > 1]
    return groups


def rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] [len(rows), V]: the tensor itself when rows are all of it in order, one
    row repeated as an expanded copy of that row (the samples of one parent)."""
    if rows == list(range(logits.shape[0])):
        return logits
    if len(set(rows)) == 1:
        return logits[rows[0]].expand(len(rows), -1).contiguous()
    return logits[torch.tensor(rows, device=logits.device)]


def sample_isolating(sampler: Sampler, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
                     append: Callable[[list[Sequence], SamplerOutput], None],
                     fail: Callable[[str, Exception], None]) -> None:
    """Sample one group's tokens and `append` them. A group that fails is sampled a sequence at
    a time, so only a request that fails alone ends (`fail(request_id, exc)`)."""
    try:
        out = sampler(rows_of(logits, rows), [sampling_request(s) for s in seqs])
    except Exception as exc:
        if len(seqs) == 1:
            fail(seqs[0].request_id, exc)
            return
        for row, seq in zip(rows, seqs):
            sample_isolating(sampler, logits, [row], [seq], append, fail)
        return
    append(seqs, out)


def execute_isolating(sched: SchedulerOutput, execute: Callable[[SchedulerOutput], None],
                      fail: Callable[[str, Exception], None]) -> None:
    """Run the step; if it fails, run each scheduled sequence alone, so that only a request
    whose own pass fails ends (`fail(request_id, exc)`: with an error, its blocks freed) and the
    others go on.

    A retry is safe because nothing a pass depends on changes before its per-request phase
    (which catches its own errors): positions are rewritten with the same K/V, and copying a
    block again only restores what its new owner rewrites."""
    try:
        execute(sched)
        return
    except Exception as exc:
        if len(sched.scheduled) == 1:
            fail(sched.scheduled[0].seq.request_id, exc)
            return
        log.warning("a step over %d sequences failed (%s); running each alone", len(sched.scheduled),
                    type(exc).__name__)
    for i, item in enumerate(sched.scheduled):
        if item.seq.finished:
            continue  # its request failed with another of its sequences
        alone = SchedulerOutput([item], block_copies=sched.block_copies if i == 0 else [],
                                state_copies=sched.state_copies if i == 0 else [])
        try:
            execute(alone)
        except Exception as exc:
            fail(item.seq.request_id, exc)
