"""Tokenizer: a `tokenizers.Tokenizer` (fast, Rust) plus the few facts generation needs.

HF folders ship `tokenizer.json`. A GGUF's vocabulary is converted once and cached: Gemma's
SentencePiece vocabularies become a SentencePiece BPE model (`tokenizer.model`, built from the
GGUF's pieces, their order and types; no `transformers` needed, and held in ~45 MB where the HF
tokenizer of Gemma 3's 262k entries holds ~95 MB); any other becomes a `tokenizer.json` by
transformers' GGUF converter. Both give the ids and text of transformers' conversion
(tests/test_tokenizer_spm.py).
"""
from __future__ import annotations

import functools
import re
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

import sentencepiece
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as pb

from kvserve.kernels.host_memory import release_freed_memory
from kvserve.loading.cache import replace_atomically
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf_file import GGUFFile


class Tokenizer:
    def __init__(self, tk: tokenizers.Tokenizer, eos_token_ids: Sequence[int], bos_token_id: int | None):
        self._tk = tk
        self.eos_token_ids = list(eos_token_ids)
        self.bos_token_id = bos_token_id

    @classmethod
    def from_file(cls, path: Path, eos_token_ids: Sequence[int], bos_token_id: int | None,
                  gguf_source: Path | None = None, add_bos: bool = True) -> "Tokenizer":
        """A tokenizer.json, or a tokenizer.model made from the GGUF `gguf_source` (which
        `save_json` converts when a tokenizer.json is asked for; `add_bos`: whether its encode
        starts with BOS, what a tokenizer.json's post-processor says for itself)."""
        if Path(path).suffix == ".model":
            return SentencePieceTokenizer.from_file(path, eos_token_ids, bos_token_id, gguf_source, add_bos)
        try:
            tk = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust error says little about which file
            raise ModelLoadError(path, f"not a valid tokenizer.json ({e})") from None
        release_freed_memory()  # the JSON parse's temporaries: ~200 MB for Gemma 3's vocabulary
        return cls(tk, eos_token_ids, bos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None] | None:
        """tokenizers' own incremental decoder (DecodeStream, in Rust) as a function of the next
        output id -> the text it completes (None: held back), for byte-level vocabularies only
        (GPT-2, Llama 3, Qwen2), where a piece never changes text decoded before it. Under
        SentencePiece byte fallback it can (a run of byte tokens turns into U+FFFD when a later
        byte breaks it), and DecodeStream does not hold such runs back: None there, and
        kvserve.sampling's own detokenizer serves."""
        if not isinstance(self._tk.decoder, tokenizers.decoders.ByteLevel):
            return None
        return functools.partial(tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens).step,
                                 self._tk)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def get_vocab(self) -> dict[str, int]:
        """Every token's vocabulary string (added tokens included) -> its id."""
        return self._tk.get_vocab(with_added_tokens=True)

    def special_token_ids(self) -> set[int]:
        """Ids of the added tokens marked special (what skip_special_tokens drops from text)."""
        return {i for i, t in self._tk.get_added_tokens_decoder().items() if t.special}

    def save_json(self, path: Path) -> None:
        """Write this tokenizer as a tokenizer.json (what a saved HF folder carries)."""
        self._tk.save(str(path))


