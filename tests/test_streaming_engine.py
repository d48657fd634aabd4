"""StreamingLLM in the paged engine (`attention_sinks` / `streaming_window`).

Oracles: the literal token-by-token StreamingLLM of tests/streaming_reference.py (greedy tokens
equal, past the model's trained context), the engine's own full attention when the streaming
cache holds everything, and the block manager's invariants (memory flat, nothing leaked).
"""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.block_manager import NULL_BLOCK
from kvserve.loading import load_model
from tests.streaming_reference import literal_greedy
from tests.tiny_models import make_model

CONTEXT = 48  # the tiny models' trained context: generation runs well past it


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request, tmp_path_factory):
    """Random tiny Gemma 3 (sliding window 8 + global layers) and Llama with a 48-token context."""
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}_streaming")
    make_model(request.param, folder, max_position_embeddings=CONTEXT)
    return load_model(folder)


def prompts(n: int, length: int) -> list[list[int]]:
    return [[2] + [(17 * i + 5 * j) % 300 + 3 for j in range(length - 1)] for i in range(n)]


def streaming_llm(loaded, sinks: int, window: int, **kw) -> LLM:
    return LLM(loaded=loaded, attention_sinks=sinks, streaming_window=window, block_size=4, kv_cache_gib=0.01,
               **kw)


@pytest.mark.parametrize("sinks,window", [(4, 12), (0, 16), (3, 9)])
def test_greedy_equals_literal_streaming_past_the_context(tiny, sinks, window):
    """A ragged batch (prompts of 5, 13 and 30 tokens, chunked prefill of 8 tokens, prefix
    caching on) generates 70 tokens each, beyond the 48-token context; every token equals the
    literal reference's."""
    llm = streaming_llm(tiny, sinks, window, max_num_batched_tokens=8, max_num_seqs=3)
    ps = [prompts(1, n)[0] for n in (5, 13, 30)]
    params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ps, params)
    for p, out in zip(ps, outs):
        want = literal_greedy(tiny.model, p, 70, sinks, window)
        assert list(out.outputs[0].token_ids) == want
    eng = llm.engine
    assert eng.block_manager.num_window_released > 0
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_memory_stays_flat_and_nothing_leaks(tiny):
    """Blocks held by a sequence stop growing once the window is full: sinks + window + one
    chunk at most, while the stream runs to 300 tokens (6x the context)."""
    sinks, window, bs = 4, 12, 4
    llm = streaming_llm(tiny, sinks, window, max_num_batched_tokens=8)
    eng, bm = llm.engine, llm.engine.block_manager
    eng.add_request(prompts(1, 20)[0], SamplingParams(max_tokens=280, temperature=0.0, ignore_eos=True))
    held = []
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:
            bm.check_invariants(eng.scheduler.running)
            held.append(bm.seq_blocks(seq))
            real = [b for b in seq.block_table if b != NULL_BLOCK]
            assert seq.block_table[:1] != [NULL_BLOCK], "the sink block was released"
            assert len(real) == held[-1]
    lookback = max(p.window for p in eng.stream_policies)
    bound = bm.peak_blocks(10**6, 8)
    assert bound == -(-sinks // bs) + (lookback - 1 + 8 + bs - 2) // bs + 1
    assert max(held) <= bound
    late = held[100:]  # decoding, 120+ tokens into the stream: flat (one block of jitter)
    assert len(late) > 150 and max(late) - min(late) <= 1
    assert max(late) < bm.blocks_for(300) // 3  # what every layer would hold without release
    assert bm.num_free_blocks == eng.num_blocks


def test_window_holding_everything_equals_the_plain_engine(gemma):
    """On Gemma 3 270M, sinks + window longer than the whole request: the streaming path (pre-RoPE
    pool, ranks = positions) gives the plain engine's greedy tokens."""
    prompt = "The history of the paged KV cache begins with"
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLM(loaded=gemma, kv_cache_gib=0.2).generate([prompt], params)[0].outputs[0].token_ids
    stream = LLM(loaded=gemma, kv_cache_gib=0.2, attention_sinks=4, streaming_window=1020).generate(
        [prompt], params)[0].outputs[0].token_ids
    assert list(stream) == list(plain)


def test_speculative_ngram_with_streaming_equals_plain_streaming(tiny):
    """n-gram drafts verified as 1 + k token chunks through the streaming cache, rejected slots
    rolled back: the same greedy tokens as streaming without speculation."""
    p = prompts(1, 12)[0] * 3
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    base = streaming_llm(tiny, 4, 12).generate([p], params)[0].outputs[0].token_ids
    llm = streaming_llm(tiny, 4, 12, speculative="ngram", num_speculative_tokens=3)
    spec = llm.generate([p], params)[0].outputs[0].token_ids
    assert list(spec) == list(base)
    assert llm.engine.spec_stats["num_draft_tokens"] > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("kw,message", [
    (dict(attention_sinks=4), "attention_sinks needs streaming_window"),
    (dict(attention_sinks=-1, streaming_window=8), "attention_sinks must be"),
    (dict(streaming_window=0), "streaming_window must be"),
    (dict(streaming_window=8, speculative="self"), "streaming_window works with"),
    (dict(streaming_window=8, use_kv_cache=False), "streaming_window needs the KV cache"),
])
def test_bad_streaming_config_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_budget_over_the_trained_context_is_rejected(tiny):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        streaming_llm(tiny, 4, CONTEXT)
