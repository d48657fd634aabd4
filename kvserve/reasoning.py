"""Reasoning apart from the answer (vLLM's `--reasoning-parser`): a thinking model writes its
reasoning between <think> and </think>, then its answer. A chat response carries the reasoning as
`reasoning` (and as `reasoning_content`, its earlier name, which llama.cpp's server uses) and the
rest as content, from which tool calls are parsed.

Where the reasoning begins: at the start of the output when it opens with <think>, or when the
prompt already ends with <think> (the chat template opened the block, as DeepSeek-R1's and the
Qwen3 thinking models' templates do). It runs to the first </think>, or to the end of the output
when none comes (the model ran out of tokens while thinking). Text after it is content, tags and
all: one block per output. An output that does not start in reasoning is all content.

As the tool parsers, one splitter takes a stream's text deltas or a whole text at once and gives
the same split: text that may be the start of a tag is held back until the next delta tells.
"""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's names for the <think> ... </think> format; both read it the same way here.
PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def opens_reasoning(prompt: str) -> bool:
    """The rendered prompt leaves the model inside a reasoning block."""
    return prompt.rstrip().endswith(START)


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """Splits one output's text into (reasoning, content) pieces, delta by delta."""

    in_reasoning: bool = False  # the prompt opened a reasoning block
    _state: str = "start"  # "start": nothing seen yet; then "reasoning" or "content"
    _held: str = ""
    saw_reasoning: bool = False  # a reasoning block began (the response then carries the field)

    def feed(self, text: str) -> tuple[str, str]:
        """The next text delta -> (its reasoning, its content)."""
        text, self._held = self._held + text, ""
        if self._state == "start":
            if len(text) < len(START) and START.startswith(text):
                self._held = text  # "", "<", "<th", ...: a tag may follow
                return "", ""
            opened = text.startswith(START)
            text = text[len(START):] if opened else text
            self._state = "reasoning" if opened or self.in_reasoning else "content"
            self.saw_reasoning = self._state == "reasoning"
        reasoning = ""
        if self._state == "reasoning":
            end = text.find(END)
            if end < 0:
                keep = _tag_prefix(text, END)
                self._held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(END):]
            self._state = "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the output: an unfinished tag is text as it stands."""
        held, self._held = self._held, ""
        if self._state == "start":
            self._state = "reasoning" if self.in_reasoning else "content"
            self.saw_reasoning = self.in_reasoning
        return (held, "") if self._state == "reasoning" else ("", held)

    def split(self, text: str) -> tuple[str, str]:
        """A whole output -> (reasoning, content)."""
        reasoning, content = self.feed(text)
        more, rest = self.finish()
        return reasoning + more, content + rest