class SentencePieceTokenizer(Tokenizer):
    """The same interface over a `sentencepiece` BPE model built from a GGUF vocabulary
    (`sentencepiece_model`), with HF's handling of special tokens around it: their strings in a
    text encode to their ids (leftmost, longest first), and decoding skips them or writes them out.
    SentencePiece itself would split such a string into ordinary pieces and decode a control
    piece as nothing."""

    def __init__(self, sp, eos_token_ids: Sequence[int], bos_token_id: int | None, gguf_source: Path | None = None,
                 add_bos: bool = True):
        self._sp = sp
        self.eos_token_ids = list(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.gguf_source = gguf_source
        self._prefix = [bos_token_id] if add_bos and bos_token_id is not None else []
        # Control pieces and <unk> are HF's special added tokens for such a vocabulary; byte pieces
        # ("<0x41>" -> 65) are what its decoder's byte fallback reads. One pass over the vocabulary.
        self._special_by_text: dict[str, int] = {}
        self._bytes: dict[int, int] = {}
        for i in range(sp.get_piece_size()):
            if sp.is_control(i) or sp.is_unknown(i):
                self._special_by_text[sp.id_to_piece(i)] = i
            elif sp.is_byte(i):
                self._bytes[i] = int(sp.id_to_piece(i)[3:5], 16)
        self._special = set(self._special_by_text.values())
        lengths: dict[str, set[int]] = {}
        for text in self._special_by_text:
            lengths.setdefault(text[0], set()).add(len(text))
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self._starts = re.compile("[" + "".join(re.escape(c) for c in lengths) + "]") if lengths else None

    @classmethod
    def from_file(cls, path: Path, eos_token_ids: Sequence[int], bos_token_id: int | None,
                  gguf_source: Path | None = None, add_bos: bool = True) -> "SentencePieceTokenizer":
        try:
            sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(path, f"not a valid SentencePiece model ({e})") from None
        return cls(sp, eos_token_ids, bos_token_id, gguf_source, add_bos)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def decode_stream(self, skip_special_tokens: bool = True) -> None:
        """None: SentencePiece's byte fallback needs kvserve.sampling's own detokenizer."""
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._prefix) if add_special_tokens else []
        for part, special_id in self._split_special(text):
            if special_id is not None:
                ids.append(special_id)
            else:
                ids.extend(self._sp.encode(part))
        return ids

    def _split_special(self, text: str) -> Iterator[tuple[str, int | None]]:
        """(text, None) runs and (special token text, its id) in order, leftmost-longest."""
        start = done = 0
        while self._starts is not None and (m := self._starts.search(text, start)):
            at = m.start()
            hit = next((text[at:at + n] for n in self._lengths[text[at]] if text[at:at + n] in self._special_by_text),
                       None)
            if hit is None:
                start = at + 1
                continue
            if at > done:
                yield text[done:at], None
            yield hit, self._special_by_text[hit]
            start = done = at + len(hit)
        if done < len(text):
            yield text[done:], None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """HF's decoder for these vocabularies, token by token: U+2581 -> space, a run of byte
        tokens -> its UTF-8 text (one U+FFFD per byte if the run is not valid UTF-8: HF's byte
        fallback, where SentencePiece would keep a run's valid characters), special tokens
        dropped before any of this, or written out; ids outside the vocabulary dropped, as HF does."""
        parts: list[str] = []
        run = bytearray()  # byte tokens not yet turned into text
        n = self._sp.get_piece_size()
        for i in ids:
            i = int(i)
            if not 0 <= i < n or (skip_special_tokens and i in self._special):
                continue
            byte = self._bytes.get(i)
            if byte is not None:
                run.append(byte)
                continue
            if run:
                parts.append(_byte_run_text(run))
                run.clear()
            parts.append(self._sp.id_to_piece(i).replace("\u2581", " "))
        if run:
            parts.append(_byte_run_text(run))
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self._sp.get_piece_size() else None

    def get_vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    def special_token_ids(self) -> set[int]:
        return set(self._special)

    def save_json(self, path: Path) -> None:
        if self.gguf_source is None:
            raise ValueError("a SentencePiece tokenizer writes a tokenizer.json only from its GGUF file "
                             "(gguf_source)")
        convert_gguf_tokenizer(self.gguf_source, Path(path))


