"""MLA (DeepSeek-V2/V3 Multi-head Latent Attention) on tiny random HF checkpoints: logits and
greedy tokens equal HF transformers'; the absorbed (decode) and materialized (prefill) forms
agree; the engine's batching / chunking / prefix caching / preemption keep HF's greedy tokens;
the pool holds d_c + d_rope values per token and layer."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.loading import load_model
from kvserve.loading.errors import ModelLoadError
from kvserve.model.attention import CAUSAL, KVCache
from kvserve.model.config import FULL, ModelConfig, RopeConfig
from kvserve.model.mla import MLAttention
from kvserve.tools.analysis import roofline as rl
from kvserve.tools.analysis.presets import shape_from_hf_config
from tests.tiny_models import VOCAB, hf_greedy, make_model, random_prompts

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
D_C, D_ROPE, D_NOPE, D_V, HEADS, LAYERS = 32, 16, 32, 32, 4, 3  # tests/tiny_models.py deepseek config


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny matrices: one intra-op thread is faster, and immune to a busy machine's spin waits."""


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return folder, make_model("deepseek_v3", folder)


def _prompts(lengths, seed=11) -> list[list[int]]:
    return random_prompts(lengths, seed)


def _hf_greedy(hf, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    return hf_greedy(hf, prompt, n)


def _pool(cfg, num_slots: int) -> KVCache:
    heads, k_dim, v_dim = cfg.kv_cache_layout
    return KVCache(cfg.num_layers, num_slots, heads, k_dim, torch.float32, v_head_dim=v_dim)


def _prefill_logits(loaded, ids: list[int], block_size: int = 16) -> torch.Tensor:
    blocks = -(-len(ids) // block_size)
    kv = _pool(loaded.config, blocks * block_size)
    runner = ModelRunner(loaded.model, kv, block_size=block_size)
    input_ids, positions, meta, _ = runner.prepare([StepInput(ids, 0, list(range(blocks)))])
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(input_ids, positions, kv, meta))


# ---------------------------------------------------------------- HF exactness
@pytest.mark.parametrize("kind,overrides", [("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": 24}),
                                            ("deepseek_v3", {"rope_interleave": False}), ("deepseek_v2", {})])
def test_prompt_logits_match_hf(tmp_path, kind, overrides):
    hf = make_model(kind, tmp_path, **overrides)
    loaded = load_model(tmp_path)
    assert loaded.config.family == "deepseek" and loaded.config.mla
    assert loaded.config.q_lora_rank == overrides.get("q_lora_rank")
    ids = _prompts([40], seed=7)[0]
    ours = _prefill_logits(loaded, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


def test_rope_layout_matters(v3):
    """The interleaved RoPE of DeepSeek is really exercised: the half layout gives other logits."""
    folder, hf = v3
    loaded = load_model(folder)
    ids = _prompts([40], seed=7)[0]
    good = _prefill_logits(loaded, ids)
    for layer in loaded.model.layers:
        layer.self_attn.interleave = False
    assert (_prefill_logits(loaded, ids) - good).abs().max().item() > 1e-3


def test_greedy_matches_hf_generate(v3):
    folder, hf = v3
    prompts = _prompts([5, 17, 30])
    outs = LLM(str(folder), kv_cache_gib=0.01).generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, p)


# ---------------------------------------------------------------- absorbed vs materialized
def _random_attention(seed: int = 0, q_lora: int | None = None) -> MLAttention:
    cfg = ModelConfig(family="deepseek", model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64,
                      intermediate_size=128, num_layers=1, num_heads=HEADS, num_kv_heads=1, head_dim=D_ROPE,
                      rms_norm_eps=1e-6, max_position_embeddings=512, layer_types=[FULL],
                      rope={FULL: RopeConfig(10000.0)}, attn_scale=(D_NOPE + D_ROPE) ** -0.5,
                      kv_lora_rank=D_C, q_lora_rank=q_lora, qk_nope_head_dim=D_NOPE, qk_rope_head_dim=D_ROPE,
                      v_head_dim=D_V, rope_interleave=True)
    torch.manual_seed(seed)
    attn = MLAttention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
    return attn


