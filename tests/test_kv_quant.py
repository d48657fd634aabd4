"""KV-cache quantization in the paged pool (`kv_cache_dtype` int8 / fp8 e4m3).

Oracles: the quantization grid itself (round trips, error bounds per token and head), the
engine's own consistency (batched, chunked, prefix-cached and forked requests give the tokens
each request gets alone with the same pool format), and the fp32 pool's logits on Gemma 3 270M
(KL and top-1 agreement bounds)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.loading import load_model
from kvserve.model.attention import KVCache
from kvserve.tools.eval.stream import load_token_stream
from tests.conftest import WIKITEXT
from tests.tiny_models import make_model


def _cache(kv_dtype: str, slots: int = 8, kvh: int = 2, d: int = 16) -> KVCache:
    return KVCache(2, slots, kvh, d, torch.float32, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 1 / 254), ("fp8", 1 / 16)])
def test_round_trip_error_is_within_the_grid_step(kv_dtype, bound):
    """Per (token, head) absmax scaling: |x_hat - x| <= absmax * bound (half an int8 step; an
    e4m3 value is within 1/16 of itself), for keys and values of every layer."""
    torch.manual_seed(0)
    cache = _cache(kv_dtype)
    k, v = torch.randn(5, 2, 16) * torch.tensor([1.0, 30.0])[None, :, None], torch.randn(5, 2, 16)
    slots = torch.tensor([7, 0, 3, 4, 1])
    cache.write(1, slots, k, v)
    kr, vr = cache.read(1, slots)
    for x, xr in ((k, kr), (v, vr)):
        absmax = x.abs().amax(-1, keepdim=True)
        assert ((xr - x).abs() <= absmax * bound + 1e-6).all()
        assert xr.dtype == torch.float32 and xr.shape == x.shape


def test_values_on_the_int8_grid_come_back_exactly_and_copy_keeps_scales():
    cache = _cache("int8")
    codes = torch.randint(-127, 128, (3, 2, 16)).float()
    codes[:, :, 0] = 127  # the absmax of every (token, head): the scale is exactly 0.5
    k = codes * 0.5
    cache.write(0, torch.tensor([2, 5, 6]), k, -k)
    cache.copy_slots(torch.tensor([5]), torch.tensor([1]))
    kr, vr = cache.read(0, torch.tensor([[2, 5], [6, 1]]))  # any index shape
    assert torch.equal(kr, torch.stack([k[:2], torch.stack([k[2], k[1]])]))
    assert torch.equal(vr, -kr)


def test_pool_bytes_and_capacity(tmp_path):
    """int8 stores D bytes + a 4-byte scale per token and head instead of 4D: the same budget
    holds (4D) / (D + 4) times the tokens (3.2x at the tiny model's head_dim 16, 3.9x at 256)."""
    assert KVCache.bytes_per_token_head(256, torch.float32, "int8") * 3.9 < KVCache.bytes_per_token_head(256, torch.float32)
    for kv_dtype in ("auto", "int8", "fp8"):
        c = KVCache(3, 32, 2, 16, torch.float32, kv_dtype=kv_dtype)
        assert c.nbytes == 3 * 32 * 2 * KVCache.bytes_per_token_head(16, torch.float32, kv_dtype)
    make_model("llama", tmp_path)
    loaded = load_model(tmp_path)
    blocks = {d: LLM(loaded=loaded, kv_cache_gib=0.01, kv_cache_dtype=d).engine.num_blocks for d in ("auto", "int8")}
    assert blocks["int8"] / blocks["auto"] == pytest.approx(64 / 20, rel=0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_kvq")
    make_model("llama", folder)
    return load_model(folder)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_batched_chunked_cached_forked_equal_alone(tiny, kv_dtype):
    """The quantized pool behaves like any pool: prefix hits, chunked prefill, n = 2 forks
    (copy-on-write copies codes and scales) and batching give each request's tokens alone."""
    shared = [2] + [(7 * j) % 300 + 3 for j in range(40)]
    prompts = [shared + [5, 6], shared + [9], [2, 4, 8, 16, 32], shared[:30]]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 3 + \
             [SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)]
    alone = [LLM(loaded=tiny, kv_cache_gib=0.01, kv_cache_dtype=kv_dtype).generate([p], sp)[0]
             for p, sp in zip(prompts, params)]
    llm = LLM(loaded=tiny, kv_cache_gib=0.01, kv_cache_dtype=kv_dtype, max_num_batched_tokens=16, block_size=4)
    batched = llm.generate(prompts, params)
    for a, b in zip(alone, batched):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _window_logits(loaded, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """Logits [N, vocab] of a 64-token prompt then 3 chunks of 64 read from the pool format."""
    cfg, bs = loaded.config, 16
    blocks = -(-len(ids) // bs)
    kv = KVCache(cfg.num_layers, blocks * bs, cfg.num_kv_heads, cfg.head_dim, torch.float32, kv_dtype=kv_dtype)
    runner = ModelRunner(loaded.model, kv, bs)
    return torch.cat([runner.execute([StepInput(ids[p:p + 64], p, list(range(blocks)), num_logits=64)]).float()
                      for p in range(0, len(ids), 64)])


def test_gemma_int8_and_fp8_kv_stay_close_to_fp32(gemma):
    """Gemma 3 270M over the first 256 tokens of WikiText-2 test: mean KL(fp32 KV || quantized KV) below 0.02
    and top-1 agreement >= 90% (measured: ~0.005 and ~96%, see docs/BENCHMARKS.md)."""
    ids = load_token_stream(gemma.tokenizer, WIKITEXT / "wiki.test.raw", 256, gemma.config.bos_token_id).tolist()
    ref = _window_logits(gemma, ids, "auto").log_softmax(-1)
    for kv_dtype in ("int8", "fp8"):
        got = _window_logits(gemma, ids, kv_dtype).log_softmax(-1)
        kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
        agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        assert 0 < kl < 0.02 and agree >= 0.9, (kv_dtype, kl, agree)


def test_bad_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        _cache("fp4")
