"""The C prefill-attention kernel (kernels/prefill_attention.c): a chunk of one sequence's queries
against its context read in place from the pool must equal float64 softmax attention over the
visible positions (causal, sliding window, GQA/MQA, a chunk after earlier ones), and the engine
must give the same tokens with it and with the gather + SDPA path."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve import kernels
from kvserve.kernels import prefill_attention

needs_kernel = pytest.mark.skipif(
    prefill_attention(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16),
                      torch.zeros(1, dtype=torch.int64), 0, 0, None, 1.0) is None,
    reason="prefill attention kernel unavailable (no compiler, no AVX2, or no libmvec)")


def _reference(q, k_pool, v_pool, slots, first_kv, first_q, window, scale):
    """float64 attention with an explicit visibility mask -> [T, H, D]."""
    T, H, D = q.shape
    G = H // k_pool.shape[1]
    k, v = k_pool[slots].double(), v_pool[slots].double()  # [n, KVH, D]
    kv_pos = torch.arange(first_kv, first_kv + slots.shape[0])
    q_pos = torch.arange(first_q, first_q + T)[:, None]
    mask = kv_pos[None] <= q_pos
    if window:
        mask &= kv_pos[None] > q_pos - window
    out = torch.empty(T, H, D, dtype=torch.float64)
    for h in range(H):
        s = (q[:, h].double() @ k[:, h // G].T * scale).masked_fill(~mask, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ v[:, h // G]
    return out


def _case(T, H, KVH, D, first_q, window, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = first_q + T
    first_kv = max(0, first_q - window + 1) if window else 0
    n = ctx - first_kv
    k_pool = torch.randn(n + 40, KVH, D, generator=g)
    v_pool = torch.randn(n + 40, KVH, D, generator=g)
    slots = torch.randperm(n + 40, generator=g)[:n]  # scattered pages, as in the pool
    q = torch.randn(T, H, D, generator=g) * 2
    return q, k_pool, v_pool, slots, first_kv, first_q, window, 1 / math.sqrt(D)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (8, 2, 64), (4, 4, 16)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("first_q,T", [(0, 1), (0, 37), (0, 200), (50, 17), (300, 64)])
def test_kernel_matches_float64_attention(heads, kv_heads, head_dim, window, first_q, T):
    args = _case(T, heads, kv_heads, head_dim, first_q, window)
    got = prefill_attention(*args)
    want = _reference(*args)
    assert got.shape == (T, heads, head_dim)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


@needs_kernel
def test_kernel_writes_into_out_and_leaves_other_rows():
    q, k, v, slots, first_kv, first_q, window, scale = _case(20, 4, 1, 64, 10, None)
    buf = torch.full((30, 4, 64), 7.0)
    got = prefill_attention(q, k, v, slots, first_kv, first_q, window, scale, out=buf[5:25])
    assert got.data_ptr() == buf[5:25].data_ptr()
    assert (buf[:5] == 7).all() and (buf[25:] == 7).all()
    torch.testing.assert_close(buf[5:25].double(), _reference(q, k, v, slots, first_kv, first_q, window, scale),
                               atol=2e-5, rtol=0)


def test_unsupported_inputs_fall_back():
    q, k, v, slots, first_kv, first_q, window, scale = _case(8, 4, 1, 16, 0, None)
    assert prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), slots, 0, 0, None, scale) is None
    q8, k8, v8, slots8, *_ = _case(8, 4, 1, 8, 0, None)  # head_dim not a multiple of 16
    assert prefill_attention(q8, k8, v8, slots8, 0, 0, None, scale) is None
    assert prefill_attention(q, k, v, slots.int(), 0, 0, None, scale) is None
    out = torch.empty(4, 8, 16).transpose(0, 1)  # not contiguous
    assert prefill_attention(q, k, v, slots, 0, 0, None, scale, out=out) is None


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from tests.tiny_models import make_model

    folder = tmp_path_factory.mktemp("tiny-gemma3-prefill")
    make_model("gemma3", folder)  # sliding window 8: windows cut inside blocks and chunks
    return folder


@needs_kernel
def test_engine_same_tokens_with_and_without_kernel(tiny_gemma, monkeypatch):
    import kvserve.model.attention as attention
    from kvserve import LLM, SamplingParams
    from kvserve.loading import load_model

    loaded = load_model(tiny_gemma)
    prompts = [[2] + [(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([3, 15, 16, 40, 70, 130])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    calls = []
    real = attention.prefill_attention
    monkeypatch.setattr(attention, "prefill_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    # Chunks of at most 32 tokens: later chunks attend to earlier ones (and across the window).
    fast = LLM(loaded=loaded, kv_cache_gib=0.01, max_num_batched_tokens=32).generate(prompts, params)
    assert calls and max(calls) > 1
    monkeypatch.setattr(attention, "prefill_attention", lambda *a, **k: None)
    slow = LLM(loaded=loaded, kv_cache_gib=0.01, max_num_batched_tokens=32).generate(prompts, params)
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 1e-4
    assert kernels.kernel_lib("prefill_attention") is not None