@pytest.mark.parametrize("mask_kind", ["causal", "chunk", "none"])
def test_absorbed_equals_materialized(mask_kind):
    attn = _random_attention()
    g = torch.Generator().manual_seed(3)
    T, L = (24, 24) if mask_kind == "causal" else ((8, 30) if mask_kind == "chunk" else (1, 30))
    q_nope = torch.randn(T, HEADS, D_NOPE, generator=g)
    q_pe = torch.randn(T, HEADS, D_ROPE, generator=g)
    cached = torch.randn(L, D_C + D_ROPE, generator=g)
    if mask_kind == "causal":
        mask = CAUSAL
    elif mask_kind == "chunk":  # the last 8 positions of a 30-token context
        mask = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
    else:
        mask = None
    mat = attn.attend_materialized(q_nope, q_pe, cached, mask)
    absorbed = attn.attend_absorbed(q_nope, q_pe, cached, mask if mask is CAUSAL or mask is None
                                    else mask.repeat_interleave(HEADS, dim=0))
    assert mat.shape == absorbed.shape == (T, HEADS, D_V)
    torch.testing.assert_close(absorbed, mat, rtol=1e-5, atol=1e-5)
    assert mat.abs().max() > 0.1  # not a degenerate comparison


def test_absorbed_weights_are_kv_b_proj_blocks():
    attn = _random_attention()
    w_uk, w_uv = attn.up_weights()
    c = torch.randn(5, D_C)
    kv = attn.kv_b_proj(c).view(5, HEADS, D_NOPE + D_V)
    torch.testing.assert_close(torch.einsum("hnc,lc->lhn", w_uk, c), kv[..., :D_NOPE])
    torch.testing.assert_close(torch.einsum("hvc,lc->lhv", w_uv, c), kv[..., D_NOPE:])


