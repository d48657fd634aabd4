"""GGUF's quantized blocks kept as they are (kvserve/weights/ggml.py, kernels/ggml_blocks.c and
ggml_int8.c): every block type dequantizes to exactly the values of the `gguf` package's own
dequantizer; with float activations the layer's products equal fp32 matmuls with those values
(to fp32 summation-order rounding); with int8 activations they differ from them by no more than
the activations' rounding can explain, and the vector kernel computes what its plain C loops do."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize

from kvserve import kernels
from kvserve.loading import gguf as gguf_loading
from kvserve.weights import ggml as ggml_weights
from kvserve.weights.ggml import (
    GEMV_MAX_ROWS,
    GGML_TYPES,
    INT8_ROW_KERNEL_MAX_ROWS,
    INT8_TYPES,
    GGMLLinear,
    row_bytes,
)
from tests.conftest import WIKITEXT

T = gguf.GGMLQuantizationType
# Byte offsets of each block's fp16 scale fields (random bytes there could be NaN or inf).
_FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
                T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(t: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of random codes with finite random fp16 scales."""
    rng = np.random.default_rng(seed)
    if t in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if t == T.F32:
            return w.view(np.uint8)
        if t == T.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    values, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for off in _FP16_FIELDS[t]:
        scale = (rng.standard_normal((rows, cols // values)) * 0.02).astype(np.float16)
        scale[0, 0] = np.float16(6.1e-6)  # a subnormal half: the C conversion must be exact there too
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // values, 2)
    return raw.reshape(rows, -1)


def _cols(t: T) -> int:
    return 512 if gguf.GGML_QUANT_SIZES[t][0] == 256 else 96


@pytest.mark.parametrize("t", GGML_TYPES, ids=lambda t: t.name)
def test_every_type_dequantizes_to_the_gguf_packages_values(t):
    raw = random_blocks(t, 7, _cols(t))
    want = np.asarray(gguf_dequantize(raw, t), dtype=np.float32).reshape(7, -1)
    layer = GGMLLinear(torch.from_numpy(raw.copy()), t, _cols(t), 7)
    got = kernels.ggml_dequant(layer.raw, int(t), _cols(t), torch.tensor([3, 0, 6, 3]))
    assert got is not None
    assert torch.equal(got, torch.from_numpy(want[[3, 0, 6, 3]]))
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(want))


@pytest.mark.parametrize("t", GGML_TYPES, ids=lambda t: t.name)
def test_the_fp32_conversion_takes_the_kernels_values(t, monkeypatch):
    """A GGUF's conversion to fp32 (loading/gguf.py `dequantized`) dequantizes blocks in C, a
    matrix and a stack of experts alike, to the gguf package's values; only the plain types are
    left to the package."""
    raw = random_blocks(t, 6, _cols(t))
    data = raw.view(np.float32) if t == T.F32 else raw.view(np.float16) if t == T.F16 else raw  # as GGUFTensor.data
    wants = [np.asarray(gguf_dequantize(d, t), dtype=np.float32) for d in (data, data.reshape(2, 3, -1))]

    def plain_only(d, qtype):
        assert qtype in (T.F32, T.F16), f"{qtype.name} went to the gguf package"
        return gguf_dequantize(d, qtype)

    monkeypatch.setattr(gguf_loading, "dequantize", plain_only)
    monkeypatch.setattr(ggml_weights, "gguf_dequantize", plain_only)  # (the C kernel's fallback)
    for d, want in zip((data, data.reshape(2, 3, -1)), wants):
        got = gguf_loading.dequantized(d, t, _cols(t))
        assert got.dtype == np.float32 and got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("t", GGML_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 3])
def test_products_equal_fp32_matmuls_with_the_dequantized_weight(t, rows):
    k = _cols(t)
    layer = GGMLLinear(torch.from_numpy(random_blocks(t, 40, k, seed=1)), t, k, 40, activations="float")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x.double(), layer.dequantized_weight().double())
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    scale = x.double().abs() @ layer.dequantized_weight().double().abs().T
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-30).all()
    # A row's arithmetic does not depend on the rows beside it (decode alone = batched).
    if rows <= GEMV_MAX_ROWS:
        assert torch.equal(layer(x[:1]), got[:1])


