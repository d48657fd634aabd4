"""Tool calls out of generated text, incrementally: the same parser object turns a stream's text
deltas into content deltas and tool-call deltas, and a whole response's text (fed at once) into
its content and tool calls, so a streamed response reassembles to exactly the plain one.

Formats (vLLM's parser names):
- `hermes`: Hermes / Qwen2.5 / Qwen3 templates, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text; the rest is content.
- `llama3_json`: Llama 3.1-3.3, the whole output is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`.
- `json_array`: what `tool_choice: "required"` constrains the output to (any model):
  `[{"name": ..., "parameters": {...}}, ...]`.
- `named`: a named `tool_choice`: the whole output is the arguments object of that function.

Arguments are the JSON text the model wrote for them (whitespace and all), streamed as it comes.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """A piece of call `index`: the first carries its id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class _Call:
    """A call being read: its name once complete, the argument text seen so far."""

    index: int
    id: str = field(default_factory=tool_call_id)
    name: str | None = None
    args: list[str] = field(default_factory=list)
    args_done: bool = False  # the arguments value is complete
    announced: bool = False  # the delta with id and name went out
    sent: int = 0  # argument pieces already sent

    @property
    def quoted(self) -> bool:
        """Arguments written as a JSON string (holding the JSON): sent unquoted, once complete."""
        return bool(self.args) and self.args[0] == '"'

    def arguments(self) -> str:
        text = "".join(self.args)
        return _unquote(text[1:-1]) if self.quoted and self.args_done else text


class CallScanner:
    """Reads JSON text holding call objects ({"name": ..., "arguments" | "parameters": ...}) as
    top-level objects (separated by anything: `;`, whitespace) or as the items of a top-level
    array, one character at a time; collects each call's name and the raw text of its
    arguments value."""

    def __init__(self, first_index: int = 0):
        self.calls: list[_Call] = []
        self._first = first_index
        self._depth = 0
        self._in_str = self._esc = False
        self._array = False  # the top level is an array of calls
        self._call_depth: int | None = None  # depth of the open call object's members
        self._expect = "key"  # key | colon | value | next (inside a call object, at its depth)
        self._key: str | None = None
        self._str: list[str] = []  # a key or the name value being read
        self._capture: str | None = None  # "name" | "args" while reading that value
        self._value_depth = 0

    @property
    def _call(self) -> _Call:
        return self.calls[-1]

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _char(self, ch: str) -> None:
        if self._capture == "args":
            self._args_char(ch)
            return
        if self._in_str:
            self._string_char(ch)
            return
        if ch == '"':
            if self._member_level() and self._expect == "value" and self._key in ARGUMENT_KEYS:
                self._begin_args(ch)  # arguments written as a JSON string
                return
            self._in_str = True
            if self._member_level() and self._expect in ("key", "value"):
                self._str = []
                if self._expect == "value" and self._key == "name":
                    self._capture = "name"
            return
        if ch in "{[":
            self._open(ch)
        elif ch in "}]":
            self._close()
        elif self._member_level():
            self._member_punct(ch)

    def _member_level(self) -> bool:
        return self._call_depth is not None and self._depth == self._call_depth

    def _open(self, ch: str) -> None:
        if self._depth == 0 and ch == "[":
            self._array = True
        starts_call = ch == "{" and self._call_depth is None and self._depth == (1 if self._array else 0)
        if self._member_level() and self._expect == "value" and self._key in ARGUMENT_KEYS:
            self._begin_args(ch)
            return
        self._depth += 1
        if starts_call:
            self.calls.append(_Call(self._first + len(self.calls)))
            self._call_depth, self._expect, self._key = self._depth, "key", None

    def _close(self) -> None:
        if self._member_level():
            self._call_depth = None  # the call object ends
        self._depth = max(0, self._depth - 1)

    def _member_punct(self, ch: str) -> None:
        if ch == ":" and self._expect == "colon":
            self._expect = "value"
        elif ch == ",":
            self._expect, self._key = "key", None
        elif not ch.isspace() and self._expect == "value" and self._key in ARGUMENT_KEYS:
            self._begin_args(ch)  # a number, true, null: unusual arguments, kept as written
        elif not ch.isspace() and self._expect == "value":
            self._expect = "next"

    def _string_char(self, ch: str) -> None:
        if self._esc:
            self._esc = False
            self._str.append(ch)
            return
        if ch == "\\":
            self._esc = True
            self._str.append(ch)
            return
        if ch != '"':
            self._str.append(ch)
            return
        self._in_str = False
        if not self._member_level():
            return
        text = "".join(self._str)
        if self._expect == "key":
            self._key, self._expect = _unquote(text), "colon"
        elif self._expect == "value":
            if self._capture == "name" and self._call.name is None:
                self._call.name = _unquote(text)
            self._capture, self._expect = None, "next"

    def _begin_args(self, ch: str) -> None:
        """The arguments value starts with `ch`; read it raw to its end."""
        self._capture, self._value_depth = "args", 0
        self._args_state = [False, False]  # in string, escaped
        self._args_char(ch)

    def _args_char(self, ch: str) -> None:
        in_str, esc = self._args_state
        done = False
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                done = self._value_depth == 0
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            self._value_depth += 1
        elif ch in "}]":
            if self._value_depth == 0:  # a bare value ended by its object's close
                self._capture, self._expect, self._call.args_done = None, "next", True
                self._close()
                return
            self._value_depth -= 1
            done = self._value_depth == 0
        elif ch == "," and self._value_depth == 0:
            self._capture, self._expect, self._key, self._call.args_done = None, "key", None, True
            return
        self._args_state = [in_str, esc]
        self._call.args.append(ch)
        if done:
            self._capture, self._expect, self._call.args_done = None, "next", True

    def deltas(self) -> list[CallDelta]:
        """What is new since the last call: a call is announced (id, name) once its name is
        complete, its argument text after that."""
        out = []
        for c in self.calls:
            if c.name is None:
                continue
            if not c.announced:
                c.announced = True
                out.append(CallDelta(c.index, c.id, c.name))
            if c.quoted:
                if c.args_done and c.sent == 0:
                    c.sent = len(c.args)
                    out.append(CallDelta(c.index, arguments=c.arguments()))
            elif c.sent < len(c.args):
                piece = "".join(c.args[c.sent:])
                c.sent = len(c.args)
                out.append(CallDelta(c.index, arguments=piece))
        return out


