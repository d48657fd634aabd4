"""EngineConfig.weights / `--weights int8|int4`: the engine RTN-quantizes every linear, the LM head
and the embedding at start, in PyTorch's CPU int8 / int4 layouts, and runs them on kvserve's C
kernels (fp32 arithmetic; PyTorch's bf16-activation kernels without a compiler).

Oracle: the same engine over a float model whose every layer multiplies by the *dequantized*
weight in fp32 (activations rounded to bf16 first where PyTorch's kernels run, as they do):
greedy tokens must be equal."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.weights.embedding import QuantEmbedding
from kvserve.weights.linear import QuantLinear

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


class DequantizedLinear(nn.Module):
    """The oracle for one QuantLinear: fp32 matmul by its dequantized weight; the input rounded to
    the kernel's activation dtype when the layer runs on PyTorch's kernels (no C kernel)."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.weight = q.dequantized_weight()
        self.bias = q.bias
        self.act_dtype = q.act_dtype if q._gemv is None else torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(self.act_dtype).to(x.dtype), self.weight.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)


def dequantized_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules(remove_duplicate=False)):
        parent, _, leaf = name.rpartition(".")
        owner = ref.get_submodule(parent) if parent else ref
        # A tied QuantEmbedding keeps its source: its lookup already reads dequantized rows exactly.
        if isinstance(m, QuantLinear) and not isinstance(owner, QuantEmbedding):
            setattr(owner, leaf, DequantizedLinear(m))
    return ref


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_greedy_equals_the_dequantized_reference(gemma, weights):
    import dataclasses

    llm = LLM(loaded=gemma, weights=weights, kv_cache_gib=0.25)
    model = llm.engine.loaded.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * gemma.config.num_layers + 1  # qkv (fused), o, gate_up (fused), down; the head
    assert {m.kernel for m in linears} == {weights}
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.source is model.lm_head
    # The caller's model is untouched: the engine quantized a copy.
    assert not any(isinstance(m, QuantLinear) for m in gemma.model.modules())
    assert isinstance(gemma.model.embed_tokens, nn.Embedding)

    ref = LLM(loaded=dataclasses.replace(gemma, model=dequantized_copy(model)), kv_cache_gib=0.25)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    assert got == want
    # Batched (one step for all three) and alone give the same tokens.
    assert [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS] == got


def test_weights_shrink_what_a_decode_step_reads(gemma):
    from kvserve.model.base import stored_weight_bytes

    fp32 = stored_weight_bytes(gemma.model)
    int4 = stored_weight_bytes(LLM(loaded=gemma, weights="int4", kv_cache_gib=0.1).engine.loaded.model)
    # Only the 640-wide norms and the bf16 scales stay beside the 4-bit codes.
    assert int4 < 0.16 * fp32, (int4, fp32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(weights="int3"), "weights must be one of"),
    (dict(weights="fp32", dtype="bfloat16"), "contradicts dtype"),
    (dict(weights="int8", device="cuda"), "device must be 'cpu'"),
    (dict(weights="int4", speculative="self", self_draft_bits=4), "speculative='self'"),
    (dict(weights="gguf", speculative="self", self_draft_dtype="bfloat16"), "self_draft_dtype"),
])
def test_bad_weights_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_fp32_is_an_alias_of_float():
    assert EngineConfig(weights="fp32").weights == "float"


def test_an_already_quantized_model_is_refused(tmp_path):
    from kvserve.compress.quant.apply import quantize_model
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "llama")
    loaded = load_model(tmp_path / "llama")
    quantize_model(loaded.model, "rtn", bits=8, granularity="channel", sym=True, progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(loaded=loaded, weights="int8", kv_cache_gib=0.05)


def test_cli_generate_with_int4_weights(tmp_path, capsys):
    from kvserve.cli import main
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "llama")
    assert main(["generate", "--model", str(tmp_path / "llama"), "--weights", "int4", "--max-tokens", "4",
                 "--ignore-eos", "--kv-cache-gib", "0.05", "--quiet-metrics", "hello"]) == 0


