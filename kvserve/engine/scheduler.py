"""Continuous batching: one token budget per step, chunked prefill, preemption by recompute.

Pure Python (no torch). Each `schedule()` call picks, for one forward pass, how many tokens
each sequence feeds, starting at its `num_computed_tokens`:

* Running sequences are visited oldest first. Decodes (one unknown token left) get 1 token,
  plus up to k lookahead slots (`seq.max_spec_tokens`: draft tokens with speculative decoding,
  the further steps of multi-step decoding), and
  have budget reserved for them up front, so a big prefill chunk never starves them.
  Running sequences still in prefill get `min(remaining, budget left after the decodes)`.
* Then waiting sequences, FCFS, get `min(remaining, budget)`; that single rule gives
  chunked prefill and piggybacked decodes. The queue head blocks the queue: skipping it
  would let a stream of small requests starve a big one.
* Except for one reason: a waiting sequence whose next prefix blocks a running sequence is
  computing right now (an in-flight prefix, `BlockManager.num_pending_prefix_tokens`) is
  passed over for this step, and the scan goes on to the next one. Admitted now it would
  compute that prefix a second time; a step or two later it hits the cache. This cannot
  deadlock: in-flight blocks belong to running sequences only, which progress, and whose
  preemption, abort or finish drops them; a sequence is never passed over when nothing runs.
* When a running sequence needs blocks the pool lacks, the NEWEST running sequence is
  preempted by recompute (blocks freed, back to the front of the waiting queue; its prefix
  usually hits the cache on return), repeatedly, down to the sequence itself. Visiting
  oldest first means a victim is never one already scheduled this step, and the oldest
  sequence can never be preempted by another: it always progresses, so nothing starves.
* A request that could never run (prompt over `max_model_len`; prompt + max_tokens needing more
  blocks than the whole pool at its peak, `BlockManager.peak_blocks`: every block of full-attention
  layer groups, a window plus a chunk of sliding ones; a prompt over the token budget without
  chunked prefill) is rejected in
  `add()` and reported once, as FINISHED_ERROR with `seq.error`, by the next `schedule()`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.block_manager import BlockManager
from kvserve.sequence import Sequence, SequenceStatus

# Fraction of the pool kept free when admitting a new sequence next to running ones, so
# running decodes have room to grow before anything must be preempted. A lone sequence
# ignores it (it may use the whole pool).
WATERMARK_FRACTION = 0.01


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to feed this step, from position `start`
    # Speculative decoding: slots reserved for draft tokens after the last known token. The engine
    # may shrink it (and num_tokens with it) to what the proposer found, and sets `num_rejected`
    # after verification; `update` then advances by num_tokens - num_rejected and returns the
    # blocks past the accepted tokens.
    num_spec: int = 0
    num_rejected: int = 0
    # Snapshots taken at construction (schedule time), so the answers stay right after
    # `update` advanced the sequence or the engine appended a sampled token.
    start: int = field(init=False)
    _num_known: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self._num_known = self.seq.num_tokens

    @property
    def needs_logits(self) -> bool:
        """True when this chunk reaches the end of the known tokens: sample the next one."""
        return self.start + self.num_tokens >= self._num_known

    @property
    def num_logits(self) -> int:
        """Rows of logits this sequence needs: its last token and every draft token (0 mid-prefill)."""
        return 1 + self.num_spec if self.needs_logits else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefill chunks
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), copy before the pass
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # recurrent-state slots (forks), the same
    finished_with_error: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 32768,
        enable_chunked_prefill: bool = True,
        num_lookahead_slots: int = 0,
    ):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_lookahead_slots = num_lookahead_slots
        self.watermark_blocks = int(WATERMARK_FRACTION * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first, newest last
        self._rejected: list[Sequence] = []  # reported by the next schedule()
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS), or reject it if it could never run."""
        error = self._rejection(seq)
        if error is not None:
            seq.status, seq.error = SequenceStatus.FINISHED_ERROR, error
            self._rejected.append(seq)
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _rejection(self, seq: Sequence) -> str | None:
        """Why seq can never be scheduled, or None."""
        n = seq.num_prompt_tokens
        if n == 0:
            return "prompt is empty"
        if n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len {self.max_model_len}"
        max_tokens = getattr(seq.params, "max_tokens", None)
        total = self.max_model_len if max_tokens is None else min(n + max_tokens, self.max_model_len)
        # The real peak: full-attention groups grow with the length, sliding groups hold a chunk
        # plus their window (unless a lagging draft cache keeps everything, see BlockManager).
        bm = self.bm
        need = bm.peak_blocks(total, self.max_num_batched_tokens, keep_all=seq.num_draft_computed is not None)
        if need > bm.num_blocks:
            why = "no max_tokens" if max_tokens is None else f"max_tokens {max_tokens}"
            head = f"request may reach {total} tokens (prompt {n}, {why}, max_model_len {self.max_model_len}),"
            if bm.num_groups == 1 and not bm.group_windows[0]:
                return (f"{head} more than the whole KV cache holds ({bm.num_blocks} blocks x "
                        f"{bm.block_size} = {bm.num_blocks * bm.block_size} tokens)")
            return (f"{head} needing up to {need} KV blocks over {bm.num_groups} layer groups, more than the "
                    f"whole KV cache holds ({bm.num_blocks} blocks of {bm.block_size} tokens)")
        samples = getattr(seq.params, "n", 1) or 1
        if bm.state_slots is not None and samples > bm.state_slots.num_slots:
            return (f"n = {samples} samples need {samples} recurrent state slots at once, more than the state "
                    f"pool holds ({bm.state_slots.num_slots}, max_num_seqs)")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            return (f"prompt has {n} tokens, more than max_num_batched_tokens "
                    f"{self.max_num_batched_tokens} and chunked prefill is disabled")
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start running `child` (n > 1) sharing all of parent's blocks.

        The engine has already copied the tokens; the child runs right after its request's
        other sequences, so it keeps the request's age for preemption.
        """
        if not any(s is parent for s in self.running):
            raise ValueError(f"fork: parent seq {parent.seq_id} is not running")
        self.bm.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        pos = max(i for i, s in enumerate(self.running) if s.request_id == parent.request_id)
        self.running.insert(pos + 1, child)

    def abort(self, request_id: str) -> list[Sequence]:
        """Free every sequence of the request at once, waiting or running; return them."""
        aborted = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for s in aborted:
            self._remove(s)
            s.status = SequenceStatus.FINISHED_ABORTED
        return aborted

    def finish(self, seq: Sequence) -> None:
        """The engine finished seq (stop/length; it set the status): free it and forget it."""
        self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        # By identity: Sequence is a dataclass, and its field-wise == is neither cheap nor meant.
        self.bm.free(seq)
        self.running = [s for s in self.running if s is not seq]
        self.waiting = deque(s for s in self.waiting if s is not seq)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_with_error=self._rejected)
        self._rejected = []
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        reserved = sum(self._decode_tokens(s) for s in self.running)

        i = 0  # preemption only removes from the tail (index >= i), so indexing stays valid
        while i < len(self.running) and len(decodes) + len(prefills) < self.max_num_seqs:
            seq = self.running[i]
            want = self._decode_tokens(seq)
            reserved -= want
            if want:  # a decode: 1 token, plus its draft tokens while budget and free blocks allow
                n = max(0, min(want, budget))
                while n > 1 and not self.bm.can_allocate(seq, n):
                    n -= 1  # drop draft slots before preempting anyone for them
            else:
                n = self._chunk(seq.num_uncomputed_tokens, budget - reserved)
            if n > 0:
                if not self.bm.fits_in_place(seq, n):
                    reserved -= self._make_room(seq, n, out)
                    if seq.status is not SequenceStatus.RUNNING:
                        break  # seq preempted itself: it was the newest, nothing is left to visit
                    self.bm.allocate(seq, n)
                (decodes if want else prefills).append(ScheduledSeq(seq, n, num_spec=n - 1 if want else 0))
                budget -= n
            i += 1

        if not out.preempted:  # memory is tight when we just preempted: admit nothing new
            budget = self._admit(budget, len(decodes) + len(prefills), prefills)

        out.scheduled = decodes + prefills
        out.block_copies = self.bm.take_block_copies()
        out.state_copies = self.bm.take_state_copies()
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _decode_tokens(self, seq: Sequence) -> int:
        """Tokens a decode feeds: its last token plus up to k draft tokens; 0 if not a decode.

        Drafts never go past the context window: the last one sits at position
        num_tokens - 1 + spec <= max_model_len - 1.
        """
        if seq.num_uncomputed_tokens != 1:
            return 0
        spec = min(seq.max_spec_tokens, self.num_lookahead_slots, self.max_model_len - seq.num_tokens)
        return 1 + max(0, spec)

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to feed a sequence with `remaining` unknown-to-the-cache tokens; 0 = not now."""
        if remaining <= 0 or budget <= 0:
            return 0
        if remaining <= budget:
            return remaining
        # Without chunked prefill a prompt goes whole; only a resumed sequence longer than the
        # whole budget (prompt + outputs after preemption) must still be chunked to progress.
        if not self.enable_chunked_prefill and remaining <= self.max_num_batched_tokens:
            return 0
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Preempt newest running sequences until seq's n tokens fit (or seq itself went).

        Returns how many preempted OTHER sequences were decodes, to release their reserved budget.
        """
        released = 0
        while not self.bm.can_allocate(seq, n):
            victim = self.running[-1]
            if victim is not seq:
                released += self._decode_tokens(victim)
            self._preempt(victim, out)
            if victim is seq:
                break
        return released

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        if seq.num_draft_computed is not None:
            seq.num_draft_computed = 0
        seq.status = SequenceStatus.WAITING
        assert self.running[-1] is seq, "only the newest running sequence is preempted"
        self.running.pop()
        self.waiting.appendleft(seq)  # newest-first victims end up in their original order
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _admit(self, budget: int, num_scheduled: int, prefills: list[ScheduledSeq]) -> int:
        """Admit waiting sequences FCFS while budget, sequence cap and blocks allow.

        Sequences waiting on an in-flight prefix are passed over (kept in order at the front);
        the first admissible one that does not fit still blocks the rest.
        """
        passed: list[Sequence] = []
        while self.waiting and budget > 0 and num_scheduled < self.max_num_seqs \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # `self.running` is never empty when something is in flight (its owner runs); the
            # test only makes "never wait on nobody" explicit.
            if self.running and self.bm.num_pending_prefix_tokens(seq) > 0:
                passed.append(self.waiting.popleft())
                continue
            cached = self.bm.num_cached_tokens(seq)
            n = self._chunk(seq.num_tokens - cached, budget)
            if n == 0 or not self._fits(seq, n):
                break
            self.waiting.popleft()
            hit = self.bm.allocate(seq, n)  # reuses the cached prefix, sets num_computed_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledSeq(seq, n))
            budget -= n
            num_scheduled += 1
        self.waiting.extendleft(reversed(passed))  # back in front, original order
        return budget

    def _fits(self, seq: Sequence, n: int) -> bool:
        """Can seq's first chunk be allocated, keeping the watermark unless nothing runs?"""
        return self.bm.can_allocate(seq, n, reserve_blocks=self.watermark_blocks if self.running else 0)

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: advance what was computed and register full blocks."""
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != s.start:
                continue  # aborted/finished/preempted since schedule(): its blocks are gone
            seq.num_computed_tokens += s.num_tokens - s.num_rejected
            if len(seq.block_table) > self.bm.blocks_for(seq.num_computed_tokens):
                self.bm.trim(seq)  # blocks that only held rejected (or never proposed) draft slots
            self.bm.mark_computed(seq)
