"""Sliding-window KV release (layer groups): sequences well past the window give the same greedy
tokens as when every layer keeps every block (`sliding_window_release=False`), through chunked
prefill, prefix hits, forks, preemption and speculative decoding, while holding fewer pages.

A tiny random Gemma 3 (window 8, 4-token blocks: releases every few tokens) covers every path
quickly; Gemma 3 270M (window 512) covers the real model with ~1.2K-token prompts."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.block_manager import NULL_BLOCK
from kvserve.loading import load_model
from tests.conftest import WIKITEXT


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> tuple[list, int]:
    """Generate step by step, checking the block manager's invariants on the way; returns
    (token ids of every sample of every prompt, peak pool bytes in use)."""
    eng = llm.engine
    bm = eng.block_manager
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, peak, steps = {}, 0, 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = [c.token_ids for c in out.outputs]
        peak = max(peak, eng.num_blocks - bm.num_free_blocks)
        steps += 1
        if steps % 7 == 0:
            bm.check_invariants(eng.scheduler.running + list(eng.scheduler.waiting))
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks, "KV pages leaked"
    return [final[r] for r in rids], peak * eng.page_bytes


# ---------------------------------------------------------------- tiny Gemma 3 (window 8)
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_model

    folder = tmp_path_factory.mktemp("tiny-gemma3-window")
    make_model("gemma3", folder)  # 6 layers (2 full, 4 sliding), window 8
    return load_model(folder)


def _tiny_prompts() -> list[list[int]]:
    base = [[2] + [(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([3, 15, 40, 70, 90])]
    shared = base[4][:60]  # prefix hits well past the window: only the blocks before position 60 - 7 + 1
    return base + [shared + [5, 6, 7], shared + [9] * 20]


TINY_PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 6 + \
    [SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)]


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    """Every prompt alone, every layer keeping every block."""
    llm = LLM(loaded=tiny, kv_cache_gib=0.01, block_size=4, max_num_seqs=1, enable_prefix_caching=False,
              sliding_window_release=False)
    return [run(llm, [p], sp)[0][0] for p, sp in zip(_tiny_prompts(), TINY_PARAMS)]


TINY_CONFIGS = {
    "batched": dict(),
    "chunked-budget-8": dict(max_num_batched_tokens=8),
    "preemption": dict(kv_cache_gib=40 * 4 * 6 * 2 * 2 * 32 * 4 / 2**30, max_num_batched_tokens=16),
    "ngram": dict(speculative="ngram", num_speculative_tokens=3, max_num_batched_tokens=16),
    "self-bf16": dict(speculative="self", num_speculative_tokens=2, max_num_batched_tokens=16),
    "self-early-exit": dict(speculative="self", num_speculative_tokens=2, self_draft_layers=3,
                            self_draft_dtype="float32"),
    "no-prefix-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=12),
}


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_release_keeps_greedy_tokens(tiny, tiny_reference, name):
    cfg = {"kv_cache_gib": 0.01, "block_size": 4, **TINY_CONFIGS[name]}
    llm = LLM(loaded=tiny, **cfg)
    assert llm.engine.block_manager.num_groups == 3  # [2, 5] full, [0, 1] and [3, 4] sliding
    outs, _ = run(llm, _tiny_prompts(), TINY_PARAMS)
    assert outs == tiny_reference
    stats = llm.engine.stats()
    assert stats["kv_blocks_released_by_window"] > 0
    if name == "preemption":
        assert stats["num_preemptions"] > 0
    if name in ("batched", "chunked-budget-8", "ngram"):
        assert stats["prefix_cache_hits"] >= 2 * 56  # the two shared prompts hit 56 tokens each
    if name.startswith(("ngram", "self")):
        assert stats["spec_num_draft_tokens"] > 0


def test_tiny_torch_fallback_equals_kernel_with_release(tiny, tiny_reference, monkeypatch):
    """KVSERVE_NO_KERNELS path: padded gathers must skip (clamp) released table entries."""
    import kvserve.model.attention as attention

    monkeypatch.setattr(attention, "paged_decode_attention", lambda *a, **k: None)
    llm = LLM(loaded=tiny, kv_cache_gib=0.01, block_size=4, max_num_batched_tokens=16)
    outs, _ = run(llm, _tiny_prompts(), TINY_PARAMS)
    assert outs == tiny_reference


def test_release_is_off_where_it_cannot_apply(tiny):
    """One table when asked, without a KV cache (the baseline recomputes into the same blocks),
    and with a separate draft model (its layers do not map onto the target's groups)."""
    assert LLM(loaded=tiny, kv_cache_gib=0.01, sliding_window_release=False).engine.block_manager.num_groups == 1
    assert LLM(loaded=tiny, kv_cache_gib=0.01, use_kv_cache=False).engine.block_manager.num_groups == 1
    with pytest.raises(ValueError, match="sliding_window_release"):
        LLM(loaded=tiny, sliding_window_release="yes")


# ---------------------------------------------------------------- Gemma 3 270M (window 512)
def _gemma_prompts(tokenizer) -> list[list[int]]:
    text = (WIKITEXT / "wiki.test.raw").read_text(encoding="utf-8")
    ids = tokenizer.encode(text[20000:40000])
    other = tokenizer.encode(text[60000:62000])
    long = ids[:1200]
    shared = ids[:896] + other[:200]  # a prefix hit of 896 tokens: sliding groups need blocks 24..55 only
    return [long, shared, other[:300]]


GEMMA_PARAMS = [SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]


@pytest.fixture(scope="module")
def gemma_reference(gemma):
    llm = LLM(loaded=gemma, kv_cache_gib=0.5, max_num_batched_tokens=256, sliding_window_release=False)
    return run(llm, _gemma_prompts(gemma.tokenizer), GEMMA_PARAMS)


def test_gemma_release_keeps_greedy_tokens_and_holds_fewer_pages(gemma, gemma_reference):
    ref, ref_peak = gemma_reference
    llm = LLM(loaded=gemma, kv_cache_gib=0.5, max_num_batched_tokens=256)
    assert [g.window for g in llm.engine.layer_groups] == [None] + [512] * 5
    outs, peak = run(llm, _gemma_prompts(gemma.tokenizer), GEMMA_PARAMS)
    assert outs == ref
    assert outs[0][0] == outs[0][1]  # the n = 2 greedy samples (forked, sharing released tables)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] >= 896 and stats["kv_blocks_released_by_window"] > 0
    assert peak < 0.8 * ref_peak


def test_gemma_release_with_preemption_and_ngram_speculation(gemma, gemma_reference):
    ref, _ = gemma_reference
    # 390 pages of 96 KiB (~370 at the peak without preemption): the shared-prefix request is preempted.
    llm = LLM(loaded=gemma, kv_cache_gib=390 * 16 * 6144 / 2**30, max_num_batched_tokens=256,
              speculative="ngram", num_speculative_tokens=4)
    outs, _ = run(llm, _gemma_prompts(gemma.tokenizer), GEMMA_PARAMS)
    assert outs == ref
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 0
    assert stats["kv_blocks_released_by_window"] > 0


def test_gemma_tables_hold_nulls_only_outside_the_window(gemma):
    """Mid-decode, a 1.2K-token sequence's sliding tables start with released entries and keep
    every block from (context - 511) on; the full group keeps every block."""
    llm = LLM(loaded=gemma, kv_cache_gib=0.5)
    eng = llm.engine
    eng.add_request(_gemma_prompts(gemma.tokenizer)[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.step()  # the whole prompt in one 2048-token chunk
    (seq,) = eng.scheduler.running
    first_needed = (seq.num_computed_tokens - 511) // 16
    assert NULL_BLOCK not in seq.block_table
    for table in seq.group_block_tables:
        assert table[:first_needed] == [NULL_BLOCK] * first_needed and NULL_BLOCK not in table[first_needed:]
    while eng.has_unfinished():
        eng.step()