def activation_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x W^T - x' W^T| can be at most this [M, N] when x' rounds each 32 values of x to int8
    steps of max|x| / 127 (at most half a step off each): sum over blocks of half a step times
    that block's sum of |w|."""
    m, k = x.shape
    half_step = x.double().reshape(m, k // 32, 32).abs().amax(-1) / 254  # [M, K / 32]
    w_abs = w.double().abs().reshape(w.shape[0], k // 32, 32).sum(-1)  # [N, K / 32]
    return half_step @ w_abs.T


@pytest.mark.parametrize("t", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 12, 14, 70])
def test_int8_activation_products_stay_within_the_activations_rounding(t, rows):
    k = 2 * _cols(t) if t not in (T.Q4_0, T.Q5_0, T.Q8_0) else 224  # 7 blocks: four at a time (Q4_0 / Q5_0), a pair, an odd one
    layer = GGMLLinear(torch.from_numpy(random_blocks(t, 40, k, seed=2)), t, k, 40)
    assert layer.int8_path
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 5] *= 30  # an outlier: its block's other values get coarse steps
    w = layer.dequantized_weight()
    got, want = layer(x).double(), F.linear(x.double(), w.double())
    scale = x.double().abs() @ w.double().abs().T
    assert ((got - want).abs() <= activation_rounding_bound(x, w) + 1e-5 * scale).all()
    assert (got - want).abs().max() > 1e-5 * scale.max()  # the int8 path did run
    # The vector kernel against its plain C loops: the same integer dots, the same scales.
    ref = kernels.ggml_q8_matmul(x, layer.raw, int(t), 40, reference=True)
    assert ref is not None and ((got - ref.double()).abs() <= 1e-5 * scale).all()
    # A row's result does not depend on the rows beside it, within each kernel's range: up to
    # INT8_ROW_KERNEL_MAX_ROWS rows on the per-row kernel, more on the GEMM.
    fewer = x[-1:] if rows <= INT8_ROW_KERNEL_MAX_ROWS else x[1:]
    assert torch.equal(layer(fewer)[-1:], layer(x)[-1:])


def test_activation_quantization_vector_block_equals_the_plain_loop():
    """The matmuls quantize activations 16 lanes at a time (AVX-512 builds); codes and scales are
    bitwise the plain loop's, halfway values (rounded to even), zero and tiny blocks included."""
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1e-3], [1.0], [40.0], [1e4]])
    x[:, ::97] *= 50  # outliers
    x[1, 64:96] = 0.0  # a zero block: dx 0, codes 0
    x[2, 128:160] = 1e-38  # subnormal scale territory
    x[3, 0:32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5] * 4)  # dx 1: exact halves
    for row in x:
        vec, plain = kernels.ggml_q8_quantize(row), kernels.ggml_q8_quantize(row, vector=False)
        assert torch.equal(vec[0], plain[0]) and torch.equal(vec[1], plain[1])
        # Both against torch's fp32 arithmetic (so the test bites on builds without AVX-512 too):
        # dx = max|x| / 127 per block of 32, codes = x * (1 / dx) rounded half to even.
        blocks = row.view(-1, 32)
        dx = blocks.abs().amax(dim=1) / 127
        inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
        assert torch.equal(vec[0], torch.round(blocks * inv[:, None]).to(torch.int8).view(-1))
        assert torch.equal(vec[1][:dx.numel()], dx)
    codes = kernels.ggml_q8_quantize(x[3])[0]
    assert codes[:8].tolist() == [127, 2, 4, -2, -4, 0, 0, 2]  # half to even
    assert kernels.ggml_q8_quantize(torch.randn(48)) is None  # not whole blocks of 32


def test_int8_path_keeps_other_types_and_float_activations_on_the_float_kernels():
    q4_1 = GGMLLinear(torch.from_numpy(random_blocks(T.Q4_1, 8, 64)), T.Q4_1, 64, 8)
    q8_0 = GGMLLinear(torch.from_numpy(random_blocks(T.Q8_0, 8, 64)), T.Q8_0, 64, 8, activations="float")
    assert not q4_1.int8_path and not q8_0.int8_path
    x = torch.randn(3, 64)
    for layer in (q4_1, q8_0):
        want = F.linear(x.double(), layer.dequantized_weight().double())
        assert ((layer(x).double() - want).abs() <= 1e-5 * (x.abs() @ layer.dequantized_weight().abs().T)).all()
    with pytest.raises(ValueError, match="activations must be one of"):
        GGMLLinear(q8_0.raw, T.Q8_0, 64, 8, activations="int4")


def test_bad_shapes_and_types_are_refused_naming_them():
    with pytest.raises(ValueError, match="Q4_0.*whole blocks of 32"):
        row_bytes(T.Q4_0, 48)
    with pytest.raises(ValueError, match="needs uint8 bytes of shape"):
        GGMLLinear(torch.zeros(4, 10, dtype=torch.uint8), T.Q8_0, 32, 4)
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        GGMLLinear(torch.zeros(4, 66, dtype=torch.uint8), T.IQ2_XXS, 256, 4)


