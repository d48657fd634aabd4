"""`kvserve draft-vocab`: rank a model's tokens by their frequency in a corpus and write the
file that `--draft-vocab` reads (kvserve/speculative/draft_vocab.py): a draft's head then scores
only the most frequent of them."""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

from kvserve.argtypes import positive_int
from kvserve.loading import load_model
from kvserve.paths import WIKITEXT2_VALID, wikitext2_file
from kvserve.speculative.draft_vocab import rank_tokens, write_draft_vocab

CHUNK_CHARS = 1 << 20  # text encoded at a time: memory stays bounded on a large corpus


def add_draft_vocab_parser(sub) -> None:
    """Register `kvserve draft-vocab` on the top-level subparsers `sub`."""
    p = sub.add_parser("draft-vocab", help="rank tokens by frequency in a corpus: a draft head's vocabulary subset")
    p.add_argument("--model", default=None, help="GGUF file or HF folder whose tokenizer counts (default: bundled)")
    p.add_argument("--corpus", default=None,
                   help="text file to count tokens in (default: WikiText-2 validation under $KVSERVE_DATA)")
    p.add_argument("--size", type=positive_int, default=32768, help="how many of the most frequent ids to keep")
    p.add_argument("--out", required=True, help="JSON file to write (--draft-vocab reads it)")


def _chunks(path: Path) -> Iterator[str]:
    """The file's text in pieces of about CHUNK_CHARS, cut at line ends."""
    buf: list[str] = []
    size = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= CHUNK_CHARS:
                yield "".join(buf)
                buf, size = [], 0
    if buf:
        yield "".join(buf)


def run(args: argparse.Namespace) -> int:
    corpus = Path(args.corpus) if args.corpus else wikitext2_file(WIKITEXT2_VALID, flag="--corpus")
    if not corpus.is_file():
        raise ValueError(f"--corpus: {corpus} is not a file")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out: folder {out.parent} does not exist")
    loaded = load_model(args.model, gguf_blocks=str(args.model or "").endswith(".gguf"))
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    streams = (tok.encode(text, add_special_tokens=False) for text in _chunks(corpus))
    ids = rank_tokens(streams, args.size, vocab, always=tok.eos_token_ids)
    write_draft_vocab(out, ids, vocab, source=corpus.name)
    print(f"wrote {out}: the {len(ids)} most frequent of {vocab} tokens in {corpus}")
    return 0
