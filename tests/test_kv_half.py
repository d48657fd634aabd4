"""Float KV pools of a stated width (`kv_cache_dtype` "fp16" / "bf16" / "fp32"): the C kernels that
write and read the pool round and widen as torch's `.to()` does, the attention kernels equal
float64 attention over the pool's own values, the engine gives the same tokens with the kernels
(the decode plan included) as on the torch path over the same pool, and GGUF blocks get an
fp16 pool by default."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve import kernels
from kvserve.model.attention import KV_CACHE_DTYPES, KVCache

HALF = [torch.float16, torch.bfloat16]


def _kernel(got, lib: str):
    """The kernel's output; a skip only where its library cannot be built (no compiler), a failure
    where the library is there but declined the 16-bit pools."""
    if got is None:
        if kernels.kernel_lib(lib) is None:
            pytest.skip(f"C kernel {lib} unavailable")
        pytest.fail(f"C kernel {lib} declined these 16-bit pools")
    return got


@pytest.mark.parametrize("dtype", HALF)
def test_prologue_writes_rows_rounded_as_torch_rounds_them(dtype):
    g = torch.Generator().manual_seed(0)
    T, H, KVH, D = 5, 4, 2, 64
    q, k, v = (torch.randn(T, n, D, generator=g) * 3 for n in (H, KVH, KVH))
    k[0, 0, :4] = torch.tensor([70000.0, -1e-8, float("nan"), 1 + 2 ** -11])  # overflow, tiny, NaN, a tie
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    slots = torch.tensor([7, 2, 9, 0, 4])
    pools32 = [torch.zeros(12, KVH, D) for _ in range(2)]
    pools16 = [torch.zeros(12, KVH, D, dtype=dtype) for _ in range(2)]
    q32 = _kernel(kernels.norm_rope_write(q, k, v, None, None, 1e-6, cos, sin, slots, *pools32), "rope_cache")
    q16 = _kernel(kernels.norm_rope_write(q, k, v, None, None, 1e-6, cos, sin, slots, *pools16), "rope_cache")
    assert torch.equal(q16, q32)
    for p16, p32 in zip(pools16, pools32):
        assert torch.equal(p16.float().nan_to_num(7.0), p32.to(dtype).float().nan_to_num(7.0))
    assert pools16[0][7, 0, 2].isnan()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (8, 2, 64)])
def test_decode_kernel_reads_half_pools(dtype, heads, kv_heads, head_dim):
    from tests.test_paged_attention import BS, _pool, _reference

    lens = [1, 17, 300, 1500]
    k, v, tables = _pool(lens, kv_heads, head_dim, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    starts = (lens_t - 40).clamp(min=0)
    q = torch.randn(len(lens), heads, head_dim)
    out = _kernel(kernels.paged_decode_attention(q, k, v, tables, starts, lens_t, BS,
                                                 1 / math.sqrt(head_dim), max(lens)), "paged_attention")
    assert out.dtype == torch.float32
    want = _reference(q, k.float(), v.float(), tables, starts, lens_t)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # a bf16 q reads only a bf16 pool
    assert (kernels.paged_decode_attention(q.bfloat16(), k, v, tables, starts, lens_t, BS, 0.1, max(lens)) is None) \
        == (dtype == torch.float16)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_kernel_reads_half_pools(dtype, window):
    from tests.test_prefill_attention import _case
    from tests.test_prefill_attention import _reference as reference

    q, k_pool, v_pool, slots, first_kv, first_q, window, scale = _case(64, 8, 2, 64, 300, window)
    k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    got = _kernel(kernels.prefill_attention(q, k_pool, v_pool, slots, first_kv, first_q, window, scale),
                  "prefill_attention")
    want = reference(q, k_pool.float(), v_pool.float(), slots, first_kv, first_q, window, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


def test_half_pool_holds_half_the_bytes():
    assert {"fp16", "bf16"} <= set(KV_CACHE_DTYPES)
    assert KVCache.bytes_per_token_head(64, torch.float32, "fp16") * 2 == KVCache.bytes_per_token_head(64, torch.float32)
    pool = KVCache(2, 32, 2, 64, torch.float32, kv_dtype="bf16")
    assert pool.k[0].dtype == torch.bfloat16 and not pool.quantized
    assert pool.nbytes * 2 == KVCache(2, 32, 2, 64, torch.float32).nbytes
    slots = torch.tensor([3, 5])
    x = torch.randn(2, 2, 64)
    pool.write(0, slots, x, x)
    k, _ = pool.read(0, slots)
    assert k.dtype == torch.float32 and torch.equal(k, x.bfloat16().float())


def test_fp32_pool_for_a_16_bit_model():
    """"fp32" stores what a bf16 model's "auto" pool would round: rows kept exact, read back in bf16."""
    pool = KVCache(2, 32, 2, 64, torch.bfloat16, kv_dtype="fp32")
    assert pool.k[0].dtype == torch.float32
    assert KVCache.bytes_per_token_head(64, torch.bfloat16, "fp32") == 2 * KVCache.bytes_per_token_head(64, torch.bfloat16)
    x = torch.randn(2, 2, 64)
    pool.write(1, torch.tensor([0, 31]), x, x)
    k, v = pool.read(1, torch.tensor([0, 31]))
    assert k.dtype == torch.bfloat16 and torch.equal(pool.k[1][[0, 31]], x) and torch.equal(v, x.bfloat16())


