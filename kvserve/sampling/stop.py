"""Incremental detokenization and stop conditions (stop strings, stop tokens, length)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


def _token_string(tokenizer: Any, token_id: int) -> str | None:
    """The vocabulary string of a token, if the tokenizer can tell (None otherwise)."""
    if hasattr(tokenizer, "id_to_token"):  # tokenizers.Tokenizer
        return tokenizer.id_to_token(token_id)
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # transformers tokenizers
        return tokenizer.convert_ids_to_tokens(token_id)
    return None


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas without ever emitting half
    a UTF-8 character.

    Keeps two offsets into the output ids (as vLLM/TGI): text of ids[prefix:read] was
    already emitted; each step decodes only the window ids[prefix:] and emits what it adds
    beyond ids[prefix:read]. Decoding a window that starts one chunk back (instead of just
    the new ids) keeps SentencePiece leading spaces right: decoders strip the space of the
    first token they see, which must be an already emitted one.

    Text is held back while
    - it ends with U+FFFD (an incomplete UTF-8 sequence may still be completed), or
    - the last token is a byte-fallback token like <0xE2>: SentencePiece's ByteFallback
      decoder turns a whole run of byte tokens into U+FFFD (one per byte) if the run is
      not valid UTF-8, so even a valid-looking run may change until a non-byte token ends it.

    The concatenated deltas plus `flush()` equal `tokenizer.decode(output_ids)`; the window
    holds a couple of chunks, so each step is O(1) in the output length.

    `prompt_token_ids` is accepted for interface compatibility but not decoded: the text
    is defined as the decode of the output ids alone (vLLM seeds the window with the prompt
    tail, which differs only for decoders that strip the first leading space).
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_len = len(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._in_byte_run = False
        self._parts: list[str] = []
        self._text_cache: str | None = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _is_byte_token(self, token_id: int) -> bool:
        tok = _token_string(self.tokenizer, token_id)
        return tok is not None and _BYTE_TOKEN.fullmatch(tok) is not None

    def _is_skipped(self, token_id: int) -> bool:
        """A skipped special token vanishes before the decoder, so it does not end a byte run."""
        return (
            self.skip_special_tokens
            and self._decode([token_id]) == ""
            and self.tokenizer.decode([token_id], skip_special_tokens=False) != ""
        )

    def _update_byte_run(self, token_id: int) -> None:
        if self._is_byte_token(token_id):
            self._in_byte_run = True
        elif self._in_byte_run and not self._is_skipped(token_id):
            self._in_byte_run = False

    def _pending_delta(self) -> str:
        """Text that ids[read:] add to the window (decodes only ids[prefix:])."""
        window = self.token_ids[self._prefix_offset :]
        seen = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:seen])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text):
            return ""
        return new_text[len(prefix_text) :]

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta

    def add_token(self, token_id: int) -> str:
        """Append one output token; return the newly stable text (may be "")."""
        self.token_ids.append(token_id)
        self._update_byte_run(token_id)
        if self._in_byte_run:
            return ""
        delta = self._pending_delta()
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(delta)

    def flush(self) -> str:
        """At finish: return whatever is still held back (may end with U+FFFD)."""
        if self._read_offset == len(self.token_ids):
            return ""
        self._in_byte_run = False
        return self._emit(self._pending_delta())

    @property
    def text(self) -> str:
        """All stable output text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
            self._parts = [self._text_cache] if self._text_cache else []
        return self._text_cache


@dataclass
class StopResult:
    finished: bool
    reason: str | None  # "stop" (stop string, stop token or eos) or "length"
    stop_reason: int | str | None  # matched stop string / stop token id; None for eos/length
    emit: str  # text safe to stream now


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
        self.stop_strings: list[str] = list(params.stop or ())
        self.max_model_len = max_model_len
        self._emitted: list[str] = []
        self._pending = ""  # accepted text not streamed yet (a possible stop-string start)
        self._result: StopResult | None = None

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

        if may_stop and self.stop_strings:
            match = self._find_stop(self._pending, delta)
            if match is not None:
                stop, start = match
                end = start + (len(stop) if p.include_stop_str_in_output else 0)
                return self._finish("stop", stop, (self._pending + delta)[:end])

        text = self._pending + delta
        out_of_tokens = p.max_tokens is not None and num_output_tokens >= p.max_tokens
        if out_of_tokens or total_len >= self.max_model_len:
            return self._finish("length", None, text)

        keep = self._held_suffix_len(text)
        self._pending = text[len(text) - keep :]
        return self._stream(StopResult(False, None, None, text[: len(text) - keep]))

    def _find_stop(self, pending: str, delta: str) -> tuple[str, int] | None:
        """Earliest-ending stop string occurrence that ends inside `delta`.

        Returns (stop string, start index in pending + delta). Searching pending + delta is
        enough: any occurrence starting earlier would have made pending longer.
        """
        text = pending + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop_strings:
            start = text.find(stop, max(0, len(pending) - len(stop) + 1))
            if start == -1:
                continue
            cand = (start + len(stop), start, stop)
            if best is None or cand[:2] < best[:2]:
                best = cand
        return None if best is None else (best[2], best[1])

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

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
