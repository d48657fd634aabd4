"""A `Sequence`: one stream of tokens being generated (a request has n of them).

Pure Python (no torch): the scheduler and block manager work on these objects alone.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.sampling.detokenizer import IncrementalDetokenizer, StreamDetokenizer
    from kvserve.sampling.stop import StopChecker


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self._finished  # (set below: asked several times a step for every sequence)


for _status in SequenceStatus:
    _status._finished = _status.name.startswith("FINISHED")


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's shape): its rank in the vocabulary
    at that position (1: the most likely) and its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    index: int = 0  # which of the request's n samples
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache. Prefill chunks and decodes advance it; preemption
    # by recompute resets it to 0.
    num_computed_tokens: int = 0
    # Prompt tokens the prefix cache supplied when the sequence was first admitted (None: not yet
    # admitted); a recompute after preemption does not change it (vLLM's num_cached_tokens).
    num_cached_tokens: int | None = None
    # Logical block i -> physical block (page) id, for KV layer group 0: the full-attention group
    # when the model has one. With several layer groups (sliding-window release), the tables of
    # groups 1.. sit in `group_block_tables`; a sliding group's entries for blocks that fell out
    # of its window are NULL_BLOCK (-1). All tables of a sequence have the same length.
    block_table: list[int] = field(default_factory=list)
    group_block_tables: list[list[int]] = field(default_factory=list)
    # Speculative decoding. The engine sets how many draft tokens this sequence may be verified
    # with next step (0 = plain decoding); the scheduler reserves that many extra slots.
    max_spec_tokens: int = 0
    # Its own draft length under the "heuristic" schedule (None: num_speculative_tokens, not yet
    # adjusted); see SpeculativeDecoder.budget.
    spec_k: int | None = None
    # Tokens whose K/V the draft model's own cache holds (None = no separate draft cache). A
    # block is registered in the prefix cache only once both caches hold it.
    num_draft_computed: int | None = None
    # A hybrid model's recurrent state: the slot of the state pool this sequence holds (None: none
    # held; see kvserve/engine/state_slots.py).
    state_slot: int | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # Per-token timestamps from the engine's monotonic clock.
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Extra block-hash keys (a tenant's cache salt): prefix blocks are shared only among
    # sequences carrying the same keys.
    cache_salt: tuple = ()
    # vLLM's prompt logprobs (params.prompt_logprobs set): [None, then per prompt token after the
    # first {token id: Logprob} of it and its top alternatives], filled as prefill chunks run.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A prefix-cache hit supplies K/V but no hidden states: a sequence that needs every prompt
    # row's (prompt logprobs, mean pooling) computes its prompt whole. Its blocks are still
    # registered for others.
    skip_reading_prefix_cache: bool = False
    # An embedding request (kvserve/pooling_params.py): it runs its prompt and samples nothing.
    # `pooling` is its PoolerConfig with the request's settings applied; `pooled` is (the running
    # sum (MEAN) or the last row (LAST) of its hidden states, the prompt rows in it), then the
    # finished embedding as a list of floats.
    pooling: Any = field(default=None, repr=False)
    pooled: Any = field(default=None, repr=False)
    # Set by the engine when the request is added. `generator` is a torch.Generator for a
    # seeded sample (typed Any so that this module stays torch-free).
    generator: Any = field(default=None, repr=False)
    # Structured outputs: the sequence's place in its request's grammar (a
    # kvserve.sampling.structured.GrammarState, set once the grammar is compiled).
    grammar: Any = field(default=None, repr=False)
    # The grammar while the sequence reasons (a prompt that opened a <think> block, under a
    # reasoning parser): it becomes `grammar` with the token that closes the block.
    reasoning_grammar: Any = field(default=None, repr=False)
    detokenizer: IncrementalDetokenizer | StreamDetokenizer | None = field(default=None, repr=False)
    stop_checker: StopChecker | None = field(default=None, repr=False)
    # Streamed text in pieces (joined only when an output needs all of it) and how much of
    # it, and of the tokens, earlier outputs reported.
    text_parts: list[str] = field(default_factory=list, repr=False)
    num_text_parts_reported: int = 0
    num_tokens_reported: int = 0

    @property
    def wants_prompt_rows(self) -> bool:
        """Its prompt rows' hidden states are still needed: prompt logprobs not yet all there,
        or an embedding request (it computes nothing else)."""
        if self.pooling is not None:
            return True
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_tables(self) -> list[list[int]]:
        """Every layer group's block table, group 0 first (the lists themselves, not copies)."""
        return [self.block_table, *self.group_block_tables]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def lookahead_limit(self, k: int, max_model_len: int) -> int:
        """Up to k slots past the next token (draft tokens, further decode steps), never more than
        the request may still emit after it (max_tokens, else the context window)."""
        max_tokens = self.params.max_tokens
        left = max_model_len if max_tokens is None else max_tokens - len(self.output_token_ids)
        return max(0, min(k, left - 1))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence (decode hot path)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - n)]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still feeding tokens it already knows (the prompt, or a preempted sequence's output)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.token_times.append(now)

    def finish(self, status: SequenceStatus, now: float, reason: int | str | None = None) -> None:
        self.status = status
        self.stop_reason = reason
        self.finished_time = now
