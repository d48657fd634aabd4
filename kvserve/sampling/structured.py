"""Constrained decoding with xgrammar: a request's constraint -> a compiled grammar -> one matcher
per sequence, whose token bitmask the sampler applies to that sequence's logits row.

xgrammar keeps a pushdown automaton over the vocabulary's decoded bytes: `TokenizerInfo` is
built once per tokenizer from its vocabulary strings, compiling a constraint precomputes the
token masks of its states (tens of ms for Gemma's 262,144 tokens), and a matcher per sequence
fills the next token's bitmask (~10-20 us) and advances with every accepted token. When the
grammar is complete the mask allows only the stop tokens (the tokenizer's EOS ids), so a
constrained row ends on EOS exactly when the grammar accepts.

xgrammar (and the transformers it imports) loads on first use: a server that never sees a
constrained request never pays for it.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence

import torch

from kvserve import kernels
from kvserve.loading.tokenizer import Tokenizer
from kvserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

DEFAULT_CACHE_SIZE = 64  # compiled grammars kept (a JSON schema's is ~0.2-0.3 MB for Gemma's vocabulary)
# xgrammar's own cache beneath ours (it also caches the pieces grammars share).
XGRAMMAR_CACHE_BYTES = 128 * 2**20
# Whitespace characters allowed between two JSON tokens (unless disable_any_whitespace: none).
# Unbounded (xgrammar's and vLLM's default), a small model sampled at temperature 1 often emits
# newlines until max_tokens; 8 still lets it indent three levels by two spaces.
MAX_JSON_WHITESPACE = 8
# "[09:01:02] /project/cpp/regex_converter.cc:94: " before xgrammar's messages: not the client's business.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _xgr() -> Any:
    import xgrammar  # heavy (imports transformers): only once a constrained request comes

    return xgrammar


class GrammarError(ValueError):
    """A constraint that cannot become a grammar (a bad schema, regex or EBNF); the message
    starts with `field`, the constraint's name (structured_outputs.regex, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


def _vocab_type(vocab: dict[str, int]) -> tuple[str, str | None]:
    """(xgrammar VocabType name, the space marker of a word-initial token or None), from the
    vocabulary itself: SentencePiece-style byte fallback spells bytes as <0x0A> and spaces as
    "▁" (Gemma, Llama 2); byte-level BPE spells every byte with GPT-2's 256-character alphabet
    and spaces as "Ġ" (Llama 3, Qwen2); anything else is raw text."""
    if sum(f"<0x{b:02X}>" in vocab for b in range(256)) >= 128:
        return "BYTE_FALLBACK", "▁"
    alphabet = _byte_level_alphabet()
    if sum(c in vocab for c in alphabet) >= 128 and \
            sum(all(c in alphabet for c in t) for t in vocab) >= 0.99 * len(vocab):
        return "BYTE_LEVEL", "Ġ"
    return "RAW", None