@pytest.mark.parametrize("spec", [
    dict(bits=8, sym=True, granularity="channel"),
    dict(bits=4, sym=True, granularity="group", group_size=32),
    dict(bits=4, sym=False, granularity="group", group_size=32),
])
def test_kernel_path_is_the_fp32_dequantized_product(monkeypatch, spec):
    """kvserve's C kernels (use_gemv_kernel): up to GEMV_MAX_ROWS rows, F.linear by the dequantized
    weight up to fp32 rounding, each row bitwise what it is alone; more rows, that F.linear itself.
    K = 96: the kernels' wide and narrow loops both run; N = 144: whole row tiles and a short last one."""
    from kvserve.kernels import lowbit_lib
    from kvserve.weights.linear import GEMV_MAX_ROWS
    from kvserve.weights.rtn import quantize_rtn
    from kvserve.weights.spec import QuantSpec

    if lowbit_lib() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    layer = QuantLinear.from_quantized(quantize_rtn(torch.randn(144, 96, generator=g),
                                                    QuantSpec(scale_dtype=torch.bfloat16, **spec)))
    x = torch.randn(GEMV_MAX_ROWS + 5, 96, generator=g)
    torch_path = layer(x[:3])
    assert layer.use_gemv_kernel()
    w = layer.dequantized_weight()
    few = layer(x[:GEMV_MAX_ROWS])
    ref = F.linear(x[:GEMV_MAX_ROWS], w)
    # fp32 error bound of a K-term sum (int4 takes s * sum(u x) + (z - 8 s) * sum(x): cancellation)
    bound = 1e-5 * (x[:GEMV_MAX_ROWS].abs() @ (w.abs() + 2 * w.abs().max()).t())
    assert (few - ref).abs().le(bound).all()
    assert all(torch.equal(layer(x[i:i + 1]), few[i:i + 1]) for i in range(0, GEMV_MAX_ROWS, 7))
    assert torch.equal(layer(x), F.linear(x, w))  # past GEMV_MAX_ROWS: the dequantized matmul
    # PyTorch's kernels (bf16 activations) agree to a bf16 rounding.
    torch.testing.assert_close(few[:3], torch_path, rtol=2 ** -6, atol=2 ** -6 * float(ref.abs().max()))
    monkeypatch.setenv("KVSERVE_NO_KERNELS", "1")
    from kvserve.kernels import kernel_lib
    kernel_lib.cache_clear()
    try:
        assert torch.equal(layer(x[:3]), torch_path)  # no kernel: PyTorch's path
    finally:
        kernel_lib.cache_clear()


def test_int4_tile_height_is_read_off_the_op():
    from kvserve.weights.packing import cpu_int4_block_n

    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        pytest.skip("this torch has no CPU int4 kernel")
    bn = cpu_int4_block_n()
    assert bn in (32, 64)
    codes = torch.zeros(bn, 2, dtype=torch.int32)
    codes[bn // 2, 0] = 3  # the first row of the tile's upper half: the high nibble of byte 0
    assert torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2).reshape(-1)[0] == 3 << 4


def test_int8_kernel_is_not_chosen_for_widths_pytorchs_op_gets_wrong():
    from kvserve.weights.linear import choose_kernel
    from kvserve.weights.spec import QuantSpec

    spec = QuantSpec(bits=8, sym=True, granularity="channel")
    assert choose_kernel(spec, 96, 80) == "int8"
    assert choose_kernel(spec, 96, 72) == "dequant"  # _weight_int8pack_mm breaks at K % 16 != 0


@pytest.mark.parametrize("kernel, spec", [
    ("int4", dict(bits=4, sym=False, granularity="group", group_size=32)),
    ("int8", dict(bits=8, sym=True, granularity="channel")),
    ("int8", dict(bits=8, sym=False, granularity="channel")),
])
def test_fused_rows_equal_the_separate_layers(kernel, spec):
    from kvserve.accel.fused_quant import concat_rows
    from kvserve.weights.rtn import quantize_rtn
    from kvserve.weights.spec import QuantSpec

    g = torch.Generator().manual_seed(0)
    s = QuantSpec(scale_dtype=torch.bfloat16, **spec)
    parts = [QuantLinear.from_quantized(quantize_rtn(torch.randn(n, 64, generator=g), s)) for n in (128, 64, 64)]
    fused = concat_rows(parts)
    assert fused is not None and fused.kernel == kernel
    assert torch.equal(fused.dequantized_weight(), torch.cat([p.dequantized_weight() for p in parts]))
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1), rtol=1e-2, atol=1e-2)
    # Not fusable: int4 rows off the 64-row tiles, a bias, different grids.
    odd = QuantLinear.from_quantized(quantize_rtn(torch.randn(48, 64, generator=g), s))
    assert (concat_rows([parts[0], odd]) is None) == (kernel == "int4")
    biased = QuantLinear.from_quantized(quantize_rtn(torch.randn(64, 64, generator=g), s), bias=torch.zeros(64))
    assert concat_rows([parts[0], biased]) is None
    flipped = QuantSpec(scale_dtype=torch.bfloat16, **dict(spec, sym=not spec["sym"]))
    other = QuantLinear.from_quantized(quantize_rtn(torch.randn(64, 64, generator=g), flipped))
    assert concat_rows([parts[0], other]) is None
