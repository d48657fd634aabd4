"""The C decode-attention kernel reads K/V in place through block tables; it must equal a
gather + SDPA over the same positions, and the engine must give the same tokens with and
without it (the torch fallback path)."""
from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import paged_attention_lib, paged_decode_attention

BS = 16


def _pool(lens: list[int], kvh: int, d: int, dtype: torch.dtype, seed: int = 0):
    """A shuffled paged pool holding each sequence's context; block tables [B, max_blocks]."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 3
    k = torch.randn(num_blocks * BS, kvh, d, generator=g).to(dtype)
    v = torch.randn(num_blocks * BS, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n].int()
        used += n
    return k, v, tables


def _reference(q, k, v, tables, starts, lens):
    out = []
    B, H, D = q.shape
    kvh = k.shape[1]
    for b in range(B):
        pos = torch.arange(int(starts[b]), int(lens[b]))
        slots = tables[b][pos // BS].long() * BS + pos % BS
        kk, vv = k[slots].transpose(0, 1).double(), v[slots].transpose(0, 1).double()
        qq = q[b].double().view(kvh, H // kvh, D)
        out.append(F.scaled_dot_product_attention(qq, kk, vv, scale=1 / math.sqrt(D)).reshape(H, D))
    return torch.stack(out)


def test_kernel_compiles_where_a_compiler_exists():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: kvserve runs on the torch path")
    assert paged_attention_lib() is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (8, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_kernel_matches_gather_sdpa(dtype, tol, heads, kv_heads, head_dim, window):
    if paged_attention_lib() is None:
        pytest.skip("C kernel unavailable")
    lens = [1, 5, 16, 17, 33, 300, 1500]  # block edges, and a long one that is split across threads
    k, v, tables = _pool(lens, kv_heads, head_dim, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    starts = torch.zeros_like(lens_t) if window is None else (lens_t - window).clamp(min=0)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    out = paged_decode_attention(q, k, v, tables, starts, lens_t, BS, 1 / math.sqrt(head_dim), max(lens))
    ref = _reference(q, k, v, tables, starts, lens_t)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_single_sequence_uses_splits_and_stays_exact():
    """Batch-1 decode cuts the context into ranges merged by their softmax statistics."""
    if paged_attention_lib() is None:
        pytest.skip("C kernel unavailable")
    lens = [4000]
    k, v, tables = _pool(lens, 1, 64, torch.float32, seed=3)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    starts = torch.zeros_like(lens_t)
    q = torch.randn(1, 4, 64) * 4  # peaky scores: a wrong merge of the ranges would show
    out = paged_decode_attention(q, k, v, tables, starts, lens_t, BS, 0.125, 4000)
    torch.testing.assert_close(out.double(), _reference(q, k, v, tables, starts, lens_t), atol=1e-5, rtol=1e-5)


def test_unsupported_inputs_fall_back():
    q = torch.randn(1, 4, 32, dtype=torch.float16)
    k, v, tables = _pool([5], 1, 32, torch.float16)
    lens = torch.tensor([5], dtype=torch.int32)
    assert paged_decode_attention(q, k, v, tables, torch.zeros_like(lens), lens, BS, 0.1, 5) is None


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from tests.tiny_models import make_model

    folder = tmp_path_factory.mktemp("tiny-gemma3")
    make_model("gemma3", folder)  # sliding window 8: windows cut inside blocks
    return folder


def test_engine_same_tokens_with_and_without_kernel(tiny_gemma, monkeypatch):
    from kvserve import LLM, SamplingParams
    from kvserve.loading import load_model

    if paged_attention_lib() is None:
        pytest.skip("C kernel unavailable")
    loaded = load_model(tiny_gemma)
    prompts = [[2] + [(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([3, 15, 16, 40, 70])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = [o.token_ids for o in LLM(loaded=loaded, kv_cache_gib=0.01).generate(prompts, params)]
    import kvserve.model.attention as attention

    monkeypatch.setattr(attention, "paged_decode_attention", lambda *a, **k: None)
    slow = [o.token_ids for o in LLM(loaded=loaded, kv_cache_gib=0.01).generate(prompts, params)]
    assert fast == slow
