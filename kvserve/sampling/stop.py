"""Stop conditions: stop strings (one automaton per request), stop tokens, end of sequence, length."""

from __future__ import annotations

import collections
import copy
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.sampling_params import SamplingParams


@dataclass
class StopResult:
    finished: bool
    reason: str | None  # "stop" (stop string, stop token or eos) or "length"
    stop_reason: int | str | None  # matched stop string / stop token id; None for eos/length
    emit: str  # text safe to stream now


class StopMatcher:
    """The stop strings of one request as an Aho-Corasick automaton, built once and shared by
    its n sequences (each keeps only its state: an int).

    A state is the longest suffix of the text so far that is a prefix of some stop string, so
    feeding text costs O(new characters) amortized (a fall back along failure links never
    exceeds the depth gained), however many stop strings there are."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._add_all()
        self._fail = [0] * len(self._goto)
        # Per state: the longest stop string ending here (None if none), and how much text to
        # hold back (the longest suffix that is a *proper* prefix of a stop: a state with no
        # children is a whole stop string only, so it holds what its failure state holds).
        self._match: list[str | None] = [None] * len(self._goto)
        self._hold = [0] * len(self._goto)
        self._link()

    def _add_all(self) -> None:
        ends: dict[int, str] = {}
        for stop in self.stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                node = nxt
            ends[node] = stop
        self._ends = ends

    def _link(self) -> None:
        queue = collections.deque([0])
        while queue:  # breadth first: a node's failure state is shallower, so already linked
            node = queue.popleft()
            if node:
                fail = self._fail[node]
                self._match[node] = self._ends.get(node) or self._match[fail]
                self._hold[node] = self._depth[node] if self._goto[node] else self._hold[fail]
            for ch, child in self._goto[node].items():
                self._fail[child] = self._next(self._fail[node], ch) if node else 0
                queue.append(child)

    def _next(self, state: int, ch: str) -> int:
        while True:
            nxt = self._goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = self._fail[state]

    def feed(self, state: int, text: str, report: bool) -> tuple[int, int, str | None]:
        """Advance over `text`: (new state, index in `text` just past the first stop string that
        ends in it, that stop string), or (state, -1, None). The longest wins among stops ending
        at the same place. With `report` False matches are passed over (min_tokens not reached)."""
        if not self.stops:  # the common request: nothing to scan on the per-token path
            return state, -1, None
        for i, ch in enumerate(text):
            state = self._next(state, ch)
            if report and self._match[state] is not None:
                return state, i + 1, self._match[state]
        return state, -1, None

    def held(self, state: int) -> int:
        """Characters at the end of the text that may still begin a stop string."""
        return self._hold[state]


class StopChecker:
    """Decides when a sequence is finished and which text may be streamed.

    Feed it every output token with the detokenizer's delta for it. Text that could be the
    beginning of a stop string is held back, so the streamed text never contains anything
    the final (truncated) output drops: concatenated `emit`s == `final_text()`.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], max_model_len: int):
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.matcher = StopMatcher(params.stop or ())
        self.max_model_len = max_model_len
        self._reset()

    def _reset(self) -> None:
        self._state = 0  # the matcher's state after all text so far
        self._emitted: list[str] = []
        self._pending = ""  # accepted text not streamed yet (a possible stop-string start)
        self._result: StopResult | None = None

    @classmethod
    def for_samples(cls, params: SamplingParams, eos_token_ids: Sequence[int], max_model_len: int,
                    n: int) -> list[StopChecker]:
        """Checkers for a request's n samples: the stop strings and token sets are built once
        and shared, each sample keeping only its own progress."""
        first = cls(params, eos_token_ids, max_model_len)
        checkers = [first]
        for _ in range(n - 1):
            other = copy.copy(first)
            other._reset()
            checkers.append(other)
        return checkers

    @property
    def finished(self) -> bool:
        return self._result is not None

    def check(self, token_id: int, delta: str, num_output_tokens: int, total_len: int) -> StopResult:
        """Account for one new output token.

        num_output_tokens and total_len (prompt + output) both include this token.
        """
        if self._result is not None:
            raise RuntimeError("check() called on a finished sequence")
        p = self.params
        may_stop = num_output_tokens >= p.min_tokens
        is_eos = not p.ignore_eos and token_id in self.eos_token_ids
        if may_stop and (is_eos or token_id in self.stop_token_ids):
            # The stop token's own text is dropped unless asked for (vLLM).
            tail = delta if p.include_stop_str_in_output else ""
            stop_reason = token_id if token_id in self.stop_token_ids else None
            return self._finish("stop", stop_reason, self._pending + tail)

        text = self._pending + delta
        # The earliest stop string ending inside `delta` (one starting earlier would have made
        # `_pending` longer); the matcher sees each character once.
        self._state, end, stop = self.matcher.feed(self._state, delta, report=may_stop)
        if stop is not None:
            end += len(self._pending)
            keep = end if p.include_stop_str_in_output else end - len(stop)
            return self._finish("stop", stop, text[:keep])

        out_of_tokens = p.max_tokens is not None and num_output_tokens >= p.max_tokens
        if out_of_tokens or total_len >= self.max_model_len:
            return self._finish("length", None, text)

        keep = self.matcher.held(self._state)
        self._pending = text[len(text) - keep :]
        return self._stream(StopResult(False, None, None, text[: len(text) - keep]))

    def expire(self) -> str:
        """Finish with "length" now (a deadline passed): the held-back text, to stream."""
        if self._result is not None:
            return ""
        return self._finish("length", None, self._pending).emit

    def _finish(self, reason: str, stop_reason: int | str | None, emit: str) -> StopResult:
        self._pending = ""
        self._result = StopResult(True, reason, stop_reason, emit)
        return self._stream(self._result)

    def _stream(self, result: StopResult) -> StopResult:
        if result.emit:
            self._emitted.append(result.emit)
        return result

    def final_text(self) -> str:
        """Full output text after truncation rules (before finishing: streamed + held text)."""
        return "".join(self._emitted) + self._pending
