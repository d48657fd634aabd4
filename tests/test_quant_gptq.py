"""GPTQ (kvserve/compress/quant/gptq.py), calibration (kvserve/compress/quant/calibrate.py) and the sequential
pipeline of quantize_model on a tiny random model."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.compress.quant import QuantSpec, quantize_model, quantize_rtn
from kvserve.compress.quant.calibrate import (
    Calibrator,
    calibration_path,
    calibration_windows,
)
from kvserve.compress.quant.gptq import GPTQQuantizer, gptq_quantize
from kvserve.loading import load_model
from kvserve.tools.eval import ppl as ev
from kvserve.weights.spec import LayerStats
from tests.tiny_models import VOCAB, make_model


def correlated_layer(seed: int = 0, n: int = 2048, k: int = 256, out: int = 96):
    """Inputs X = Z A (a random mixing: correlated channels) with a few outlier channels, and a
    random weight [out, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5)
    x[:, torch.randperm(k, generator=g)[:4]] *= 15.0
    w = torch.randn(out, k, generator=g) * 0.05
    return x, w


def out_err(x, w, w_hat) -> float:
    return float((x @ w.T - x @ w_hat.T).norm())


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("granularity", ["group", "channel"])
@pytest.mark.parametrize("sym", [False, True])
def test_gptq_output_error_below_rtn(bits, granularity, sym):
    x, w = correlated_layer()
    spec = QuantSpec(bits=bits, sym=sym, granularity=granularity, group_size=128)
    h = 2 * x.T @ x / x.shape[0]
    rtn = out_err(x, w, quantize_rtn(w, spec).dequantize())
    for act_order in (False, True):
        q = gptq_quantize(w, h, spec, act_order=act_order)
        assert q.codes.min() >= spec.qmin and q.codes.max() <= spec.qmax
        assert out_err(x, w, q.dequantize()) <= rtn
    assert out_err(x, w, gptq_quantize(w, h, spec, act_order=True, static_groups=True).dequantize()) <= rtn


def test_gptq_act_order_groups_carry_g_idx():
    x, w = correlated_layer(1)
    spec = QuantSpec(bits=4, granularity="group", group_size=64)
    h = 2 * x.T @ x / x.shape[0]
    q = gptq_quantize(w, h, spec, act_order=True)
    assert q.g_idx is not None and q.g_idx.shape == (w.shape[1],)
    assert torch.equal(torch.bincount(q.g_idx), torch.full((4,), 64))  # 64 columns per group
    assert gptq_quantize(w, h, spec, act_order=True, static_groups=True).g_idx is None
    assert gptq_quantize(w, h, spec).g_idx is None


def test_gptq_small_blocks_match_one_block():
    """Lazy block updates are only a reordering of the same arithmetic."""
    x, w = correlated_layer(2, k=128, out=32)
    spec = QuantSpec(bits=4, granularity="channel")
    h = 2 * x.T @ x / x.shape[0]
    a = gptq_quantize(w, h, spec, blocksize=128).dequantize()
    b = gptq_quantize(w, h, spec, blocksize=16).dequantize()
    assert (a - b).abs().max() < 1e-3 * w.abs().max()


def test_gptq_dead_columns_zeroed():
    x, w = correlated_layer(3, k=128, out=32)
    x[:, 5] = 0
    h = 2 * x.T @ x / x.shape[0]
    q = gptq_quantize(w, h, QuantSpec(bits=4, sym=True, granularity="channel"))
    assert (q.dequantize()[:, 5] == 0).all()


def test_gptq_not_positive_definite_is_a_clear_error():
    w = torch.randn(16, 64)
    h = torch.zeros(64, 64)
    h[0, 1] = h[1, 0] = 1.0  # diag all zero -> dead columns -> H = I plus an indefinite 2x2
    h[0, 0] = h[1, 1] = 0.5
    quantizer = GPTQQuantizer(QuantSpec(bits=4, granularity="channel"), percdamp=0.0)
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.up_proj.*--damp.*--nsamples"):
        quantizer.quantize_layer(w, LayerStats(hessian=h, extra={"name": "layers.3.mlp.up_proj"}))
    with pytest.raises(ValueError, match="Hessian"):
        GPTQQuantizer(QuantSpec()).quantize_layer(w, None)