def _unquote(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def _merge(deltas: list[CallDelta]) -> list[CallDelta]:
    """Adjacent pieces of one call as one delta (a call announced and argued in one step)."""
    out: list[CallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == d.index and d.id is None:
            last.arguments += d.arguments
        else:
            out.append(CallDelta(d.index, d.id, d.name, d.arguments))
    return out


class ToolParser:
    """feed(text delta) -> (content delta, call deltas); finish() -> the same for what was held
    back. `calls` after finish: every call found."""

    def __init__(self):
        self._content_started = False
        self._pending_ws = ""  # whitespace held until non-whitespace content follows it

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[CallDelta]]:
        return "", []

    @property
    def calls(self) -> list[ParsedCall]:
        raise NotImplementedError

    def _content(self, text: str) -> str:
        """Content without its leading whitespace, and with whitespace between tool calls
        dropped (held until more content follows it)."""
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return ""
            self._content_started = True
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        return body


def _parsed(calls: list[_Call]) -> list[ParsedCall]:
    return [ParsedCall(c.id, c.name, c.arguments()) for c in calls if c.name is not None]


class JsonCallsParser(ToolParser):
    """The whole output is JSON calls: an array of them (`required`) or objects separated by
    `;` (`llama3_json`, after an optional `<|python_tag|>`). Output that does not start with
    `{` or `[` is plain content (llama3_json: the model answered without a tool)."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self._scanner = CallScanner()
        self._mode: str | None = None  # "calls" | "content", once the first character tells
        self._head = ""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._mode is None:
            self._head += text
            head = self._head.lstrip()
            if head.startswith(self.PYTHON_TAG):
                head = head[len(self.PYTHON_TAG):].lstrip()
            elif self.PYTHON_TAG.startswith(head):
                return "", []  # maybe the tag, still arriving
            if not head:
                return "", []
            self._mode = "calls" if head[0] in "{[" else "content"
            text = head if self._mode == "calls" else self._head
        if self._mode == "content":
            return self._content(text), []
        self._scanner.feed(text)
        return "", _merge(self._scanner.deltas())

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self._mode is None and self._head.strip():  # only a prefix of the tag: content after all
            self._mode = "content"
            return self._content(self._head), []
        return "", []

    @property
    def calls(self) -> list[ParsedCall]:
        return _parsed(self._scanner.calls)


class HermesParser(ToolParser):
    """`<tool_call>` JSON `</tool_call>` blocks; the text around them is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._scanner: CallScanner | None = None  # inside a block
        self._calls: list[_Call] = []

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            tag = self.CLOSE if self._scanner is not None else self.OPEN
            at = self._buf.find(tag)
            ready = self._buf[:at] if at >= 0 else self._buf[:len(self._buf) - _partial_suffix(self._buf, tag)]
            self._buf = self._buf[len(ready):]
            if self._scanner is None:
                content.append(self._content(ready))
            else:
                self._scanner.feed(ready)
                deltas += self._scanner.deltas()
            if at < 0:
                break
            self._buf = self._buf[len(tag):]
            if self._scanner is None:
                self._scanner = CallScanner(len(self._calls))
            else:
                self._calls += self._scanner.calls
                self._scanner = None
        return "".join(content), _merge(deltas)

    def finish(self) -> tuple[str, list[CallDelta]]:
        rest, self._buf = self._buf, ""
        if self._scanner is None:
            return self._content(rest), []
        self._scanner.feed(rest)  # an unclosed block: what it holds
        return "", _merge(self._scanner.deltas())

    @property
    def calls(self) -> list[ParsedCall]:
        return _parsed(self._calls + (self._scanner.calls if self._scanner is not None else []))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class NamedParser(ToolParser):
    """A named tool_choice: the whole output is the arguments of `name`."""

    def __init__(self, name: str):
        super().__init__()
        self._call = _Call(0, name=name)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        out = []
        if not self._call.announced:
            self._call.announced = True
            out.append(CallDelta(0, self._call.id, self._call.name))
        if text:
            self._call.args.append(text)
            out.append(CallDelta(0, arguments=text))
        return "", _merge(out)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self.feed("") if not self._call.announced else ("", [])

    @property
    def calls(self) -> list[ParsedCall]:
        return _parsed([self._call])


PARSERS = {"hermes": HermesParser, "llama3_json": JsonCallsParser}


def parser_for_template(source: str | None) -> str | None:
    """The tool-call format a chat template asks for, from its text (None: it has none)."""
    if not source:
        return None
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or '"parameters": dictionary of argument name' in source:
        return "llama3_json"
    return None