def _byte_level_alphabet() -> frozenset[str]:
    """GPT-2's byte-to-unicode characters: printable bytes stand for themselves, the other 68
    are shifted to U+0100.."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [256 + i for i in range(256 - len(kept))]
    return frozenset(chr(c) for c in kept + shifted)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> "xgrammar.TokenizerInfo":
    """xgrammar's view of the vocabulary, `vocab_size` wide (the logits' width, which may exceed
    the tokenizer's): special tokens and the padding ids are empty strings, which xgrammar never
    allows (except the EOS ids, its stop tokens), since their text is not what they decode to."""
    xgr = _xgr()
    vocab = tokenizer.get_vocab()
    encoded = [""] * vocab_size
    for token, i in vocab.items():
        if i < vocab_size:
            encoded[i] = token
    for i in tokenizer.special_token_ids():
        if i < vocab_size:
            encoded[i] = ""
    kind, space = _vocab_type(vocab)
    first = tokenizer.encode("a", add_special_tokens=False)
    # A tokenizer that prepends a space to the text marks its first token as a word start.
    prefix_space = bool(space and first and (tokenizer.id_to_token(first[0]) or "").startswith(space))
    stops = [t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size]
    return xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, kind), vocab_size=vocab_size,
                             stop_token_ids=stops or None, add_prefix_space=prefix_space)


def _field(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind}"


def _clean(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc)).strip()


def choice_ebnf(choices: Sequence[str]) -> str:
    """One rule matching exactly one of the strings (EBNF literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The constraint as an xgrammar Grammar (cheap: no vocabulary work). Raises GrammarError."""
    xgr = _xgr()
    kind = params.kind
    try:
        if kind == "json":
            _check_schema_text(params.spec)
            return _json_strings_fixed(xgr.Grammar.from_json_schema(params.spec, strict_mode=True,
                                                                    **_whitespace(params)))
        if kind == "json_object":  # any object: not strict (which would forbid every property)
            return _json_strings_fixed(xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                                    **_whitespace(params)))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(_field(params), f"cannot be compiled: {_clean(e)}") from None


# xgrammar (0.2.9) writes the characters of a length-bounded string (minLength / maxLength) as
# [^"\\\r\n], which lets raw control characters into a JSON string (JSON forbids U+0000-U+001F
# there; its unbounded strings exclude them): such grammars are rewritten with JSON's class.
_BOUNDED_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\"\\\0-\x1f]'


def _json_strings_fixed(grammar: "xgrammar.Grammar") -> "xgrammar.Grammar":
    text = str(grammar)
    if _BOUNDED_CHARS not in text:
        return grammar
    return _xgr().Grammar.from_ebnf(text.replace(_BOUNDED_CHARS, _JSON_CHARS))


def _whitespace(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:  # one line, ", " and ": " as separators
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _check_schema_text(text: str) -> None:
    """A schema must be JSON and an object or a boolean (JSON Schema's two forms)."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError("structured_outputs.json", f"is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("structured_outputs.json", f"must be a JSON object, got {type(schema).__name__}")


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def draft_masks(self, tokens: Sequence[int], vocab_size: int) -> tuple[torch.Tensor, int]:
        """The tokens allowed at each position of a speculative draft, and how many of its
        leading tokens the grammar accepts (n). Masks: [len(tokens) + 1, ceil(V / 32)] int32, row
        j the mask after drafts 0..j-1. Rows past n allow every token: the mask of row n forbids
        draft n, so no verification keeps it and the rows after it are never read (nor the rows
        after a stop token, where the sequence ends). The matcher ends where it started."""
        m = self.matcher
        bitmask = torch.full(_xgr().get_bitmask_shape(len(tokens) + 1, vocab_size), -1, dtype=torch.int32)
        n = 0
        try:
            m.fill_next_token_bitmask(bitmask, 0)
            for token in tokens:
                if m.is_terminated() or not m.accept_token(token):
                    break
                n += 1
                if not m.is_terminated():
                    m.fill_next_token_bitmask(bitmask, n)
        finally:
            if n:
                m.rollback(n)
        return bitmask, n


class GrammarBackend:
    """Compiles constraints for one tokenizer (cached by constraint) and makes matchers.
    Thread-safe: the server compiles off the event loop while the engine thread steps."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE,
                 max_threads: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.max_threads = max_threads
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                info = tokenizer_info(self.tokenizer, self.vocab_size)
                self._compiler = _xgr().GrammarCompiler(info, max_threads=self.max_threads,
                                                        cache_limit_bytes=XGRAMMAR_CACHE_BYTES)
            return self._compiler

    def cached(self, params: StructuredOutputsParams) -> Any | None:
        """The compiled grammar if it is in the cache (no compiling)."""
        with self._lock:
            compiled = self._cache.get(params.key)
            if compiled is not None:
                self._cache.move_to_end(params.key)
            return compiled

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise GrammarError if the constraint cannot compile (a cache hit, or the conversion
        to a grammar alone: milliseconds, no vocabulary work)."""
        if self.cached(params) is None:
            build_grammar(params)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached). Raises GrammarError."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        grammar = build_grammar(params)
        compiler = self._get_compiler()
        try:
            compiled = compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(_field(params), f"cannot be compiled: {_clean(e)}") from None
        with self._lock:
            self._cache[params.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, compiled: Any) -> GrammarState:
        return GrammarState(_xgr().GrammarMatcher(compiled))


def token_bitmask(states: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor:
    """[N, ceil(V / 32)] int32: the tokens each row's grammar allows next (bit v % 32 of word
    v // 32), every token for a row without a state."""
    # All ones (-1): every token allowed. (xgrammar's allocate_token_bitmask fills from a tensor
    # scalar, ~100x slower than this.)
    bitmask = torch.full(_xgr().get_bitmask_shape(len(states), vocab_size), -1, dtype=torch.int32)
    for i, state in enumerate(states):
        if state is not None:
            state.fill(bitmask, i)
    return bitmask


def apply_masks(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Set to -inf, in place, every token the row's grammar forbids next (rows without a state
    are left alone). logits: [N, V]."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if rows:
        kernels.apply_token_bitmask(logits, token_bitmask(states, logits.shape[1]), rows)
