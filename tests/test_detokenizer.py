"""IncrementalDetokenizer and StopChecker against full decodes, with in-memory tokenizers."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from kvserve.loading.tokenizer import Tokenizer as KvTokenizer
from kvserve.sampling import IncrementalDetokenizer, StopChecker, StreamDetokenizer, make_detokenizer
from kvserve.sampling_params import SamplingParams

TEXT = [
    "Hello world, the café is naïve and the résumé is ready.",
    "Émile déjà vu: über Straße, año, smörgåsbord, Ελληνικά, русский текст.",
    "日本語のテキストと中文文本，还有한국어 문장입니다。",
    "Emoji time 😀🎉👍🏽 and flags 🇫🇷🇯🇵, math ∑∫√ and arrows → ← ↑.",
    "The quick brown fox jumps over the lazy dog 1234567890 times!",
    "   leading spaces,\ttabs\nand newlines\n\n  indented   text ",
]
SPECIALS = ["<unk>", "<eos>", "<bos>"]
ALPHABET = "".join(sorted(set("".join(TEXT)))) + "🙂世界€"


# ---------------------------------------------------------------- tokenizers built in memory


@functools.cache
def byte_level_bpe() -> Tokenizer:
    """GPT-2 style: byte-level pre-tokenizer and decoder; merges can split UTF-8 characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 3, trainer)
    return tok


def _sentencepiece_vocab() -> list[tuple[str, float]]:
    """Unigram pieces: specials, the 256 byte-fallback tokens, some chars and words.

    A few characters (e.g. the emoji, some CJK) are left out so they need byte fallback.
    """
    pieces = [(s, 0.0) for s in SPECIALS] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    chars = sorted({c for c in "".join(TEXT) if not c.isspace()} - set("😀🎉👍🏽🇫🇷🇯🇵語한"))
    pieces += [("▁", -2.0)] + [(c, -5.0) for c in chars]
    words = sorted({w for line in TEXT for w in line.split()})
    pieces += [("▁" + w, -3.0) for w in words] + [(w[:3], -4.0) for w in words if len(w) > 3]
    seen: set[str] = set()
    return [p for p in pieces if not (p[0] in seen or seen.add(p[0]))]


def _sentencepiece(decoder: decoders.Decoder, metaspace_pretok: bool) -> Tokenizer:
    tok = Tokenizer(models.Unigram(_sentencepiece_vocab(), 0, True))
    if metaspace_pretok:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    else:  # Gemma: spaces become ▁ without a prefix space
        tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoder
    tok.add_special_tokens(SPECIALS)
    return tok


@functools.cache
def metaspace_sp() -> Tokenizer:
    """SentencePiece-like with Metaspace decoder (strips the first token's leading space)."""
    return _sentencepiece(decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()]), True)


@functools.cache
def llama_sp() -> Tokenizer:
    """Llama-style decoder chain: Replace, ByteFallback, Fuse, Strip(1 leading space)."""
    chain = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    return _sentencepiece(decoders.Sequence(chain), True)


@functools.cache
def gemma_sp() -> Tokenizer:
    """Gemma-style: Replace, ByteFallback, Fuse; no space stripping."""
    chain = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return _sentencepiece(decoders.Sequence(chain), False)


TOKENIZERS = {"byte_level_bpe": byte_level_bpe, "metaspace_sp": metaspace_sp, "llama_sp": llama_sp, "gemma_sp": gemma_sp}


def test_tokenizers_cover_the_tricky_cases() -> None:
    """Sanity: the fixtures really split characters / fall back to bytes."""
    bpe = byte_level_bpe()
    ids = bpe.encode("😀🎉").ids
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # a token holding part of a character
    sp = gemma_sp()
    enc = sp.encode("fox 😀 語")
    assert "<0xF0>" in enc.tokens and sp.decode(enc.ids) == "fox 😀 語"
    assert metaspace_sp().decode(metaspace_sp().encode(" hi there").ids) == "hi there"


# ---------------------------------------------------------------- detokenizer properties


def stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    """Feed ids one by one; check every prefix of the stream against the full decode."""
    full = tok.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, [5, 6, 7], skip_special_tokens=skip)
    deltas, streamed = [], ""
    for t in ids:
        delta = detok.add_token(t)
        deltas.append(delta)
        streamed += delta
        assert full.startswith(streamed), (streamed, full)
        assert detok.text == streamed
    deltas.append(detok.flush())
    assert "".join(deltas) == full
    assert detok.text == full
    return deltas


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_to_full_decode(name: str, data: st.DataObject, skip: bool) -> None:
    tok = TOKENIZERS[name]()
    any_id = st.integers(0, tok.get_vocab_size() - 1)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(_interesting_ids(name))), max_size=40))
    stream(tok, ids, skip)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_byte_level_vocabularies_stream_through_tokenizers_own_decoder(data: st.DataObject, skip: bool) -> None:
    """kvserve's Tokenizer offers DecodeStream for a byte-level vocabulary: the same contract
    (every step a prefix of the full decode, the deltas and the flush equal to it)."""
    raw = byte_level_bpe()
    tok = KvTokenizer(raw, [1], 2)
    any_id = st.integers(0, raw.get_vocab_size() - 1)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(_interesting_ids("byte_level_bpe"))), max_size=40))
    full = raw.decode(ids, skip_special_tokens=skip)
    detok = make_detokenizer(tok, [5, 6], skip)
    assert isinstance(detok, StreamDetokenizer)
    streamed = ""
    for t in ids:
        streamed += detok.add_token(t)
        assert full.startswith(streamed), (streamed, full)
        assert detok.text == streamed
    assert streamed + detok.flush() == full == detok.text
    assert detok.flush() == ""


def test_a_character_left_incomplete_comes_out_at_the_flush() -> None:
    raw = byte_level_bpe()
    partial = next(i for i in raw.encode("😀🎉").ids if "\ufffd" in raw.decode([i]))
    detok = make_detokenizer(KvTokenizer(raw, [1], 2), [])
    assert detok.add_token(partial) == ""
    assert detok.flush() == raw.decode([partial]) and detok.text.endswith("\ufffd")


@pytest.mark.parametrize("name", [n for n in TOKENIZERS if n != "byte_level_bpe"])
def test_byte_fallback_vocabularies_keep_the_own_detokenizer(name: str) -> None:
    """DecodeStream gives out text that a later byte token turns into U+FFFD under SentencePiece
    byte fallback; those vocabularies keep IncrementalDetokenizer."""
    tok = KvTokenizer(TOKENIZERS[name](), [1], 2)
    assert tok.decode_stream() is None
    assert isinstance(make_detokenizer(tok, []), IncrementalDetokenizer)


