"""The fused decode-step kernels (kernels/rope_cache.c, add_rms_norm in kernels/rms_norm.c) give
bitwise the numbers of the torch ops they replace: kernel by kernel, and a whole Gemma run."""
from __future__ import annotations

import pytest
import torch

from kvserve import kernels
from kvserve.model.layers import apply_rope

needs_kernel = pytest.mark.skipif(kernels.kernel_lib("rope_cache") is None or kernels.kernel_lib("rms_norm") is None,
                                  reason="no C compiler")


def _rope_tables(T: int, D: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(T, D // 2, generator=g) * 50
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos(), emb.sin()


@needs_kernel
@pytest.mark.parametrize("T, H, KVH, D", [(1, 4, 1, 256), (5, 4, 2, 64), (9, 2, 2, 32)])
@pytest.mark.parametrize("norms", [True, False])
def test_norm_rope_write_equals_torch_ops(T, H, KVH, D, norms):
    g = torch.Generator().manual_seed(T * 100 + H + D)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g) * 3  # the fused projection's output
    q, k, v = (t.reshape(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    q_gain = k_gain = None
    if norms:
        q_gain, k_gain = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    cos, sin = _rope_tables(T, D, g)
    slots = torch.randperm(40, generator=g)[:T]
    k_pool, v_pool = torch.randn(40, KVH, D, generator=g), torch.randn(40, KVH, D, generator=g)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()

    got = kernels.norm_rope_write(q, k, v, q_gain, k_gain, 1e-6, cos, sin, slots, k_pool, v_pool)

    # The torch path: the norms' C kernel (what RMSNorm runs on a few rows), then apply_rope, index_copy_.
    qn = kernels.rms_norm(q, q_gain, 1e-6) if norms else q
    kn = kernels.rms_norm(k, k_gain, 1e-6) if norms else k
    k_ref.index_copy_(0, slots, apply_rope(kn, cos, sin))
    v_ref.index_copy_(0, slots, v)
    assert torch.equal(got, apply_rope(qn, cos, sin))
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)  # other slots untouched

    # A layer reusing another's K/V: q only, the pool untouched.
    assert torch.equal(kernels.norm_rope_write(q, None, None, q_gain, None, 1e-6, cos, sin, None, None, None), got)


@needs_kernel
def test_norm_rope_write_declines_what_it_cannot_do():
    q, cos = torch.randn(2, 4, 8), torch.randn(2, 8)
    assert kernels.norm_rope_write(q.double(), None, None, None, None, 0.0, cos.double(), cos.double(),
                                   None, None, None) is None
    strided = torch.randn(2, 8, 4).transpose(1, 2)  # heads not packed within a row
    assert kernels.norm_rope_write(strided, None, None, None, None, 0.0, cos, cos, None, None, None) is None


@needs_kernel
@pytest.mark.parametrize("rows, d", [(1, 640), (3, 17), (70, 64)])
def test_add_rms_norm_equals_norm_then_add(rows, d):
    g = torch.Generator().manual_seed(rows + d)
    x, res, gain = torch.randn(rows, d, generator=g) * 4, torch.randn(rows, d, generator=g), torch.rand(d, generator=g)
    assert torch.equal(kernels.add_rms_norm(x, gain, res, 1e-6), res + kernels.rms_norm(x, gain, 1e-6))


def _add_then_norm(self, residual, x, then=None):
    """RMSNorm.add_to as separate torch steps (the unfused reference)."""
    h = residual + self(x)
    return h if then is None else (h, then(h))


@needs_kernel
def test_gemma_fused_decode_equals_torch_ops(gemma, monkeypatch):
    """Greedy tokens and every logprob bitwise equal with the fused kernels on and off, over
    decode-only steps and steps mixing decode rows with prefill chunks (chunked prefill)."""
    from kvserve import LLM, SamplingParams
    from kvserve.model.attention import Attention
    from kvserve.model.layers import RMSNorm

    prompts = [list(range(1000, 1000 + n)) for n in (7, 150, 33)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(loaded=gemma, kv_cache_gib=0.25, enable_prefix_caching=False, max_num_batched_tokens=64)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    fused = run()
    with monkeypatch.context() as m:
        calls = []
        m.setattr(Attention, "_fused_prologue", lambda self, *a: calls.append(1))
        m.setattr(RMSNorm, "add_to", _add_then_norm)
        plain = run()
    assert calls  # the fused path was on offer and declined
    assert fused == plain


@needs_kernel
def test_add_rms_norm_then_next_norm_equals_three_steps():
    g = torch.Generator().manual_seed(7)
    x, res = torch.randn(3, 640, generator=g) * 4, torch.randn(3, 640, generator=g)
    g1, g2 = torch.rand(640, generator=g), torch.rand(640, generator=g) + 0.5
    h, y = kernels.add_rms_norm(x, g1, res, 1e-6, g2)
    want_h = res + kernels.rms_norm(x, g1, 1e-6)
    assert torch.equal(h, want_h) and torch.equal(y, kernels.rms_norm(want_h, g2, 1e-6))
