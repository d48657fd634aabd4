"""LLM.int8() (kvserve/compress/quant/llm_int8.py) and SmoothQuant W8A8 (kvserve/compress/quant/smoothquant.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kvserve.compress.quant.llm_int8 as li8
from kvserve.compress.quant.llm_int8 import Int8Linear, int8_matmul, llm_int8_model
from kvserve.compress.quant.smoothquant import (
    W8A8Linear,
    collect_act_absmax,
    fold_into_norm,
    smooth_layer,
    smooth_model,
    smoothing_scales,
    smoothquant_model,
    w8a8_model,
)

K, N, M = 256, 128, 64
OUTLIER_COLS = [3, 50, 111, 200]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _layer(seed=0, outliers: float | None = 100.0):
    """A linear [N, K] and correlated inputs [M, K] (a shared low-rank component plus noise), with
    a few feature columns scaled by `outliers` (systematic outlier features, as in LLMs)."""
    g = _gen(seed)
    base = torch.randn(M, 8, generator=g) @ torch.randn(8, K, generator=g) / 3
    x = (base + torch.randn(M, K, generator=g)).clamp(-5.5, 5.5)  # below the 6.0 threshold
    if outliers:
        x[:, OUTLIER_COLS] *= outliers
    lin = nn.Linear(K, N, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(N, generator=g) * 0.1)
    return lin, x


def _rel_err(y, ref):
    return float((y - ref).detach().norm() / ref.detach().norm())


# --- int8 matmul -------------------------------------------------------------------------------

def test_int8_matmul_is_exact_with_and_without_int_mm(monkeypatch):
    g = _gen(1)
    for m in (1, 7, 33):
        a = torch.randint(-127, 128, (m, 300), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (40, 300), generator=g, dtype=torch.int8)
        want = (a.long() @ b.long().t()).to(torch.int32)
        assert torch.equal(int8_matmul(a, b), want)
        monkeypatch.setattr(li8, "HAS_INT_MM", False)
        assert torch.equal(int8_matmul(a, b), want)
        monkeypatch.setattr(li8, "HAS_INT_MM", hasattr(torch, "_int_mm"))


# --- LLM.int8() --------------------------------------------------------------------------------

def test_llm_int8_is_close_to_fp_with_outliers_and_absmax_int8_is_not():
    lin, x = _layer(outliers=100.0)
    ref = lin(x)
    errs = {mode: _rel_err(Int8Linear.from_linear(lin, mode)(x), ref) for mode in li8.MODES}
    layer = Int8Linear.from_linear(lin, "llm.int8")
    layer(x)
    assert layer.last_outlier_columns == len(OUTLIER_COLS)
    assert errs["llm.int8"] < 0.02, errs
    assert errs["absmax"] > 5 * errs["llm.int8"], errs
    assert errs["vectorwise"] > 3 * errs["llm.int8"], errs


def test_without_outliers_all_int8_modes_are_similar():
    lin, x = _layer(outliers=None)
    x = x.clamp(-5.9, 5.9)  # nothing reaches the threshold
    ref = lin(x)
    errs = {mode: _rel_err(Int8Linear.from_linear(lin, mode)(x), ref) for mode in li8.MODES}
    assert max(errs.values()) < 0.02, errs
    assert max(errs.values()) < 3 * min(errs.values()), errs
    # No outlier column: LLM.int8() is exactly the vector-wise product.
    assert torch.equal(Int8Linear.from_linear(lin, "llm.int8")(x), Int8Linear.from_linear(lin, "vectorwise")(x))


def test_int8_linear_shapes_dtypes_and_bad_arguments():
    lin, x = _layer()
    layer = Int8Linear.from_linear(lin)
    y = layer(x.view(4, 16, K).bfloat16())
    assert y.shape == (4, 16, N) and y.dtype == torch.bfloat16
    assert layer(x[:0]).shape == (0, N)
    assert layer.weight_nbytes < lin.weight.numel() * 4 / 3
    with pytest.raises(ValueError, match="mode must be one of"):
        Int8Linear.from_linear(lin, "int4")
    with pytest.raises(ValueError, match="threshold must be > 0"):
        Int8Linear.from_linear(lin, threshold=0)


# --- SmoothQuant -------------------------------------------------------------------------------

def test_smoothing_alone_leaves_the_layer_output_unchanged():
    lin, x = _layer(outliers=50.0)
    amax = x.abs().amax(0)
    s, (w_s,) = smooth_layer(amax, [lin.weight], alpha=0.5)
    assert s.shape == (K,) and float(s.max() / s.min()) > 5
    torch.testing.assert_close((x / s) @ w_s.t(), x @ lin.weight.t(), rtol=1e-5, atol=1e-5)
    # s_j = max|X_j|^a / max|W_j|^(1-a), and the smoothed ranges meet in the middle at a = 0.5.
    want = amax.pow(0.5) / lin.weight.abs().amax(0).pow(0.5)
    torch.testing.assert_close(s, want)
    torch.testing.assert_close((x / s).abs().amax(0), w_s.abs().amax(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="alpha"):
        smoothing_scales(amax, [lin.weight], alpha=1.5)


def test_smoothquant_w8a8_error_far_below_naive_w8a8_with_outlier_channels():
    lin, x = _layer(outliers=100.0)
    ref = lin(x)
    naive = _rel_err(W8A8Linear.from_linear(lin, "tensor", "tensor")(x), ref)
    s, (w_s,) = smooth_layer(x.abs().amax(0), [lin.weight], alpha=0.5)
    smoothed = copy.deepcopy(lin)
    with torch.no_grad():
        smoothed.weight.copy_(w_s)
    xs = x / s
    errs = {(wg, ag): _rel_err(W8A8Linear.from_linear(smoothed, wg, ag, xs.abs().amax(0))(xs), ref)
            for wg in ("channel", "tensor") for ag in ("token", "tensor", "static")}
    assert naive > 0.05, naive
    assert errs[("channel", "token")] < naive / 5, (naive, errs)
    assert max(errs.values()) < naive / 2, (naive, errs)
    assert errs[("channel", "token")] < 0.02, errs


def test_w8a8_linear_matches_its_integer_arithmetic_and_validates():
    lin, x = _layer(outliers=None)
    layer = W8A8Linear.from_linear(lin, "channel", "token")
    qx, sx = li8.quantize_rows(x)
    want = (qx.double() @ layer.qweight.double().t()) * sx.double() * layer.weight_scale.double() + lin.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-6, atol=1e-6)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs act_absmax"):
        W8A8Linear.from_linear(lin, "channel", "static")
    with pytest.raises(ValueError, match="act_granularity must be one of"):
        W8A8Linear.from_linear(lin, "channel", "row")


@pytest.mark.parametrize("offset", [False, True])
def test_fold_into_norm_divides_its_output(offset):
    from kvserve.model.layers import RMSNorm

    g = _gen(3)
    norm = RMSNorm(K, 1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3, generator=g)
    x = torch.randn(5, K, generator=g)
    s = torch.rand(K, generator=g) * 4 + 0.1
    want = norm(x) / s
    fold_into_norm(norm, s)
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-6)


# --- whole models ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("w8a8")
    for kind in ("llama", "gemma3"):
        make_model(kind, root / kind)
    return root


def _windows(vocab, n=3, length=24, seed=5):
    return torch.randint(3, vocab, (n, length), generator=_gen(seed))


def _model_logits(loaded, windows):
    from kvserve.tools.eval.ppl import window_hidden

    with torch.inference_mode():
        return loaded.model.compute_logits(window_hidden(loaded.model, windows).flatten(0, 1))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_smoothing_a_model_leaves_its_logits_unchanged(tiny, kind):
    from kvserve.loading import load_model
    from tests.logits import all_position_logits

    loaded = load_model(tiny / kind)
    windows = _windows(loaded.config.vocab_size)
    ids = windows[0].tolist()
    before = all_position_logits(loaded, ids)
    amax = collect_act_absmax(loaded.model, windows)
    assert set(amax) >= {"layers.0.self_attn.q_proj", "layers.0.mlp.gate_proj", "layers.0.mlp.down_proj"}
    # Make the smoothing far from the identity: pretend a few channels carry outliers.
    for k, v in amax.items():
        v[: 4] *= 30
    scales = smooth_model(loaded.model, amax, alpha=0.5)
    assert len(scales) == 3 * loaded.config.num_layers
    assert all(float(s.max() / s.min()) > 3 for s in scales.values())
    after = all_position_logits(loaded, ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_smoothquant_and_llm_int8_models_run_close_to_fp(tiny, kind):
    from kvserve.loading import load_model

    loaded = load_model(tiny / kind)
    windows = _windows(loaded.config.vocab_size)
    ref = _model_logits(loaded, windows)
    amax = collect_act_absmax(loaded.model, windows)

    def err(fn):
        m = copy.deepcopy(loaded)
        fn(m.model)
        return _rel_err(_model_logits(m, windows), ref), m

    e_sq, m_sq = err(lambda m: smoothquant_model(m, amax, alpha=0.5))
    assert sum(isinstance(x, W8A8Linear) for x in m_sq.model.modules()) == 7 * loaded.config.num_layers
    e_naive, _ = err(lambda m: w8a8_model(m, "tensor", "tensor"))
    e_static, _ = err(lambda m: smoothquant_model(m, amax, 0.5, "tensor", "static"))
    e_int8, m_int8 = err(lambda m: llm_int8_model(m, threshold=6.0))
    e_lm, _ = err(lambda m: llm_int8_model(m, lm_head=True))
    assert sum(isinstance(x, Int8Linear) for x in m_int8.model.modules()) == 7 * loaded.config.num_layers
    # Random tiny models have no outlier features: every variant is a few percent off, and the
    # smoothed per-token one beats the naive per-tensor one.
    for e in (e_sq, e_naive, e_static, e_int8, e_lm):
        assert e < 0.1, (e_sq, e_naive, e_static, e_int8, e_lm)
    assert e_sq < e_naive, (e_sq, e_naive)