@functools.cache
def _interesting_ids(name: str) -> list[int]:
    """Specials plus tokens that carry bytes of multi-byte characters: where bugs hide."""
    tok = TOKENIZERS[name]()
    ids = [tok.token_to_id(s) for s in SPECIALS]
    for b in (0x41, 0x80, 0x82, 0x98, 0x9F, 0xA9, 0xAC, 0xC3, 0xE2, 0xF0):
        tid = tok.token_to_id(f"<0x{b:02X}>")
        if tid is not None:
            ids.append(tid)
    ids += [i for i in range(tok.get_vocab_size()) if "\ufffd" in tok.decode([i])][:20]
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_skipped_special_token_does_not_end_a_byte_run(skip: bool) -> None:
    tok = gemma_sp()
    a, cont, eos, fox = (tok.token_to_id(t) for t in ("<0x41>", "<0x80>", "<eos>", "▁fox"))
    # With skip_special_tokens the decoder sees <0x41><0x80>: one invalid run -> two U+FFFD.
    deltas = stream(tok, [a, eos, cont, fox], skip)
    assert "".join(deltas) == ("\ufffd\ufffd fox" if skip else "A<eos>\ufffd fox")


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=60))
def test_real_text_never_streams_replacement_chars(name: str, text: str) -> None:
    tok = TOKENIZERS[name]()
    ids = tok.encode(text).ids
    deltas = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multibyte_characters_are_held_until_complete(name: str) -> None:
    tok = TOKENIZERS[name]()
    ids = tok.encode("a😀🎉b").ids
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all(d in ("",) or "\ufffd" not in d for d in deltas)
    assert len(ids) > 3  # the emoji really took several tokens


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner: Tokenizer):
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_decode_window_is_constant_size(name: str) -> None:
    tok = TOKENIZERS[name]()
    ids = tok.encode(" ".join(TEXT * 8)).ids
    assert len(ids) > 500
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, [])
    text = "".join(detok.add_token(t) for t in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(counting.lengths) <= 16


def test_leading_space_tokens_keep_their_space() -> None:
    tok = metaspace_sp()
    ids = tok.encode("the quick brown fox").ids
    deltas = [d for d in stream(tok, ids) if d]
    assert deltas[0] == "the" and " quick" in deltas and " fox" in deltas


def test_tokenizer_without_token_lookup() -> None:
    """Only `decode` is required; without byte-token knowledge U+FFFD hold-back still works."""

    class DecodeOnly:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return byte_level_bpe().decode(ids, skip_special_tokens=skip_special_tokens)

    ids = byte_level_bpe().encode("naïve 😀 日本語").ids
    detok = IncrementalDetokenizer(DecodeOnly(), [])
    deltas = [detok.add_token(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == "naïve 😀 日本語"
    assert all("\ufffd" not in d for d in deltas)


# ---------------------------------------------------------------- stop checker

EOS = 1


def run_checker(params: SamplingParams, deltas: list[str], tokens: list[int] | None = None, max_model_len: int = 10_000):
    """Feed deltas (token ids default to 100+i); return (results, streamed text, checker)."""
    checker = StopChecker(params, [EOS], max_model_len)
    tokens = tokens or [100 + i for i in range(len(deltas))]
    results, streamed = [], ""
    for i, (tok, delta) in enumerate(zip(tokens, deltas)):
        res = checker.check(tok, delta, i + 1, 5 + i + 1)
        results.append(res)
        streamed += res.emit
        if res.finished:
            break
    return results, streamed, checker


def test_stop_string_spanning_tokens() -> None:
    results, streamed, checker = run_checker(SamplingParams(stop=["o w"], max_tokens=None), ["Hel", "lo", " wo", "rld"])
    final = results[-1]
    assert (final.finished, final.reason, final.stop_reason) == (True, "stop", "o w")
    assert len(results) == 3
    assert streamed == checker.final_text() == "Hell"
    assert [r.emit for r in results] == ["Hel", "l", ""]  # "o" held back: it may start "o w"


def test_include_stop_str_in_output() -> None:
    params = SamplingParams(stop=["o w"], include_stop_str_in_output=True, max_tokens=None)
    results, streamed, checker = run_checker(params, ["Hel", "lo", " wo", "rld"])
    assert streamed == checker.final_text() == "Hello w"
    assert results[-1].stop_reason == "o w"


def test_earliest_stop_string_wins() -> None:
    results, streamed, _ = run_checker(SamplingParams(stop=["cd", "b"], max_tokens=None), ["xabcd"])
    assert (results[-1].stop_reason, streamed) == ("b", "xa")


def test_eos_and_stop_tokens() -> None:
    res, streamed, _ = run_checker(SamplingParams(), ["a", "b", "<eos>"], [7, 8, EOS])
    assert (res[-1].reason, res[-1].stop_reason, streamed) == ("stop", None, "ab")
    res, streamed, _ = run_checker(SamplingParams(stop_token_ids=[9]), ["a", "X", "b"], [7, 9, 8])
    assert (res[-1].reason, res[-1].stop_reason, streamed, len(res)) == ("stop", 9, "a", 2)
    params = SamplingParams(stop_token_ids=[9], include_stop_str_in_output=True)
    assert run_checker(params, ["a", "X"], [7, 9])[1] == "aX"


def test_ignore_eos_and_min_tokens() -> None:
    res, streamed, _ = run_checker(SamplingParams(ignore_eos=True, max_tokens=4), ["a", "", "b", "c"], [7, EOS, 8, 8])
    assert (res[-1].reason, len(res), streamed) == ("length", 4, "abc")
    res, _, _ = run_checker(SamplingParams(min_tokens=3), ["a", "", "", ""], [7, EOS, EOS, EOS])
    assert (len(res), res[-1].reason) == (3, "stop")
    res, _, _ = run_checker(SamplingParams(min_tokens=3, stop=["a"]), ["a", "b", "a"])
    assert (len(res), res[-1].stop_reason) == (3, "a")


def test_length_limits_flush_held_text() -> None:
    res, streamed, checker = run_checker(SamplingParams(stop=["xyz"], max_tokens=2), ["ab", "cx"])
    assert (res[-1].reason, res[-1].stop_reason, res[0].emit) == ("length", None, "ab")
    assert streamed == checker.final_text() == "abcx"
    res, _, _ = run_checker(SamplingParams(max_tokens=None), ["a"] * 10, max_model_len=9)
    assert (len(res), res[-1].reason) == (4, "length")  # prompt of 5 + 4 outputs


def test_check_after_finish_is_an_error() -> None:
    checker = StopChecker(SamplingParams(max_tokens=1), [EOS], 100)
    assert checker.check(5, "a", 1, 2).finished
    with pytest.raises(RuntimeError):
        checker.check(5, "a", 2, 3)


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Truncate at the stop string occurrence that completes first (ties: earliest start)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s) if include else i], s


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="abc ", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_streamed_text_equals_final_text(chunks: list[str], stops: list[str], include: bool) -> None:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=None)
    results, streamed, checker = run_checker(params, chunks, max_model_len=10_000)
    expected, stop = _reference_stop("".join(chunks), stops, include)
    if stop is None:
        assert not results or not results[-1].finished
        # Not finished: final_text() adds the held-back (possible stop prefix) text.
        assert checker.final_text() == expected and expected.startswith(streamed)
    else:
        assert results[-1].finished and results[-1].stop_reason == stop
        assert streamed == checker.final_text() == expected