def test_decode_step_same_logits_both_forms(v3):
    """Batched decode of three ragged sequences: absorbed vs materialized give the same logits."""
    folder, _ = v3
    loaded = load_model(folder)
    bs = 16
    prompts = _prompts([7, 20, 33], seed=5)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    kv = _pool(loaded.config, 9 * bs)
    runner = ModelRunner(loaded.model, kv, block_size=bs)
    runner.execute([StepInput(p, 0, t) for p, t in zip(prompts, tables)])
    step = [StepInput([p[-1]], len(p), t) for p, t in zip(prompts, tables)]
    absorbed = runner.execute(step)
    for layer in loaded.model.layers:
        layer.self_attn.absorb = False
    materialized = runner.execute(step)  # rewrites the same latents at the same slots
    torch.testing.assert_close(absorbed.float(), materialized.float(), rtol=1e-5, atol=1e-5)
    # and both equal a prefill that computes the last token in the materialized form
    full = _prefill_logits(loaded, prompts[2] + [prompts[2][-1]])[-1]
    torch.testing.assert_close(absorbed[2].float(), full, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the engine
def test_engine_ragged_batch_chunked_and_preempted(v3):
    folder, hf = v3
    prompts = _prompts([3, 9, 21, 40, 47, 13])
    ref = [_hf_greedy(hf, p) for p in prompts]
    batched = LLM(str(folder), kv_cache_gib=0.01, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == ref
    chunked = LLM(str(folder), kv_cache_gib=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == ref
    # 10 pages of 16 tokens: six sequences of up to 63 tokens (4 pages each) must preempt.
    page = 16 * LAYERS * (D_C + D_ROPE) * 4
    tiny = LLM(str(folder), kv_cache_gib=10 * page / 2**30, enable_prefix_caching=False)
    assert tiny.engine.num_blocks == 10
    assert [o.token_ids for o in tiny.generate(prompts, GREEDY)] == ref
    assert tiny.engine.stats()["num_preemptions"] > 0


def test_engine_prefix_cache_hit(v3):
    folder, hf = v3
    prefix = _prompts([32], seed=21)[0]
    a, b = prefix + _prompts([5], seed=22)[0], prefix + _prompts([9], seed=23)[0]
    llm = LLM(str(folder), kv_cache_gib=0.01)
    first = llm.generate([a], GREEDY)[0].token_ids
    computed = llm.engine.stats()["prompt_tokens_computed"]
    second = llm.generate([b], GREEDY)[0].token_ids
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["prompt_tokens_computed"] - computed == len(b) - 32  # two 16-token blocks reused
    assert first == _hf_greedy(hf, a) and second == _hf_greedy(hf, b)


# ---------------------------------------------------------------- KV bytes
def test_kv_bytes_per_token_is_latent_plus_rope(v3):
    folder, _ = v3
    llm = LLM(str(folder), kv_cache_gib=0.01)
    eng = llm.engine
    pool = eng.kv_cache
    per_token = pool.nbytes / pool.num_slots
    assert per_token == LAYERS * (D_C + D_ROPE) * 4 == 576
    assert eng.model_config.kv_bytes_per_token(4) == per_token
    assert eng.page_bytes == eng.config.block_size * per_token
    assert 0.01 * 2**30 - eng.page_bytes < pool.nbytes <= 0.01 * 2**30  # the budget buys latents, not K/V
    # the roofline's arithmetic for the same config.json agrees with the measured pool
    shape = shape_from_hf_config(json.loads((folder / "config.json").read_text()), "tiny")
    assert rl.kv_bytes_per_token(replace(shape, kv_bytes=4.0)) == per_token
    mha = LAYERS * HEADS * ((D_NOPE + D_ROPE) + D_V) * 4  # per-head K (nope + rope) and V, fp32
    assert mha / per_token == pytest.approx(3840 / 576)  # 6.7x fewer bytes per token


# ---------------------------------------------------------------- refusals
def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    c = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    path.write_text(json.dumps(c))


@pytest.mark.parametrize("changes,words", [
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"qk_rope_head_dim": "16"}, "qk_rope_head_dim"),
    ({"v_head_dim": 0}, "v_head_dim"),
    # MoE layers asked of a dense checkpoint (MoE itself: tests/test_moe.py)
    ({"first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2},
     "missing tensors"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "rope scaling"),
])
def test_bad_config_names_the_field(tmp_path, changes, words):
    make_model("deepseek_v3", tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=words):
        load_model(tmp_path)


@pytest.mark.parametrize("kwargs,words", [({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
                                          ({"streaming_window": 64}, "streaming_window")])
def test_unsupported_engine_options_refused(v3, kwargs, words):
    folder, _ = v3
    with pytest.raises(ValueError, match=words):
        LLM(str(folder), kv_cache_gib=0.01, **kwargs)


def test_speculative_and_uncached_paths_same_tokens(v3):
    """Verification steps (several query tokens per sequence, materialized) and the no-cache
    baseline give the plain engine's greedy tokens; bf16 halves the pool's bytes per token."""
    folder, _ = v3
    prompts = _prompts([5, 17, 30], seed=1)
    base = [o.token_ids for o in LLM(str(folder), kv_cache_gib=0.01).generate(prompts, GREEDY)]
    for kwargs in ({"speculative": "ngram"}, {"speculative": "self", "self_draft_layers": 2},
                   {"use_kv_cache": False}):
        llm = LLM(str(folder), kv_cache_gib=0.01, **kwargs)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base, kwargs
    bf16 = LLM(str(folder), kv_cache_gib=0.01, dtype="bfloat16").engine.kv_cache
    assert bf16.nbytes / bf16.num_slots == LAYERS * (D_C + D_ROPE) * 2
