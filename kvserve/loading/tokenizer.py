"""Tokenizer: a `tokenizers.Tokenizer` (fast, Rust) plus the few facts generation needs.

HF folders ship `tokenizer.json`; for GGUF files it is converted once from the GGUF
vocabulary with transformers' GGUF converter (so ids equal HF's exactly) and cached.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

import tokenizers

from kvserve.kernels.host_memory import release_freed_memory
from kvserve.loading.cache import replace_atomically
from kvserve.loading.errors import ModelLoadError


class Tokenizer:
    def __init__(self, tk: tokenizers.Tokenizer, eos_token_ids: Sequence[int], bos_token_id: int | None):
        self._tk = tk
        self.eos_token_ids = list(eos_token_ids)
        self.bos_token_id = bos_token_id

    @classmethod
    def from_file(cls, path: Path, eos_token_ids: Sequence[int], bos_token_id: int | None) -> "Tokenizer":
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


def convert_gguf_tokenizer(gguf_path: Path, out_path: Path) -> None:
    """One-time conversion of a GGUF vocabulary to tokenizer.json (needs `transformers`)."""
    try:
        from transformers import (
            AutoTokenizer,  # heavy; imported only for this conversion
        )
    except ImportError:
        raise ModelLoadError(
            gguf_path, "converting its tokenizer (once per file) needs the 'transformers' package: "
            "pip install 'kvserve[convert]'"
        ) from None

    # Convert from a folder holding only a link to the GGUF: a tokenizer.json lying beside the
    # file would otherwise be picked up by transformers instead of the GGUF's own vocabulary.
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / gguf_path.name
        link.symlink_to(gguf_path.resolve())
        try:
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=link.name)
        except Exception as e:
            raise ModelLoadError(gguf_path, f"cannot build a tokenizer from its vocabulary ({e})") from None
    replace_atomically(out_path, lambda tmp: tok.backend_tokenizer.save(str(tmp)))
