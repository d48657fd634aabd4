"""dtype "auto" on the CPU keeps a bf16 / fp16 HF checkpoint's linear weights and embedding in 16
bits and computes in fp32 (kvserve/weights/half.py). Oracles: the fp32 model loaded from the same
folder (dtype "float32": the same widened weights), HF transformers in float32 on that folder,
and for the C kernel F.linear by the widened weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve import LLM, SamplingParams, kernels
from kvserve.loading import load_model
from kvserve.model.base import stored_weight_bytes
from kvserve.weights import half
from kvserve.weights.half import HalfEmbedding, HalfLinear, TiedHalfLinear
from tests.logits import all_position_logits
from tests.tiny_models import make_model

IDS = [5, 17, 42, 99, 3, 8, 100, 200, 31, 7, 64, 250]
PROMPTS = ["The quick brown fox", "def f(x):", "Paged attention stores keys"]
# |auto - fp32| / max |fp32 logit|: the same weights, fp32 sums in another order (measured ~1e-6)
REL_TOL = 1e-5
# Without a compiler the kernel's tests skip; `make test` (KVSERVE_REQUIRE_KERNELS=1) makes a failed
# build an error instead, as for the other kernels.
needs_kernel = pytest.mark.skipif(kernels.kernel_lib("half_gemv") is None, reason="no C compiler")


@pytest.fixture(scope="module", params=[("llama", torch.bfloat16), ("llama", torch.float16),
                                        ("gemma3", torch.bfloat16), ("gemma3", torch.float16),
                                        ("qwen2", torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def half_folder(request, tmp_path_factory):
    kind, dtype = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-half")
    make_model(kind, folder).to(dtype).save_pretrained(folder)  # transformers writes dtype: bfloat16 / float16
    return folder, dtype


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_weights_stay_16bit_in_memory(half_folder):
    folder, dtype = half_folder
    auto, fp32 = load_model(folder, "auto"), load_model(folder, "float32")
    model = auto.model
    linears = [m for m in model.modules() if isinstance(m, HalfLinear)]
    assert linears and not any(type(m) is nn.Linear for m in model.modules())
    assert {m.weight.dtype for m in linears} == {dtype}
    assert isinstance(model.embed_tokens, HalfEmbedding) and model.embed_tokens.weight.dtype == dtype
    if auto.config.tie_word_embeddings:  # one table: the head reads the embedding's
        assert isinstance(model.lm_head, TiedHalfLinear) and model.lm_head.weight is model.embed_tokens.weight
    assert next(model.parameters()).dtype == torch.float32  # what the engine computes (and caches K/V) in
    matrices = sum(p.numel() for p in fp32.model.parameters() if p.dim() == 2)
    others = sum(p.numel() for p in fp32.model.parameters() if p.dim() != 2)
    assert stored_weight_bytes(model) == 2 * matrices + 4 * others
    assert stored_weight_bytes(fp32.model) == 4 * (matrices + others)


def test_logits_equal_the_fp32_model_and_hf(half_folder):
    import transformers

    folder, _ = half_folder
    ours = all_position_logits(load_model(folder, "auto"), IDS)
    fp32 = all_position_logits(load_model(folder, "float32"), IDS)
    assert _rel(ours, fp32) < REL_TOL
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert _rel(ours, ref) < 1e-4


def test_greedy_tokens_equal_the_fp32_engine(half_folder):
    folder, _ = half_folder
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    auto = LLM(model=str(folder), kv_cache_gib=0.01)
    assert any(isinstance(m, HalfLinear) for m in auto.engine.loaded.model.modules())
    fp32 = LLM(model=str(folder), dtype="float32", kv_cache_gib=0.01)
    assert not any(isinstance(m, HalfLinear) for m in fp32.engine.loaded.model.modules())
    got = [o.outputs[0].token_ids for o in auto.generate(PROMPTS, params)]  # one batch: prefill and decode rows
    want = [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, params)]
    assert got == want


def test_explicit_dtypes_and_fp32_checkpoints_are_unchanged(tmp_path):
    half_dir, full_dir = tmp_path / "bf16", tmp_path / "fp32"
    make_model("llama", half_dir).to(torch.bfloat16).save_pretrained(half_dir)
    make_model("llama", full_dir)
    bf16 = load_model(half_dir, "bfloat16").model
    assert not any(isinstance(m, HalfLinear) for m in bf16.modules())
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    for model in (load_model(half_dir, "float32").model, load_model(full_dir, "auto").model):
        assert not any(isinstance(m, (HalfLinear, HalfEmbedding)) for m in model.modules())
        assert {p.dtype for p in model.parameters()} == {torch.float32}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 7, 5), (3, 33, 40), (4, 64, 1000), (half.GEMV_MAX_ROWS, 100, 648)])
def test_kernel_equals_the_widened_product(dtype, m, n, k):
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k).to(dtype)
    y = kernels.half_gemv(x, w)
    ref = F.linear(x.double(), w.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    rows = torch.cat([kernels.half_gemv(x[i:i + 1], w) for i in range(m)])
    assert torch.equal(y, rows)  # a row's result does not depend on the batch it is in


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widening_is_exact_for_every_16bit_value(dtype):
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    y = kernels.half_gemv(torch.ones(1, 1), bits.view(-1, 1))[0]  # the scalar tail: one weight per row
    ref = bits.float()
    finite = ~ref.isnan()
    assert torch.equal(y[finite], ref[finite]) and y[~finite].isnan().all()


@pytest.mark.parametrize("rows", [1, half.GEMV_MAX_ROWS + 1, 40])
def test_layer_equals_its_fallback_and_f_linear(monkeypatch, rows):
    torch.manual_seed(1)
    w, b = torch.randn(96, 72).to(torch.bfloat16), torch.randn(96)
    layer = HalfLinear(w, b)
    x = torch.randn(2, rows, 72)
    y = layer(x)
    ref = F.linear(x, w.float(), b)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(kernels, "half_gemv", lambda *a: None)  # the torch path (as KVSERVE_NO_KERNELS=1)
    monkeypatch.setattr(half, "_WIDEN_CHUNK", 72 * 10)  # several chunks of 10 output rows
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    assert layer(x[:, :0]).shape == (2, 0, 96)


def test_bad_half_weights_are_refused():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        HalfLinear(torch.randn(4, 4))
    with pytest.raises(ValueError, match="bias"):
        HalfLinear(torch.randn(4, 4).to(torch.bfloat16), torch.randn(3))


def test_a_wrong_shape_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvserve.loading.errors import ModelLoadError

    make_model("llama", tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.0.mlp.up_proj.weight.*shape"):
        load_model(tmp_path, "auto")
