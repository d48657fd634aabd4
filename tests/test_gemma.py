"""Gemma 3 270M (the bundled GGUF) against HF transformers on the same file: tokenizer ids,
prompt logits and 64-token greedy continuations."""
from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from tests.conftest import WIKITEXT
from tests.logits import all_position_logits, hf_forced_logits

TOKENIZER_CASES = [
    "The capital of France is",
    "  leading spaces,\ttabs\t\tand\n\n\nnewlines   ",
    "Unicode: naïve café, Straße, 東京タワー, Привет мир, مرحبا, 🤖🚀✨",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "<bos> looks special but is text; so is <start_of_turn>user",
    "mixed\u00a0nbsp and zero\u200bwidth and combining e\u0301",
    "1234567890 3.14159 1e-10 0xDEADBEEF",
    "",
]


def _long_prompt(n_chars: int) -> str:
    text = (WIKITEXT / "wiki.test.raw").read_text(encoding="utf-8")
    start = text.index("Robert Boulter")
    return text[start:start + n_chars]


GREEDY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def quicksort(arr):\n",
    "Translate to German: The weather is nice today.\nGerman:",
    "The three primary colors are",
    "Q: What is 17 times 3?\nA:",
    "東京は日本の首都です。東京には",
    _long_prompt(3000),  # > 512 tokens: exercises the local layers' sliding window
]


def test_tokenizer_ids_equal_hf(gemma, hf_gemma_tokenizer):
    for text in TOKENIZER_CASES:
        ours = gemma.tokenizer.encode(text)
        ref = hf_gemma_tokenizer(text)["input_ids"]
        assert ours == ref, repr(text)
        assert gemma.tokenizer.decode(ours) == hf_gemma_tokenizer.decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", [GREEDY_PROMPTS[0], GREEDY_PROMPTS[6], GREEDY_PROMPTS[7]])
def test_prompt_logits_match_hf(gemma, hf_gemma, prompt):
    ids = gemma.tokenizer.encode(prompt)
    ours = all_position_logits(gemma, ids)
    with torch.no_grad():
        ref = hf_gemma(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    # Stated tolerance: 1e-3 absolute on logits of magnitude ~20-40 (measured: ~2e-5).
    assert diff < 1e-3, f"max abs logit diff {diff} over {len(ids)} positions"


def test_long_prompt_exceeds_sliding_window(gemma):
    assert len(gemma.tokenizer.encode(GREEDY_PROMPTS[-1])) > gemma.config.sliding_window


def test_greedy_64_tokens_equal_hf_greedy(gemma, gemma_llm, hf_gemma):
    """Each of our tokens is HF's argmax given the prompt and our tokens before it (teacher
    forcing), and a stop is HF's EOS: what HF's greedy `generate` gives, in one forward."""
    params = SamplingParams(temperature=0, max_tokens=64)
    outs = gemma_llm.generate(GREEDY_PROMPTS, params)
    for prompt, out in zip(GREEDY_PROMPTS, outs):
        ids = gemma.tokenizer.encode(prompt)
        ref_tokens = hf_forced_logits(hf_gemma, ids, out.token_ids).argmax(-1).tolist()
        assert out.token_ids == ref_tokens, f"{prompt[:40]!r}: ours {out.token_ids} vs HF {ref_tokens}"
        assert len(out.token_ids) == 64 or out.token_ids[-1] in gemma.tokenizer.eos_token_ids


def test_no_kv_cache_gives_same_greedy_tokens(gemma):
    from kvserve import LLM

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = GREEDY_PROMPTS[1]
    cached = LLM(loaded=gemma, kv_cache_gib=0.1).generate(prompt, params)[0]
    naive = LLM(loaded=gemma, kv_cache_gib=0.1, use_kv_cache=False).generate(prompt, params)[0]
    assert cached.token_ids == naive.token_ids
    assert cached.text == naive.text
