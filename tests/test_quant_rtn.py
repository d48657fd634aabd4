"""RTN grids, int4 packing and QuantLinear's kernels (kvserve/compress/quant)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kvserve.compress.quant import (
    QuantLinear,
    QuantSpec,
    choose_kernel,
    compute_qparams,
    dequantize,
    fake_quantize,
    model_weight_bytes,
    quantize,
    quantize_model,
    quantize_rtn,
)
from kvserve.weights.packing import (
    cpu_int4_pack,
    from_cpu_int4_layout,
    pack_int4,
    to_cpu_int4_layout,
    unpack_int4,
)
from kvserve.weights.rtn import grid_qparams
from kvserve.weights.spec import QuantizedWeight

HAS_INT4 = hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
SPECS = [QuantSpec(bits=b, sym=s, granularity=g, group_size=gs)
         for b in (2, 3, 4, 8) for s in (True, False) for g, gs in (("tensor", 128), ("channel", 128), ("group", 32))]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- grids -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_codes_on_a_given_grid_round_trip_bitwise(spec):
    """Any codes on any grid: dequantize -> quantize gives the codes back, and dequantizing again
    gives the same bits."""
    g = _gen(0)
    out, k = 8, 64
    groups = spec.num_groups(k)
    codes = torch.randint(spec.qmin, spec.qmax + 1, (out, k), generator=g, dtype=torch.int32)
    scale = torch.rand(out, groups, generator=g) * 0.3 + 1e-3
    zero = None if spec.sym else torch.randint(spec.qmin, spec.qmax + 1, (out, groups), generator=g, dtype=torch.int32)
    x = dequantize(codes, scale, zero)
    back = quantize(x, scale, zero, spec)
    assert torch.equal(back, codes)
    assert torch.equal(dequantize(back, scale, zero), x)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_rtn_returns_values_already_on_its_grid_bitwise(spec):
    """A weight whose every group spans its full code range on a power-of-two scale is its own
    min-max grid: RTN finds that grid and returns every value bit for bit."""
    g = _gen(1)
    out, k = 8, 64
    groups = spec.num_groups(k)
    width = k // groups
    codes = torch.randint(spec.qmin, spec.qmax + 1, (out, groups, width), generator=g, dtype=torch.int32)
    lo = -spec.qmax if spec.sym else spec.qmin  # the restricted symmetric grid never produces qmin
    codes.clamp_(min=lo)
    codes[:, :, 0], codes[:, :, 1] = lo, spec.qmax  # each group reaches both ends
    exps = torch.randint(-9, -3, (out, groups), generator=g)
    if spec.granularity == "tensor":
        codes[1:, :, :2] = 0  # only row 0 spans the range; one scale for the whole tensor
        exps[:] = exps[0, 0]
    scale = torch.pow(2.0, exps.float())
    zero = None
    if not spec.sym:
        zero = torch.randint(spec.qmin, spec.qmax + 1, (out, groups), generator=g, dtype=torch.int32)
        if spec.granularity == "tensor":
            zero[:] = zero[0, 0]
    x = dequantize(codes.reshape(out, k), scale, zero)
    s2, z2 = compute_qparams(x, spec)
    assert torch.equal(s2, scale)
    assert (z2 is None) == spec.sym and (z2 is None or torch.equal(z2, zero))
    assert torch.equal(fake_quantize(x, spec), x)
    assert torch.equal(quantize_rtn(x, spec).codes, codes.reshape(out, k))


def test_asymmetric_range_includes_zero_and_empty_rows_are_exact():
    spec = QuantSpec(bits=4, sym=False, granularity="channel")
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0], [-4.0, -3.0, -2.0, -1.0]])
    scale, zero = compute_qparams(w, spec)
    assert torch.allclose(scale[:, 0], torch.tensor([4 / 15, 1.0, 4 / 15]))
    assert zero[:, 0].tolist() == [0, 0, 15]
    assert torch.equal(fake_quantize(w, spec)[1], torch.zeros(4))
    sym = QuantSpec(bits=8, sym=True, granularity="channel")
    s, z = grid_qparams(torch.tensor([-3.0]), torch.tensor([1.0]), sym)
    assert z is None and torch.allclose(s, torch.tensor([3 / 127]))


def test_error_decreases_with_bits_and_with_smaller_groups():
    g = _gen(2)
    # Rows of different magnitude and a few outliers: per-tensor < per-channel < groups matters.
    w = torch.randn(64, 512, generator=g) * torch.logspace(-2, 0, 64)[:, None]
    w[torch.rand(w.shape, generator=g) < 0.002] *= 8

    def mse(spec: QuantSpec) -> float:
        return float((fake_quantize(w, spec) - w).pow(2).mean())

    for sym in (True, False):
        by_bits = [mse(QuantSpec(bits=b, sym=sym, granularity="group", group_size=64)) for b in range(2, 9)]
        assert all(a > b for a, b in zip(by_bits, by_bits[1:])), by_bits
        assert by_bits[-1] < by_bits[0] / 1000
        specs = [QuantSpec(bits=4, sym=sym, granularity="tensor"), QuantSpec(bits=4, sym=sym, granularity="channel")]
        specs += [QuantSpec(bits=4, sym=sym, granularity="group", group_size=gs) for gs in (256, 128, 64, 32, 16)]
        by_granularity = [mse(s) for s in specs]
        assert all(a > b for a, b in zip(by_granularity, by_granularity[1:])), by_granularity


@pytest.mark.parametrize("kwargs,message", [
    (dict(bits=1), "bits"), (dict(bits=9), "bits"), (dict(bits=4.0), "bits"),
    (dict(granularity="row"), "granularity"), (dict(group_size=0), "group_size"),
])
def test_bad_spec_raises_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantSpec(**kwargs)


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="group_size 64 does not divide in_features 100"):
        compute_qparams(torch.randn(4, 100), QuantSpec(bits=4, group_size=64))
    with pytest.raises(ValueError, match="2-D"):
        compute_qparams(torch.randn(4), QuantSpec())


# --- packing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 2), (3, 10), (5, 2, 8), (7, 130)])
def test_pack_unpack_int4_round_trip(shape):
    codes = torch.randint(0, 16, shape, generator=_gen(3), dtype=torch.int32)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_int4(packed), codes)
    assert int(packed.flatten()[0]) == int(codes.flatten()[0]) | int(codes.flatten()[1]) << 4  # low nibble first


def test_pack_rejects_odd_shapes_and_bad_codes():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(4, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.tensor([[0, 16]]))
    with pytest.raises(ValueError, match="integer"):
        pack_int4(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="multiple of 16"):
        to_cpu_int4_layout(torch.zeros(24, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="even"):
        to_cpu_int4_layout(torch.zeros(16, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="uint8"):
        unpack_int4(torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.skipif(not HAS_INT4, reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("n,k", [(16, 2), (16, 64), (48, 64), (64, 64), (80, 96), (144, 130), (256, 640)])
def test_cpu_int4_layout_matches_torch_op_and_inverts(n, k):
    codes = torch.randint(0, 16, (n, k), generator=_gen(4), dtype=torch.int32)
    ours = to_cpu_int4_layout(codes)
    assert torch.equal(ours, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
    assert torch.equal(cpu_int4_pack(codes), ours)
    assert torch.equal(from_cpu_int4_layout(ours), codes)


# --- QuantLinear -------------------------------------------------------------------------------

LINEAR_CASES = [
    (QuantSpec(bits=8, sym=True, granularity="channel"), "int8"),
    (QuantSpec(bits=8, sym=False, granularity="channel"), "int8"),
    (QuantSpec(bits=6, sym=True, granularity="tensor"), "int8"),
    (QuantSpec(bits=4, sym=False, granularity="group", group_size=128), "int4"),
    (QuantSpec(bits=4, sym=True, granularity="group", group_size=32), "int4"),
    (QuantSpec(bits=4, sym=True, granularity="channel"), "int4"),
    (QuantSpec(bits=3, sym=False, granularity="group", group_size=64), "int4"),
    (QuantSpec(bits=2, sym=False, granularity="tensor"), "int4"),
    (QuantSpec(bits=6, sym=False, granularity="group", group_size=64), "dequant"),
    (QuantSpec(bits=4, sym=False, granularity="group", group_size=16), "dequant"),  # no kernel group of 16
]


@pytest.mark.parametrize("spec,kernel", LINEAR_CASES, ids=lambda c: c.label() if isinstance(c, QuantSpec) else c)
def test_quant_linear_equals_linear_with_its_dequantized_weight(spec, kernel):
    """fp32 activations: the kernel equals F.linear with the stored weight to fp32 rounding;
    bf16 activations (the fast default): to bf16 rounding."""
    if kernel == "int4" and not HAS_INT4:
        pytest.skip("no CPU int4 kernel")
    g = _gen(5)
    w, bias = torch.randn(96, 256, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(2, 5, 256, generator=g)
    qw = quantize_rtn(w, spec)
    exact = QuantLinear.from_quantized(qw, bias, act_dtype=torch.float32)
    assert exact.kernel == kernel == choose_kernel(spec, 96, 256)
    ref = F.linear(x, exact.dequantized_weight(), bias)
    y = exact(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # The stored weight is the canonical grid (asymmetric int4 keeps s * (8 - z) as a float).
    torch.testing.assert_close(exact.dequantized_weight(), qw.dequantize(), rtol=0, atol=1e-7)
    back = exact.quantized_weight()
    assert torch.equal(back.codes, qw.codes) and (back.zero is None or torch.equal(back.zero, qw.zero))

    fast = QuantLinear.from_quantized(quantize_rtn(w, replace(spec, scale_dtype=torch.bfloat16)), bias)  # bf16 acts
    y16 = fast(x)
    assert y16.dtype == torch.float32
    torch.testing.assert_close(y16, F.linear(x, fast.dequantized_weight(), bias), rtol=2e-2, atol=2e-2)


def test_quant_linear_bytes_and_kernel_fallbacks():
    w = torch.randn(128, 256, generator=_gen(6))
    int4 = QuantLinear.from_quantized(quantize_rtn(w, QuantSpec(bits=4, group_size=128)))
    int8 = QuantLinear.from_quantized(quantize_rtn(w, QuantSpec(bits=8, sym=True, granularity="channel")))
    fp32 = w.numel() * 4
    if HAS_INT4:
        assert int4.kernel == "int4" and int4.weight_nbytes == w.numel() // 2 + 2 * 128 * 2 * 2  # codes + bf16 s/zf
        assert int4.weight_nbytes < 0.14 * fp32  # 4.25 bits per weight
    assert int8.kernel == "int8" and int8.weight_nbytes == w.numel() + 128 * 2
    # out_features not a multiple of 16: the int4 kernel cannot take it.
    assert choose_kernel(QuantSpec(bits=4, group_size=32), 24, 64) == "dequant"
    assert choose_kernel(QuantSpec(bits=4, granularity="channel"), 24, 64) == "int8"
    assert choose_kernel(QuantSpec(bits=4), 32, 128, g_idx=torch.zeros(128, dtype=torch.long)) == "dequant"
    with pytest.raises(ValueError, match="kernel int8"):
        QuantLinear.from_quantized(quantize_rtn(w, QuantSpec(bits=8, group_size=64)), kernel="int8")
    with pytest.raises(ValueError, match="kernel"):
        QuantLinear(256, 128, QuantSpec(), kernel="fp4")


def test_dequant_fallback_handles_act_order_g_idx():
    """A permuted group assignment (GPTQ act-order) runs on the fallback, exactly."""
    g = _gen(7)
    spec = QuantSpec(bits=4, group_size=16)
    g_idx = torch.randperm(64, generator=g) // 16
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(32, 4, generator=g) + 0.1, torch.randint(0, 16, (32, 4), generator=g, dtype=torch.int32)
    qw = QuantizedWeight(codes, scale, zero, spec, g_idx)
    layer = QuantLinear.from_quantized(qw, act_dtype=torch.float32)
    assert layer.kernel == "dequant"
    expected = scale[:, g_idx] * (codes - zero[:, g_idx]).float()
    assert torch.equal(layer.dequantized_weight(), expected)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(layer(x), x @ expected.t())


# --- whole model -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    folder = tmp_path_factory.mktemp("tiny_llama_quant")
    make_model("llama", folder)
    return folder, load_model


def test_quantize_model_replaces_block_linears_and_matches_fake_quant(tiny_llama):
    """Every block linear becomes a QuantLinear whose logits equal the float model with
    fake-quantized weights (fp32 activations); embeddings and the head stay unless asked."""
    from tests.logits import all_position_logits

    folder, load = tiny_llama
    quant, fake = load(folder), load(folder)
    spec = QuantSpec(bits=4, group_size=32)
    with torch.no_grad():
        for block in fake.model.layers:
            for m in block.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(fake_quantize(m.weight, spec))
    before = model_weight_bytes(quant.model)
    report = quantize_model(quant.model, "rtn", bits=4, group_size=32, act_dtype=torch.float32, progress=False)
    assert len(report.layers) == 7 * len(quant.model.layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in quant.model.layers.modules())
    assert isinstance(quant.model.embed_tokens, torch.nn.Embedding) and isinstance(quant.model.lm_head, torch.nn.Linear)
    assert model_weight_bytes(quant.model) == before - report.bytes_before + report.bytes_after
    ids = list(range(3, 40))
    torch.testing.assert_close(all_position_logits(quant, ids), all_position_logits(fake, ids), rtol=1e-4, atol=1e-4)

    head = quantize_model(load(folder).model, bits=8, sym=True, granularity="channel", lm_head=True, progress=False)
    assert head.layers[-1].name == "lm_head"


def test_quantize_model_bad_arguments(tiny_llama):
    folder, load = tiny_llama
    model = load(folder).model
    with pytest.raises(ValueError, match="method"):
        quantize_model(model, "gptq-typo")
    with pytest.raises(ValueError, match="bits"):
        quantize_model(model, bits=9)
    with pytest.raises(ValueError, match="group_size 128 does not divide in_features 64"):
        quantize_model(model, bits=4, group_size=128, progress=False)