def _byte_run_text(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


# SentencePiece piece types (sentencepiece_model.proto), the same numbers as GGUF's token types.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


# The architectures whose GGUF vocabulary transformers' converter builds as Gemma's tokenizer.
GEMMA_VOCABULARIES = ("gemma", "gemma2", "gemma3")


def sentencepiece_model(meta: dict, architecture: str) -> bytes | None:
    """A GGUF vocabulary as a serialized SentencePiece BPE model that encodes and decodes as
    transformers' conversion of it does, or None where that is not established: Gemma's
    vocabularies (`tokenizer.ggml.model` "llama", no prefix space, no EOS appended). `meta`: the
    tokenizer.ggml.* values by key without the prefix.

    What the conversion does, done the same way: a token of spaces alone is spelled with U+2581
    (the files store real spaces) and is an ordinary piece; merges go by the tokens' order in
    the file (the file's scores do not follow it), so each piece's score is minus its index;
    control tokens are the special ones, and user-defined tokens are matched whole."""
    if (architecture not in GEMMA_VOCABULARIES or meta.get("model") != "llama" or meta.get("add_space_prefix", True)
            or meta.get("add_eos_token", False) or meta.get("pre", "default") != "default"):
        return None
    try:  # values of the wrong type (a file's, not ours) leave the vocabulary to HF's converter too
        blob = _model_proto(meta)
    except (TypeError, ValueError):
        return None
    if blob is None:
        return None
    try:  # SentencePiece refuses what it cannot load (duplicate pieces, say): HF's converter then
        sentencepiece.SentencePieceProcessor(model_proto=blob)
    except RuntimeError:
        return None
    return blob


def _model_proto(meta: dict) -> bytes | None:
    """`sentencepiece_model`'s serialized proto, None where the vocabulary lacks what it needs."""
    tokens, types = meta.get("tokens"), meta.get("token_type")
    if not tokens or types is None or len(tokens) != len(types):
        return None
    unk = int(meta.get("unknown_token_id", -1))
    if not 0 <= unk < len(tokens) or int(types[unk]) != _CONTROL:  # (then <unk> is special, as in HF)
        return None
    m = pb.ModelProto()
    spec = m.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = any(int(t) == _BYTE for t in types)
    # SentencePiece finds its special ids by piece text (its defaults: "<unk>", "<s>", "</s>",
    # "<pad>"); the ids themselves are the trainer's. Whether encode() adds BOS is the loader's
    # add_bos (the model config's add_bos_token).
    for role, key in (("unk", "unknown_token_id"), ("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("pad", "padding_token_id")):
        i = int(meta.get(key, -1))
        setattr(spec, f"{role}_id", i if 0 <= i < len(tokens) else -1)
        if 0 <= i < len(tokens):
            setattr(spec, f"{role}_piece", tokens[i])
    norm = m.normalizer_spec
    norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces, norm.escape_whitespaces = "identity", False, False, True
    for i, (text, kind) in enumerate(zip(tokens, types)):
        kind = _UNKNOWN if i == unk else int(kind)
        if " " in text and not text.strip():
            text, kind = "\u2581" * len(text), _NORMAL if kind == _USER_DEFINED else kind
        piece = m.pieces.add()
        piece.piece, piece.score, piece.type = text, float(-i), kind
    return m.SerializeToString()


def write_gguf_tokenizer(gguf_path: Path, meta: dict, architecture: str, folder: Path) -> Path:
    """The GGUF's tokenizer written into `folder` once: tokenizer.model where
    `sentencepiece_model` applies, else tokenizer.json (transformers' converter). -> its path."""
    blob = sentencepiece_model(meta, architecture)
    if blob is None:
        out = folder / "tokenizer.json"
        convert_gguf_tokenizer(gguf_path, out, architecture)
        return out
    out = folder / "tokenizer.model"
    replace_atomically(out, lambda tmp: Path(tmp).write_bytes(blob))
    return out


def cached_gguf_tokenizer(folder: Path) -> Path | None:
    """The tokenizer file `write_gguf_tokenizer` left in `folder`, if any."""
    return next((f for f in (folder / "tokenizer.model", folder / "tokenizer.json") if f.exists()), None)


# The transformers 5 tokenizer class that AutoTokenizer picks for a GGUF file of each architecture
# (tests/test_tokenizer_spm.py and tests/test_gguf_archs.py hold the two equal). Naming it spares
# AutoTokenizer's first step, which reads all of the file's metadata with gguf-py's reader only to
# find the model type: for a 262k vocabulary ~16 of 18.7 s (docs/ARCHITECTURE.md). transformers
# 4 names its fast classes otherwise, so there AutoTokenizer chooses.
HF_TOKENIZER_CLASSES = {"gemma3": "GemmaTokenizer", "llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer",
                        "qwen3": "Qwen2Tokenizer", "qwen2moe": "Qwen2Tokenizer", "qwen3moe": "Qwen2Tokenizer"}


def _architecture(gguf_path: Path) -> str | None:
    """general.architecture of a GGUF file (its header alone), None where it cannot be read:
    AutoTokenizer then reads the file and says what is wrong with it."""
    try:
        arch = GGUFFile(gguf_path, values=False).fields.get("general.architecture")
    except (OSError, ValueError, struct.error):
        return None
    return arch if isinstance(arch, str) else None


def convert_gguf_tokenizer(gguf_path: Path, out_path: Path, architecture: str | None = None) -> None:
    """One-time conversion of a GGUF vocabulary to tokenizer.json by transformers' own converter
    (needs `transformers`). `architecture`, the file's general.architecture (read from its header
    when not given), names the tokenizer class; AutoTokenizer finds any other."""
    try:
        import transformers  # heavy; imported only for this conversion
    except ImportError:
        raise ModelLoadError(
            gguf_path, "converting its tokenizer (once per file) needs the 'transformers' package: "
            "pip install 'kvserve[convert]'"
        ) from None
    if architecture is None:
        architecture = _architecture(gguf_path)
    major = int(transformers.__version__.split(".")[0])
    named = HF_TOKENIZER_CLASSES.get(architecture, "") if major >= 5 else ""
    cls = getattr(transformers, named, None) or transformers.AutoTokenizer

    # Convert from a folder holding only a link to the GGUF: a tokenizer.json lying beside the
    # file would otherwise be picked up by transformers instead of the GGUF's own vocabulary.
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / gguf_path.name
        link.symlink_to(gguf_path.resolve())
        try:
            tok = cls.from_pretrained(tmp, gguf_file=link.name)
        except Exception as e:
            raise ModelLoadError(gguf_path, f"cannot build a tokenizer from its vocabulary ({e})") from None
    replace_atomically(out_path, lambda tmp: tok.backend_tokenizer.save(str(tmp)))