def test_gptq_all_zero_inputs_with_no_damping():
    """All-zero calibration inputs: every column is dead; with damp 0 H = I (dead columns set to 1)
    is still PD, and the weight quantizes to zeros. With a Hessian that is zero but for a
    negative diagonal entry (not PSD), the error names the layer."""
    w = torch.randn(16, 64)
    q = GPTQQuantizer(QuantSpec(bits=4, granularity="channel"), percdamp=0.0).quantize_layer(
        w, LayerStats(hessian=torch.zeros(64, 64), extra={"name": "L"}))
    assert (q.dequantize() == 0).all()
    h = torch.zeros(64, 64)
    h[3, 3] = -1.0
    with pytest.raises(ValueError, match="L is not positive definite"):
        gptq_quantize(w, h, QuantSpec(bits=4, granularity="channel"), percdamp=0.0, name="L")


def test_calibration_windows_deterministic():
    ids = torch.arange(1000)
    a = calibration_windows(ids, 8, 32, seed=5, bos_token_id=2)
    b = calibration_windows(ids, 8, 32, seed=5, bos_token_id=2)
    c = calibration_windows(ids, 8, 32, seed=6, bos_token_id=2)
    assert a.shape == (8, 32) and torch.equal(a, b) and not torch.equal(a, c)
    assert (a[:, 0] == 2).all() and (a[:, 2:] - a[:, 1:-1] == 1).all()  # consecutive text tokens
    w = calibration_windows(ids, 4, 32, seed=5)
    assert w.shape == (4, 32) and (w[:, 1:] - w[:, :-1] == 1).all()
    with pytest.raises(ValueError, match="--nsamples"):
        calibration_windows(ids, 0, 32)
    assert calibration_path().name == "wiki.valid.tokens"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_gptq")
    make_model("llama", folder)
    return folder


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_calibrator_hessian_matches_direct_capture(tiny_llama):
    """Block 0's q_proj Hessian equals 2 X^T X / n of its input computed by hand."""
    model = load_model(tiny_llama).model
    windows = calibration_windows(_tokens(500), 4, 16, seed=0, bos_token_id=2)
    cal = Calibrator(model, windows, collect=("hessian", "absmean", "inputs"), sample_rows=16)
    st = cal(0, "self_attn.q_proj")
    with torch.no_grad():
        x = model.layers[0].input_layernorm(model.embed(windows.reshape(-1)))
    torch.testing.assert_close(st.hessian, 2 * x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.act_absmean, x.abs().mean(0))
    assert st.num_tokens == 64 and st.inputs.shape == (16, x.shape[1])
    assert st.extra["name"] == "layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match="already passed"):
        cal.inputs(2), cal.inputs(1)


def test_quantize_model_gptq_end_to_end(tiny_llama):
    loaded = load_model(tiny_llama)
    model = loaded.model
    windows = calibration_windows(_tokens(2000, 1), 16, 32, seed=0, bos_token_id=2)
    rep = quantize_model(model, "gptq", bits=4, group_size=32, calibration=windows, kernel="dequant",
                         method_options={"act_order": True}, lm_head=True, progress=False)
    assert len(rep.layers) == 3 * 7 + 1  # + the head (RTN)
    r = ev.perplexity(model, _tokens(400, 2), 32, bos_token_id=2, progress=False)
    assert math.isfinite(r.ppl) and r.ppl > 1
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(load_model(tiny_llama).model, "gptq", progress=False)


def test_cli_quantize_gptq_saves_a_folder(tiny_llama, tmp_path):
    from kvserve.cli import main

    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys in blocks. " * 40)
    out = tmp_path / "q"
    rc = main(["quantize", str(tiny_llama), "--method", "gptq", "--nsamples", "4", "--calib-seqlen", "16",
               "--group-size", "32", "--calib-file", str(text), "--kernel", "dequant", "--out", str(out),
               "--json", str(tmp_path / "r.json")])
    assert rc == 0 and (out / "config.json").is_file()
    assert "quantization_config" in (out / "config.json").read_text()
    assert main(["quantize", str(tiny_llama), "--method", "gptq", "--bits", "9", "--out", str(out)]) == 2
