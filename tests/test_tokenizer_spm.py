"""The SentencePiece tokenizer built from a GGUF vocabulary (kvserve/loading/tokenizer.py) against
the oracle: transformers' own tokenizer converted from the same GGUF (ids, text, vocabulary)."""
from __future__ import annotations

import random

import pytest

from conftest import WIKITEXT
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf import _tokenizer_meta, open_gguf
from kvserve.loading.tokenizer import SentencePieceTokenizer, Tokenizer, sentencepiece_model, write_gguf_tokenizer
from kvserve.sampling.detokenizer import IncrementalDetokenizer

EDGE_TEXTS = [
    "", " ", "  ", "   leading spaces", "trailing   ", "a\n\nb\n\n\n\nc", "\t tab\tand\r\nCRLF",
    "emoji 🦙 and ✓ and 👩‍👩‍👧", "日本語のテキスト、中文、한국어", "control \x00 \x07 \x7f bytes",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "<eos><eos>x<bos>",
    "<start_of_turn", "<<bos>>", "x<unused12>y<unused6241>", "<table><td>cell</td></table>", "[multimodal]",
    "  <b>  bold</b>  ", "\n\n\n\n\n\n\n\n", " " * 40 + "deep", "<unk> and <pad> and <mask>",
    "<start_of_image>", "a  b   c    d     e", "Über naïve façade — “quotes” … ½", "x" * 300,
    "<0x41> is not a byte", " \u2581 \u2581\u2581 x", "tabs\t\t\t and mixed \t \t",
]


@pytest.fixture(scope="module")
def meta(gemma_path):
    return _tokenizer_meta(open_gguf(gemma_path), gemma_path)


@pytest.fixture(scope="module")
def spm(meta, gemma_path, tmp_path_factory):
    out = write_gguf_tokenizer(gemma_path, meta, "gemma3", tmp_path_factory.mktemp("spm"))
    assert out.name == "tokenizer.model"
    tok = Tokenizer.from_file(out, [1, 106], 2, gguf_source=gemma_path, add_bos=True)
    assert isinstance(tok, SentencePieceTokenizer)
    return tok


@pytest.fixture(scope="module")
def hf(hf_gemma_tokenizer):
    return hf_gemma_tokenizer.backend_tokenizer  # transformers' conversion of the same GGUF


def test_wikitext_ids_equal_hf(spm, hf):
    text = (WIKITEXT / "wiki.test.raw").read_text()
    assert spm.encode(text) == hf.encode(text).ids


@pytest.mark.parametrize("add_special", [True, False])
def test_edge_texts_equal_hf(spm, hf, add_special):
    for text in EDGE_TEXTS:
        assert spm.encode(text, add_special_tokens=add_special) == hf.encode(
            text, add_special_tokens=add_special).ids, repr(text)


def test_decode_equal_hf(spm, hf):
    rng = random.Random(0)
    n = spm.vocab_size
    special = sorted(spm.special_token_ids())
    byte_ids = [spm.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    cases = [hf.encode(t).ids for t in EDGE_TEXTS]
    cases += [[rng.randrange(n) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    # byte runs, valid and not, cut by special tokens (HF drops skipped ones before its decoder)
    euro = [byte_ids[b] for b in "€".encode()]
    cases += [euro, euro[:1] + [106] + euro[1:], euro[:2], [byte_ids[0xFF]] + euro, euro + [3] + euro]
    cases += [[rng.choice(special + byte_ids + [1000, 138, 107]) for _ in range(30)] for _ in range(100)]
    cases += [[1000, n, n + 7, 1001]]  # out-of-range ids are dropped
    for ids in cases:
        for skip in (True, False):
            assert spm.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_vocabulary_equals_hf(spm, hf):
    assert spm.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert spm.get_vocab() == hf.get_vocab(with_added_tokens=True)
    hf_special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    assert spm.special_token_ids() == hf_special
    for token in ["<unk>", "<start_of_turn>", "▁▁", "  ", "\n", "put", "▁the", "no-such-token-zz", "<0x0A>", ""]:
        assert spm.token_to_id(token) == hf.token_to_id(token), repr(token)
    for i in [0, 3, 5, 107, 138, 238, 1000, spm.vocab_size - 1, spm.vocab_size, -1]:
        assert spm.id_to_token(i) == (hf.id_to_token(i) if i >= 0 else None), i


def test_streamed_text_equals_decode(spm):
    rng = random.Random(1)
    ids = spm.encode("Hello 🦙 wörld<end_of_turn> naïve €5", add_special_tokens=False)
    ids += [rng.randrange(spm.vocab_size) for _ in range(200)]
    for skip in (True, False):
        detok = IncrementalDetokenizer(spm, [2], skip_special_tokens=skip)
        text = "".join(detok.add_token(t) for t in ids) + detok.flush()
        assert text == spm.decode(ids, skip_special_tokens=skip)


def test_save_json_is_the_hf_conversion(spm, hf, tmp_path):
    spm.save_json(tmp_path / "tokenizer.json")
    saved = Tokenizer.from_file(tmp_path / "tokenizer.json", [1], 2)
    for text in EDGE_TEXTS:
        assert saved.encode(text) == hf.encode(text).ids
    orphan = SentencePieceTokenizer(spm._sp, [1], 2)
    with pytest.raises(ValueError, match="gguf_source"):
        orphan.save_json(tmp_path / "other.json")


def test_no_bos_when_the_model_adds_none(spm, tmp_path, meta, gemma_path):
    out = write_gguf_tokenizer(gemma_path, meta, "gemma3", tmp_path)
    tok = Tokenizer.from_file(out, [1], 2, add_bos=False)
    assert tok.encode("Hi") == spm.encode("Hi")[1:] == spm.encode("Hi", add_special_tokens=False)


def test_other_vocabularies_take_the_hf_converter(meta):
    """Only what this reproduces exactly becomes a SentencePiece model (None: the HF conversion)."""
    assert sentencepiece_model(meta, "gemma3") is not None
    assert sentencepiece_model(meta, "llama") is None  # HF gives Llama's vocabularies a prefix space
    types = list(meta["token_type"])
    types[3] = 2  # an <unk> that is not a control token is not special in HF
    for change in [{"model": "gpt2"}, {"add_space_prefix": True}, {"add_eos_token": True}, {"pre": "llama-bpe"},
                   {"unknown_token_id": -1}, {"token_type": [1, 1]}, {"token_type": types},
                   {"unknown_token_id": "x"}, {"tokens": list(range(len(types)))}]:  # (wrong types in a file)
        assert sentencepiece_model({**meta, **change}, "gemma3") is None, next(iter(change))
    # a vocabulary that does not say add_space_prefix=false gets HF's default (a prefix space)
    assert sentencepiece_model({k: v for k, v in meta.items() if k != "add_space_prefix"}, "gemma3") is None


def test_duplicate_pieces_take_the_hf_converter(meta):
    tokens = list(meta["tokens"])
    tokens[1000] = tokens[1001]
    assert sentencepiece_model({**meta, "tokens": tokens}, "gemma3") is None


def test_corrupt_model_file_names_the_file(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"not a sentencepiece model")
    with pytest.raises(ModelLoadError, match="tokenizer.model.*SentencePiece"):
        Tokenizer.from_file(bad, [1], 2)
