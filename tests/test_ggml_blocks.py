"""GGUF's quantized blocks kept as they are (kvserve/weights/ggml.py, kernels/ggml_blocks.c):
every block type dequantizes to exactly the values of the `gguf` package's own dequantizer, and
the layer's products equal fp32 matmuls with those values (to fp32 summation-order rounding)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize

from kvserve import kernels
from kvserve.weights.ggml import GEMV_MAX_ROWS, GGML_TYPES, GGMLLinear, row_bytes

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
@pytest.mark.parametrize("rows", [1, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 3])
def test_products_equal_fp32_matmuls_with_the_dequantized_weight(t, rows):
    k = _cols(t)
    layer = GGMLLinear(torch.from_numpy(random_blocks(t, 40, k, seed=1)), t, k, 40)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x.double(), layer.dequantized_weight().double())
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    scale = x.double().abs() @ layer.dequantized_weight().double().abs().T
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-30).all()
    # A row's arithmetic does not depend on the rows beside it (decode alone = batched).
    if rows <= GEMV_MAX_ROWS:
        assert torch.equal(layer(x[:1]), got[:1])


def test_bad_shapes_and_types_are_refused_naming_them():
    with pytest.raises(ValueError, match="Q4_0.*whole blocks of 32"):
        row_bytes(T.Q4_0, 48)
    with pytest.raises(ValueError, match="needs uint8 bytes of shape"):
        GGMLLinear(torch.zeros(4, 10, dtype=torch.uint8), T.Q8_0, 32, 4)
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        GGMLLinear(torch.zeros(4, 66, dtype=torch.uint8), T.IQ2_XXS, 256, 4)


@pytest.fixture(scope="module")
def gemma_blocks(gemma_path):
    """The bundled Gemma 3 270M Q4_K_M as its own blocks (Q8_0, Q5_0, Q4_K, Q6_K)."""
    from kvserve.loading import load_model

    return load_model(gemma_path, gguf_blocks=True)


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


@pytest.mark.slow
def test_gemma_blocks_greedy_tokens_equal_the_float_models(gemma_path, gemma_llm):
    """Greedy tokens equal the fp32 model's, or part from them only where that model's top two
    tokens are within 1e-3 in log-probability (a tie fp32 summation order may break either way)."""
    from kvserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Robert Boulter is an English film and television"]
    ref = gemma_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
    llm = LLM(model=str(gemma_path), weights="gguf", kv_cache_gib=0.25)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for r, g in zip(ref, got):
        want, have = r.outputs[0].token_ids, g.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), len(want))
        if n < len(want):
            top = r.outputs[0].top_logprobs[n]
            assert have[n] in top and top[want[n]] - top[have[n]] <= 1e-3, (r.prompt, n)
