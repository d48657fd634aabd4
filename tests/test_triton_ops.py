"""The CUDA glue kernels (kvserve/kernels/triton_ops.py), through Triton's interpreter on the CPU
(compiled on the GPU where CUDA is available), against the PyTorch ops the model files run:
RMSNorm in both styles, the residual steps, q/k norm + RoPE + the K/V write, gated activations.
In bf16 the roundings sit where PyTorch's do, so nearly every element is bitwise equal (a norm
sums in another order)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before the import below

from kvserve.kernels import triton_ops as ops  # noqa: E402
from kvserve.model.layers import RMSNorm, apply_rope  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm's PyTorch path (model/layers.py), both styles."""
    shape = (x.shape[-1],)
    if offset:
        return F.rms_norm(x.float(), shape, 1.0 + w.float(), eps).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, w, eps)
    return w * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)


def check(got: torch.Tensor, want: torch.Tensor, bitwise: torch.Tensor | None = None) -> None:
    """fp32 within rounding; bf16 one step apart at most, and the same bits almost everywhere
    (`bitwise`: where that must hold)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)
        same = got == want
        assert (same if bitwise is None else same[bitwise]).float().mean() > 0.97


def rand(*shape, dtype, seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("d", [640, 2048, 100])
def test_rms_norm(dtype, offset, d):
    x, w = rand(7, d, dtype=dtype, scale=3.0), rand(d, dtype=dtype, seed=1, scale=0.2)
    check(ops.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, offset), torch_norm(x, w, 1e-6, offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
def test_residual_norm_gemma_sandwich_and_llama_pre_norm(dtype, offset):
    x, res = rand(5, 640, dtype=dtype, seed=2), rand(5, 640, dtype=dtype, seed=3, scale=4.0)
    w1, w2 = rand(640, dtype=dtype, seed=4, scale=0.2), rand(640, dtype=dtype, seed=5, scale=0.2)
    dx, dres, dw1, dw2 = (t.to(DEVICE) for t in (x, res, w1, w2))
    # Gemma's add_to: h = res + norm(x); then norm(h)
    h = res + torch_norm(x, w1, 1e-6, offset)
    got_h, got_y = ops.residual_norm(dx, dres, 1e-6, offset, dw1, dw2)
    check(got_h, h)
    check(got_y, torch_norm(h, w2, 1e-6, offset))
    check(ops.residual_norm(dx, dres, 1e-6, offset, dw1, None), h)
    # Llama's add_and_norm: h = res + x; then norm(h)
    h = res + x
    got_h, got_y = ops.residual_norm(dx, dres, 1e-6, offset, None, dw2)
    check(got_h, h)
    check(got_y, torch_norm(h, w2, 1e-6, offset))


def rope_tables(T: int, D: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(3, 3 + T).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))[None]
    emb = torch.cat((pos, pos), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,offset,normed", [(256, True, True), (64, False, False), (128, False, True)])
def test_norm_rope_and_the_kv_write(dtype, D, offset, normed):
    T, H, KVH = 6, 4, 2
    # q, k, v as views of one fused projection's output, as the engine's CUDA path makes them
    qkv = rand(T, (H + 2 * KVH) * D, dtype=dtype, seed=6, scale=2.0)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    cos, sin = rope_tables(T, D, dtype)
    wq, wk = rand(D, dtype=dtype, seed=7, scale=0.3), rand(D, dtype=dtype, seed=8, scale=0.3)
    norm_q = RMSNorm(D, 1e-6, offset=offset)
    norm_q.weight.data = wq
    norm_k = RMSNorm(D, 1e-6, offset=offset)
    norm_k.weight.data = wk
    with torch.no_grad():
        want_q = apply_rope(norm_q(q) if normed else q, cos, sin)
        want_k = apply_rope(norm_k(k) if normed else k, cos, sin)
    dq, dk, dv, dcos, dsin = (t.to(DEVICE) for t in (q, k, v, cos, sin))
    spec = (lambda w: (w.to(DEVICE), 1e-6, offset)) if normed else (lambda w: None)
    check(ops.norm_rope(dq, spec(wq), dcos, dsin), want_q)  # q alone (a layer reusing another's K/V)
    slots = torch.tensor([9, 2, 17, 0, 5, 11], device=DEVICE)
    k_pool = torch.zeros(20, KVH, D, dtype=dtype, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    got_q = ops.qk_norm_rope(dq, dk, dv, spec(wq), spec(wk), dcos, dsin, k_pool, v_pool, slots)
    check(got_q, want_q)
    check(k_pool[slots], want_k)
    assert torch.equal(v_pool[slots].cpu(), v)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not k_pool.cpu()[untouched].any() and not v_pool.cpu()[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_gated_act_on_a_fused_gate_up_output(dtype, gelu_tanh):
    gate_up = rand(3, 2 * 1500, dtype=dtype, seed=9, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)  # views, rows strided by 3000
    act = (lambda x: F.gelu(x, approximate="tanh")) if gelu_tanh else F.silu
    # Far left (gate < -4) GELU's 1 + tanh cancels, and two fp32 tanh implementations part
    # there in the bits that survive: compare those bits elsewhere.
    check(ops.gated_act(gate.to(DEVICE), up.to(DEVICE), gelu_tanh), act(gate) * up, bitwise=gate > -4)


def test_empty_inputs():
    x = torch.empty(0, 64, device=DEVICE)
    heads = torch.empty(0, 2, 64, device=DEVICE)
    cos = torch.empty(0, 64, device=DEVICE)
    pool = torch.zeros(4, 2, 64, device=DEVICE)
    slots = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert ops.qk_norm_rope(heads, heads, heads, None, None, cos, cos, pool, pool, slots).shape == (0, 2, 64)
    assert not pool.any()
    assert ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, False).shape == (0, 64)
    assert ops.gated_act(x, x, False).shape == (0, 64)
