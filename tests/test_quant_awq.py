"""AWQ (kvserve/compress/quant/awq.py): layer error vs RTN, exact scale folding on tiny Llama / Gemma 3
(the (1 + w) RMSNorm), and the whole-model pipeline."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from kvserve.compress.quant import QuantSpec, quantize_model, quantize_rtn
from kvserve.compress.quant.awq import (
    AWQQuantizer,
    awq_layer,
    fold_scales,
    scale_groups,
    search_clip,
)
from kvserve.compress.quant.calibrate import Calibrator, calibration_windows
from kvserve.loading import load_model
from kvserve.tools.eval import ppl as ev
from tests.test_quant_gptq import correlated_layer, out_err
from tests.tiny_models import VOCAB, make_model


@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("granularity", ["group", "channel"])
@pytest.mark.parametrize("seed", [0, 1])
def test_awq_output_error_below_rtn(bits, granularity, seed):
    """Inputs with salient (outlier) channels: AWQ's effective weight Q(W s) / s beats RTN."""
    x, w = correlated_layer(seed)
    spec = QuantSpec(bits=bits, granularity=granularity, group_size=128)
    rtn = out_err(x, w, quantize_rtn(w, spec).dequantize())
    for clip in (False, True):
        q, s = awq_layer(w, x, spec, clip=clip)
        assert s.shape == (w.shape[1],) and (s > 0).all()
        assert out_err(x, w, q.dequantize() / s) <= rtn


def test_clip_search_never_worse_than_no_clip():
    x, w = correlated_layer(4, k=128, out=32)
    spec = QuantSpec(bits=3, granularity="group", group_size=64)
    m = search_clip(w, x[:256], spec)
    assert m.shape == (32, 2)
    wg = w.reshape(32, 2, 64)
    assert (m <= wg.abs().amax(-1) + 1e-7).all() and (m >= 0.5 * wg.abs().amax(-1) - 1e-7).all()


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama", "llama-mha", "gemma3"])
def tiny(request, tmp_path_factory):
    """llama-mha: as many K/V heads as query heads, so v_proj -> o_proj scales fold too."""
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}_awq")
    if request.param == "llama-mha":
        make_model("llama", folder, num_key_value_heads=4)
    else:
        make_model(request.param, folder)
    return request.param, folder


def test_scale_groups_follow_the_architecture(tiny):
    kind, folder = tiny
    block = load_model(folder).model.layers[0]
    groups = {g.prev: g for g in scale_groups(block)}
    mlp_norm = "pre_feedforward_layernorm" if kind == "gemma3" else "post_attention_layernorm"
    if kind == "llama-mha":
        assert set(groups) == {"input_layernorm", "self_attn.v_proj", mlp_norm, "mlp.up_proj"}
        assert groups["self_attn.v_proj"].linears == ("self_attn.o_proj",)
    else:
        assert set(groups) == {"input_layernorm", mlp_norm, "mlp.up_proj"}  # GQA: no v -> o folding
    assert groups["input_layernorm"].linears == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def test_folding_keeps_the_float_model(tiny):
    """Random positive scales folded into every group of every block: same outputs to 1e-5."""
    _, folder = tiny
    model = load_model(folder).model
    windows = ev.make_windows(_tokens(200), 20, bos_token_id=2, max_windows=3)
    ref = ev.window_hidden(model, windows)
    g = torch.Generator().manual_seed(0)
    for block in model.layers:
        for grp in scale_groups(block):
            k = block.get_submodule(grp.linears[0]).in_features
            fold_scales(block, grp, torch.exp(torch.randn(k, generator=g) * 0.5))
    out = ev.window_hidden(model, windows)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_awq_search_without_clipping_keeps_the_float_model(tiny):
    """prepare_block with clip=False only folds searched scales: the float model is unchanged."""
    _, folder = tiny
    model = load_model(folder).model
    windows = ev.make_windows(_tokens(200, 1), 20, bos_token_id=2, max_windows=3)
    ref = ev.window_hidden(model, windows)
    awq = AWQQuantizer(QuantSpec(bits=3, group_size=32), clip=False, n_grid=5)
    cal = Calibrator(model, calibration_windows(_tokens(1000, 2), 4, 16, seed=0, bos_token_id=2), collect=())
    for i in range(len(model.layers)):
        awq.prepare_block(model, i, cal)
    assert len(awq.alphas) == len(scale_groups(model.layers[0])) * len(model.layers)
    torch.testing.assert_close(ev.window_hidden(model, windows), ref, rtol=1e-5, atol=1e-5)


def test_quantize_model_awq_end_to_end(tiny):
    _, folder = tiny
    model = load_model(folder).model
    windows = calibration_windows(_tokens(2000, 3), 8, 32, seed=0, bos_token_id=2)
    rep = quantize_model(model, "awq", bits=4, group_size=32, calibration=windows, kernel="dequant",
                         method_options={"n_grid": 10}, progress=False)
    assert len(rep.layers) == 7 * len(model.layers)
    r = ev.perplexity(model, _tokens(400, 4), 32, bos_token_id=2, progress=False)
    assert math.isfinite(r.ppl) and r.ppl > 1
    with pytest.raises(ValueError, match="calibration"):
        quantize_model(copy.deepcopy(model), "awq", progress=False)