def test_gguf_weights_default_to_llama_cpps_fp16_pool(gemma_path):
    """"auto" with a GGUF's own blocks and int8 activations (llama.cpp's arithmetic) is fp16, as
    llama.cpp's cache; the float activations (the exact reference) and float weights keep the
    model's dtype; an explicit type always wins."""
    from kvserve import LLM
    from kvserve.config import EngineConfig

    assert EngineConfig(weights="gguf").kv_cache_dtype == "fp16"
    assert EngineConfig(weights="gguf").cache_config.kv_cache_dtype == "fp16"
    assert EngineConfig(weights="gguf", gguf_activations="float").kv_cache_dtype == "auto"
    assert EngineConfig().kv_cache_dtype == "auto"
    for explicit in ("fp32", "bf16", "int8"):
        assert EngineConfig(weights="gguf", kv_cache_dtype=explicit).kv_cache_dtype == explicit
    for kv_dtype, store in (("auto", torch.float16), ("fp32", torch.float32)):
        engine = LLM(model=str(gemma_path), weights="gguf", kv_cache_gib=0.02, kv_cache_dtype=kv_dtype).engine
        assert {t.dtype for t in engine.kv_cache.k + engine.kv_cache.v} == {store}


def test_cli_offers_every_pool_dtype():
    from kvserve.cli import build_parser

    for dtype in KV_CACHE_DTYPES:
        assert build_parser().parse_args(["generate", "--kv-cache-dtype", dtype, "hi"]).kv_cache_dtype == dtype
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "fp4", "hi"])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    out = {}
    for kind in ("gemma3", "llama"):
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
        make_model(kind, folder)
        out[kind] = load_model(folder)
    return out


def _generate(loaded, kv_dtype, prompts, max_tokens=20):
    from kvserve import LLM, SamplingParams

    llm = LLM(loaded=loaded, kv_cache_gib=0.01, kv_cache_dtype=kv_dtype, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
def test_engine_tokens_equal_the_torch_path_over_the_same_pool(tiny_models, kind, kv_dtype, monkeypatch):
    import kvserve.model.attention as attention
    from kvserve.accel.decode_plan import DecodePlan

    if kernels.paged_attention_lib() is None:
        pytest.skip("C kernel unavailable")
    loaded = tiny_models[kind]
    batch = [[2] + [(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate([3, 15, 40, 70])]
    single = [batch[2]]  # batch-1 decode steps run the decode plan
    ran = []
    run = DecodePlan.run
    monkeypatch.setattr(DecodePlan, "run", lambda self, *a: ran.append(1) or run(self, *a))
    fast = [_generate(loaded, kv_dtype, p) for p in (batch, single)]
    assert ran, "the decode plan did not run on a 16-bit pool"
    for name in ("paged_decode_attention", "prefill_attention", "norm_rope_write"):
        monkeypatch.setattr(attention, name, lambda *a, **k: None)
    monkeypatch.setattr(DecodePlan, "applies", staticmethod(lambda h, meta: False))
    slow = [_generate(loaded, kv_dtype, p) for p in (batch, single)]
    # The paths round fp32 K/V into the pool the same way (to nearest even), but the fp32 values
    # they compute can differ by an ulp (other kernels, other orders), and where that flips a
    # rounding the stored value moves by one unit of the pool's dtype: bf16's unit is 8x fp16's
    # (8 bits of mantissa against 11), and so is the tolerance. (On an Intel Xeon: 3.7e-4 on
    # bf16, where each path is 1.5e-2 from the fp32 pool's logprobs.)
    tol = {"fp16": 1e-4, "bf16": 8e-4}[kv_dtype]
    for (fast_tokens, fast_lp), (slow_tokens, slow_lp) in zip(fast, slow):
        assert fast_tokens == slow_tokens
        torch.testing.assert_close(torch.tensor(fast_lp), torch.tensor(slow_lp), atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,kl_mean,kl_max", [("fp16", 1e-5, 1e-4), ("bf16", 1e-4, 1e-3)])
def test_gemma_with_a_half_pool_stays_at_the_fp32_pools_distribution(gemma, kv_dtype, kl_mean, kl_max):
    """What a 16-bit pool costs the bundled model on text, every position reading its K/V from the
    pool: per-position KL(fp32 pool || 16-bit pool) measured 2.3e-7 mean / 4.1e-6 max (fp16) and
    8.8e-6 / 5.6e-5 (bf16); the same top-1 token at every position."""
    from tests.logits import all_position_logits
    from tests.test_ggml_blocks import WIKI_TEXT

    ids = gemma.tokenizer.encode(WIKI_TEXT)
    ref = torch.log_softmax(all_position_logits(gemma, ids).double(), -1)
    ours = torch.log_softmax(all_position_logits(gemma, ids, kv_dtype=kv_dtype).double(), -1)
    kl = (ref.exp() * (ref - ours)).sum(-1)
    assert kl.mean() < kl_mean and kl.max() < kl_max, (kl.mean(), kl.max())
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