@pytest.fixture(scope="module")
def gemma_blocks(gemma_path):
    """The bundled Gemma 3 270M Q4_K_M as its own blocks (Q8_0, Q5_0, Q4_K, Q6_K), float activations."""
    from kvserve.loading import load_model

    return load_model(gemma_path, gguf_blocks=True, gguf_activations="float")


@pytest.mark.slow
def test_gemma_blocks_compute_the_float_models_logits(gemma, gemma_blocks):
    from tests.logits import all_position_logits

    types = {m.ggml_type.name for m in gemma_blocks.model.modules() if isinstance(m, GGMLLinear)}
    assert types == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    ids = torch.randint(3, 262144, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ref = all_position_logits(gemma_blocks, ids), all_position_logits(gemma, ids)
    # The same weights; only the order of fp32 sums differs (16 lanes against MKL's).
    assert (ours - ref).abs().max().item() < 2e-3 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# A sentence of WikiText-2 (tests/test_kv_half.py reads it too).
WIKI_TEXT = ("Robert Boulter is an English film , television and theatre actor . He had a guest @-@ starring role on "
             "the television series The Bill in 2000 . This was followed by a starring role in the play Herons "
             "written by Simon Stephens")


@pytest.mark.slow
def test_gemma_int8_activations_stay_close_to_the_float_model(gemma, gemma_path):
    """The contract of int8 activations (llama.cpp's arithmetic) on the bundled model, over the
    first 512 tokens of WikiText-2's test text: per-position KL(float || int8) 0.005 on average
    (measured 0.0019-0.0023 over four windows, with the per-row kernel and with the GEMM) and
    0.05 at the 99th percentile (0.007-0.017); the mean NLL within 0.5% (0.04-0.13%); top-1 equal
    at 93% of positions or more (96-98%). Over a few dozen tokens these statistics move with the
    last bits of a sum's order (the GEMM's against the per-row kernel's: a 52-token sentence's NLL
    0.7% against 0.03% off), so the window is long enough to average the rounding out."""
    from kvserve.loading import load_model
    from tests.logits import all_position_logits

    int8 = load_model(gemma_path, gguf_blocks=True)
    assert all(m.int8_path for m in int8.model.modules() if isinstance(m, GGMLLinear))
    text = (WIKITEXT / "wiki.test.raw").read_text(encoding="utf-8")[:2400]
    ids = gemma.tokenizer.encode(text)[:512]
    assert len(ids) == 512
    ref = torch.log_softmax(all_position_logits(gemma, ids).double(), -1)
    ours = torch.log_softmax(all_position_logits(int8, ids).double(), -1)
    kl = (ref.exp() * (ref - ours)).sum(-1)
    assert kl.mean() < 0.005 and kl.quantile(0.99) < 0.05, (kl.mean(), kl.quantile(0.99))
    target = torch.tensor(ids[1:])[:, None]
    nll_ref, nll = -ref[:-1].gather(1, target).mean(), -ours[:-1].gather(1, target).mean()
    assert abs(nll / nll_ref - 1) < 0.005, (nll_ref, nll)
    assert (ours.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.93


def greedy_parts_only_at_near_ties(ref, got, tie: float) -> None:
    """Greedy tokens equal the reference's, or part from them first at a token the reference ranks
    within `tie` in log-probability of its own top (a near-tie; the reference carries its top-5)."""
    for r, g in zip(ref, got):
        want, have = r.outputs[0].token_ids, g.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), len(want))
        if n < len(want):
            top = r.outputs[0].top_logprobs[n]
            assert have[n] in top and top[want[n]] - top[have[n]] <= tie, (r.prompt, n, top)


@pytest.mark.slow
@pytest.mark.parametrize("activations,tie", [("float", 1e-3), ("int8", 0.5)])
def test_gemma_blocks_greedy_tokens_equal_the_float_models(gemma_path, gemma_llm, activations, tie):
    """Float activations part from the fp32 model only at ties that fp32 summation order may break
    either way (1e-3); int8 activations (with the fp16 pool they get by default) only at a token
    within 0.5 of the float model's top in log-probability: on 1000 positions of WikiText-2 their top-1 differs from the float model's at 1.8% of
    positions, where the float model's margin was at most 0.48."""
    from kvserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Robert Boulter is an English film and television"]
    ref = gemma_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5))
    llm = LLM(model=str(gemma_path), weights="gguf", gguf_activations=activations, kv_cache_gib=0.25)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    greedy_parts_only_at_near_ties(ref, got, tie)