@pytest.mark.parametrize("name", ["byte_level_bpe", "gemma_sp"])
@pytest.mark.parametrize("include", [False, True])
def test_detokenizer_and_stop_checker_together(name: str, include: bool) -> None:
    tok = TOKENIZERS[name]()
    text = "Emoji time 😀🎉 and 日本語 STOP here 😀 never seen"
    ids = tok.encode(text).ids
    params = SamplingParams(stop=["P her", "zzz"], include_stop_str_in_output=include, max_tokens=None)
    detok = IncrementalDetokenizer(tok, [])
    checker = StopChecker(params, [EOS], 10_000)
    streamed = ""
    for n, t in enumerate(ids, 1):
        res = checker.check(t, detok.add_token(t), n, n)
        streamed += res.emit
        if res.finished:
            break
    assert res.finished and res.stop_reason == "P her"
    expected = "Emoji time 😀🎉 and 日本語 STOP her" if include else "Emoji time 😀🎉 and 日本語 STO"
    assert streamed == checker.final_text() == expected


def _reference_held(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="ab", max_size=3), max_size=12),
    stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=5), min_size=1, max_size=6),
    min_tokens=st.integers(0, 6),
)
def test_each_step_streams_all_but_a_possible_stop_prefix(chunks: list[str], stops: list[str], min_tokens: int) -> None:
    """Per step, not only in total: what is held back is exactly the longest suffix that could
    still begin a stop string, and a stop completing before min_tokens is passed over (the
    matcher keeps its state through it)."""
    params = SamplingParams(stop=stops, max_tokens=None, min_tokens=min_tokens)
    results, streamed, _ = run_checker(params, chunks)
    text = ""
    for n, (chunk, res) in enumerate(zip(chunks, results), 1):
        before, text = text, text + chunk
        # Occurrences ending inside this chunk, earliest end first, then the longest.
        ends = sorted((i + len(s), -len(s), s) for s in stops
                      for i in range(max(0, len(before) - len(s) + 1), len(text) - len(s) + 1)
                      if text.startswith(s, i))
        if n >= min_tokens and ends:
            end, _, stop = ends[0]
            assert res.finished and res.stop_reason == stop
            assert streamed == text[: end - len(stop)]
            return
        assert not res.finished
        assert "".join(r.emit for r in results[:n]) == text[: len(text) - _reference_held(text, stops)]


def test_one_stop_matcher_serves_every_sample_of_a_request() -> None:
    """Samples share the compiled stop strings and keep separate states."""
    params = SamplingParams(stop=["ab", "ba"], max_tokens=None)
    a, b = StopChecker.for_samples(params, [EOS], 100, n=2)
    assert a.matcher is b.matcher and a.stop_token_ids is b.stop_token_ids
    assert a.check(5, "a", 1, 2).emit == "" and b.check(5, "b", 1, 2).emit == ""
    assert a.check(5, "a", 2, 3).emit == "a" and b.check(5, "a", 2, 3).stop_reason == "ba"
    assert a.check(5, "b", 3, 4).stop_reason == "ab"
