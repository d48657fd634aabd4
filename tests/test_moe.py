"""Mixture-of-experts models (Mixtral, Qwen2-MoE, DeepSeek-V2/V3 MoE) on tiny random HF
checkpoints: logits and greedy tokens equal HF transformers' (through the batching engine:
ragged batches, chunked prefill, preemption, n=2); the routing variants really change the
choice; the dispatch runs each expert only on the rows routed to it; unsupported routing fields
are refused naming the field. Mixtral as llama.cpp writes it to GGUF (stacked expert tensors):
dequantized, and as the file's own blocks (Q8_0 experts on the GGML kernels)."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.builder import cuda_graphs_fit
from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.engine.parallel.shard import check_shardable
from kvserve.loading import load_model
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.hf import read_hf_config
from kvserve.model.attention import KVCache
from kvserve.model.config import FULL, ModelConfig, MoEConfig, RopeConfig
from kvserve.model.layers import GatedMLP
from kvserve.model.moe import SparseMoeBlock
from kvserve.tools.analysis import roofline as rl
from kvserve.tools.analysis.presets import shape_from_hf_config, shape_from_model_config
from kvserve.weights.ggml import GGMLLinear
from kvserve.weights.half import HalfLinear
from tests.test_gguf_llama import write_llama_gguf
from tests.tiny_models import MOE_KINDS, VOCAB, hf_greedy, make_model, random_prompts

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LOGIT_TOL = 1e-4  # fp32: max abs logit difference to HF (measured ~3e-6)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny matrices: one intra-op thread is faster, and immune to a busy machine's spin waits."""


@pytest.fixture(scope="module", params=MOE_KINDS)
def tiny(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    return kind, folder, make_model(kind, folder)


def _prompts(lengths, seed=11) -> list[list[int]]:
    return random_prompts(lengths, seed)


def _hf_greedy(hf, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    return hf_greedy(hf, prompt, n)


def _runner(loaded, num_blocks: int, block_size: int = 16) -> tuple[ModelRunner, KVCache]:
    cfg = loaded.config
    heads, k_dim, v_dim = cfg.kv_cache_layout
    kv = KVCache(cfg.num_layers, num_blocks * block_size, heads, k_dim, torch.float32, v_head_dim=v_dim)
    return ModelRunner(loaded.model, kv, block_size=block_size), kv


def _prefill_logits(loaded, ids: list[int], block_size: int = 16) -> torch.Tensor:
    blocks = -(-len(ids) // block_size)
    runner, kv = _runner(loaded, blocks, block_size)
    input_ids, positions, meta, _ = runner.prepare([StepInput(ids, 0, list(range(blocks)))])
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(input_ids, positions, kv, meta))


def _moe_blocks(model) -> dict[int, SparseMoeBlock]:
    return {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)}


# ---------------------------------------------------------------- HF exactness
EXPECTED_LAYERS = {"mixtral": (0, 1, 2), "qwen2_moe": (0, 2), "qwen3_moe": (0, 2), "deepseek_v2_moe": (1, 2),
                   "deepseek_v3_moe": (1, 2)}


def test_prompt_logits_match_hf(tiny):
    kind, folder, hf = tiny
    loaded = load_model(folder)
    moe = loaded.config.moe
    assert moe is not None and moe.layers == EXPECTED_LAYERS[kind]
    assert set(_moe_blocks(loaded.model)) == set(moe.layers)
    assert all(type(layer.mlp) is GatedMLP for i, layer in enumerate(loaded.model.layers) if i not in moe.layers)
    ids = _prompts([40], seed=7)[0]
    ours = _prefill_logits(loaded, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < LOGIT_TOL, f"{kind}: max abs logit diff {diff}"


def _other_routing(block: SparseMoeBlock, kind: str) -> None:
    """Switch the block's routing to a neighbouring variant (what a loader that ignored the
    field would compute)."""
    moe = block.gate.moe
    if kind == "deepseek_v3_moe":  # no selection bias
        block.gate.e_score_correction_bias.zero_()
    elif kind == "deepseek_v2_moe":  # no group limit
        block.gate.moe = replace(moe, topk_method="greedy")
    else:  # the top-k weights (not) renormalised
        block.gate.moe = replace(moe, norm_topk_prob=not moe.norm_topk_prob)


def test_routing_variant_matters(tiny):
    """The family's routing field is really exercised: its neighbouring variant gives other logits."""
    kind, folder, _ = tiny
    loaded = load_model(folder)
    ids = _prompts([40], seed=7)[0]
    good = _prefill_logits(loaded, ids)
    for block in _moe_blocks(loaded.model).values():
        _other_routing(block, kind)
    assert (_prefill_logits(loaded, ids) - good).abs().max().item() > 1e-3


def test_param_counts(tiny):
    """ModelConfig.num_params counts HF's matrices (norms and biases aside); active_params those
    one token multiplies by (top_k of the routed experts)."""
    kind, folder, hf = tiny
    cfg = read_hf_config(folder)
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() >= 2)  # (experts as 3-D tensors)
    assert cfg.num_params == matrices
    moe, d = cfg.moe, cfg.hidden_size
    idle = len(moe.layers) * (moe.num_experts - moe.top_k) * 3 * d * moe.intermediate_size
    assert cfg.active_params == cfg.num_params - idle


def test_roofline_shape_counts_the_same_experts(tiny):
    """The roofline tool's shapes (from config.json and from the loaded ModelConfig) idle the
    same expert parameters per token as the model, shared experts (Qwen2-MoE's one wide shared
    expert too) and dense layers included."""
    kind, folder, _ = tiny
    cfg = read_hf_config(folder)
    idle = cfg.num_params - cfg.active_params
    for shape in (shape_from_hf_config(json.loads((folder / "config.json").read_text()), kind),
                  shape_from_model_config(cfg, kind)):
        assert shape.moe_layers == len(cfg.moe.layers)
        assert shape.shared_experts * shape.expert_intermediate == cfg.moe.shared_intermediate_size
        assert rl.num_params(shape) - rl.num_params(shape, active=True) == idle


# ---------------------------------------------------------------- the engine
def test_engine_ragged_chunked_preempted_n2(tiny):
    kind, folder, hf = tiny
    prompts = _prompts([3, 9, 21, 40, 47, 13])
    ref = [_hf_greedy(hf, p) for p in prompts]
    batched = LLM(str(folder), kv_cache_gib=0.01, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == ref, kind
    chunked = LLM(str(folder), kv_cache_gib=0.01, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == ref, kind
    # 10 pages of 16 tokens: twelve sequences (n=2) of up to 63 tokens (4 pages each) must preempt.
    page = 16 * read_hf_config(folder).kv_bytes_per_token(4)
    small = LLM(str(folder), kv_cache_gib=10 * page / 2**30, enable_prefix_caching=False)
    assert small.engine.num_blocks == 10
    outs = small.generate(prompts, replace(GREEDY, n=2))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in ref], kind
    assert small.engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_low_bit_experts_equal_their_dequantized_reference(tiny, weights):
    """`--weights int8|int4` quantizes every expert (and shared expert) linear and leaves the router
    (and MLA's kv_b_proj) in float; greedy tokens equal the same engine over a float model holding
    the dequantized weights."""
    import dataclasses

    from kvserve.weights.linear import QuantLinear
    from tests.test_weights_option import dequantized_copy

    kind, folder, _ = tiny
    llm = LLM(str(folder), weights=weights, kv_cache_gib=0.01, enable_prefix_caching=False)
    model = llm.engine.loaded.model
    for block in _moe_blocks(model).values():
        experts = list(block.experts) + ([block.shared_experts] if block.shared_experts is not None else [])
        linears = [m for e in experts for m in e.modules() if isinstance(m, (nn.Linear, QuantLinear))]
        assert linears and all(isinstance(m, QuantLinear) for m in linears), kind
        assert not any(isinstance(m, QuantLinear) for m in block.gate.modules()), kind
    if kind.startswith("deepseek"):  # MLA's absorbed decode reads kv_b_proj's matrix: it stays float
        assert all(isinstance(layer.self_attn.kv_b_proj, nn.Linear) for layer in model.layers), kind
    ref = LLM(loaded=dataclasses.replace(llm.engine.loaded, model=dequantized_copy(model)), kv_cache_gib=0.01,
              enable_prefix_caching=False)
    prompts = _prompts([5, 17, 33])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)], kind


def test_seeded_n2_sampling_same_in_any_batch(tiny):
    """Sample i of a seeded n=2 request uses seed + i, in a batch or alone."""
    _, folder, _ = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01)
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    prompts = _prompts([6, 25, 14], seed=3)
    alone = llm.generate([prompts[1]], params)[0].token_ids
    both = llm.generate(prompts, [GREEDY, replace(params, n=2), GREEDY])[1].outputs
    assert both[0].token_ids == alone and both[1].token_ids != alone


# ---------------------------------------------------------------- the dispatch
def _count_expert_rows(model) -> tuple[dict, dict]:
    """Patch every MoE block: rows[(layer, e)] lists the row counts expert e was called with,
    routed[layer] the expert ids the router chose per call."""
    rows: dict[tuple[int, int], list[int]] = {}
    routed: dict[int, list[torch.Tensor]] = {}
    for i, block in _moe_blocks(model).items():
        for e, expert in enumerate(block.experts):
            def counted(x, _fwd=expert.forward, _key=(i, e)):
                rows.setdefault(_key, []).append(x.shape[0])
                return _fwd(x)
            expert.forward = counted

        def routing(x, _fwd=block.gate.forward, _layer=i):
            weights, ids = _fwd(x)
            routed.setdefault(_layer, []).append(ids)
            return weights, ids
        block.gate.forward = routing
    return rows, routed


def test_dispatch_runs_each_expert_on_its_rows_only(tiny):
    """A prefill of 40 tokens: each expert is called once with exactly the rows routed to it,
    an expert no row chose is never called; a batch-1 decode step calls at most top_k experts
    per MoE layer (so reads no other expert's weights)."""
    kind, folder, _ = tiny
    loaded = load_model(folder)
    moe = loaded.config.moe
    rows, routed = _count_expert_rows(loaded.model)
    ids = _prompts([40], seed=7)[0]
    runner, kv = _runner(loaded, 4)
    input_ids, positions, meta, _ = runner.prepare([StepInput(ids, 0, [0, 1, 2, 3])])
    with torch.inference_mode():  # every row through every layer (no kept rows)
        loaded.model(input_ids, positions, kv, meta)
    for layer in moe.layers:
        (chosen,) = routed[layer]
        assert chosen.shape == (40, moe.top_k)
        counts = torch.bincount(chosen.flatten(), minlength=moe.num_experts).tolist()
        called = {e: rows[(layer, e)] for e in range(moe.num_experts) if (layer, e) in rows}
        assert called == {e: [n] for e, n in enumerate(counts) if n}, kind
        assert sum(counts) == 40 * moe.top_k
    assert len({e for (_, e) in rows}) > moe.top_k  # the prompt spreads over more experts than one token uses
    rows.clear()
    routed.clear()
    runner.execute([StepInput([ids[-1]], 40, [0, 1, 2, 3])])
    for layer in moe.layers:
        used = {e for (lay, e), calls in rows.items() if lay == layer}
        assert used == set(routed[layer][0].flatten().tolist())
        assert len(used) == moe.top_k and all(rows[(layer, e)] == [1] for e in used)


def _random_block(moe: MoEConfig, seed: int = 0) -> SparseMoeBlock:
    cfg = ModelConfig(family="llama", model_type="test", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      max_position_embeddings=64, layer_types=[FULL], rope={FULL: RopeConfig(10000.0)},
                      attn_scale=0.25, moe=moe)
    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


@pytest.mark.parametrize("moe", [
    MoEConfig(num_experts=6, top_k=2, intermediate_size=16, layers=(0,), shared_intermediate_size=24,
              shared_expert_gate=True),
    MoEConfig(num_experts=8, top_k=3, intermediate_size=16, layers=(0,), scoring="sigmoid", topk_method="noaux_tc",
              n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, shared_intermediate_size=16,
              router_fp32=True),
], ids=["qwen2-like", "deepseek-v3-like"])
def test_dispatch_equals_dense_mixture(moe):
    """The grouped dispatch computes sum_j w_tj * expert_{e_tj}(x_t): the same as running every
    expert on every row and weighting by a dense [T, E] routing matrix."""
    block = _random_block(moe)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(1))
    weights, ids = block.gate(x)
    dense = torch.zeros(29, moe.num_experts).scatter_(1, ids, weights)  # [T, E]
    expected = sum(dense[:, e, None] * block.experts[e](x) for e in range(moe.num_experts))
    shared = block.shared_experts(x)
    if block.shared_expert_gate is not None:
        shared = torch.sigmoid(block.shared_expert_gate(x)) * shared
    torch.testing.assert_close(block(x), expected + shared, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block.dispatch(x, weights, ids), expected, rtol=1e-5, atol=1e-5)
    for t in (0, 7):  # one row (a batch-1 decode step's path)
        torch.testing.assert_close(block.dispatch(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]), expected[t:t + 1],
                                   rtol=1e-5, atol=1e-5)
    assert ids.unique().numel() > moe.top_k


# ---------------------------------------------------------------- config: layers and refusals
def _config_copy(src, dst, **changes):
    """config.json (+ generation_config.json) of `src` with `changes` (None: key removed) in `dst`."""
    dst.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    c = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny checkpoint of each family (for config edits)."""
    out = {}
    for kind in MOE_KINDS:
        out[kind] = tmp_path_factory.mktemp(kind)
        make_model(kind, out[kind])
    return out


@pytest.mark.parametrize("kind,changes,layers", [
    ("qwen2_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, (1,)),
    ("qwen2_moe", {"mlp_only_layers": [0, 2], "decoder_sparse_step": 1}, (1,)),
    ("deepseek_v2_moe", {"first_k_dense_replace": 0, "moe_layer_freq": 2}, (0, 2)),
    ("deepseek_v3_moe", {"first_k_dense_replace": 2}, (2,)),
])
def test_sparse_layers_from_config(folders, tmp_path, kind, changes, layers):
    cfg = read_hf_config(_config_copy(folders[kind], tmp_path / "edited", **changes))
    assert cfg.moe.layers == layers


def test_deepseek_without_moe_layers_is_dense(folders, tmp_path):
    cfg = read_hf_config(_config_copy(folders["deepseek_v2_moe"], tmp_path / "edited", first_k_dense_replace=3))
    assert cfg.moe is None


@pytest.mark.parametrize("kind,changes,words", [
    ("deepseek_v2_moe", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2_moe", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("deepseek_v2_moe", {"norm_topk_prob": True}, "norm_topk_prob=True"),
    ("deepseek_v3_moe", {"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ("deepseek_v3_moe", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3_moe", {"n_group": 3}, "n_group"),
    ("deepseek_v2_moe", {"topk_group": 5}, "topk_group"),
    ("qwen2_moe", {"num_experts_per_tok": 7}, "num_experts_per_tok"),
    ("qwen2_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("qwen2_moe", {"mlp_only_layers": "1"}, "mlp_only_layers"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
])
def test_unsupported_routing_refused_naming_the_field(folders, tmp_path, kind, changes, words):
    folder = tmp_path / "edited"
    shutil.copytree(folders[kind], folder)
    _config_copy(folders[kind], folder, **changes)
    with pytest.raises(ModelLoadError, match=words) as e:
        load_model(folder)
    assert "config.json" in str(e.value)


def test_engine_options_moe_cannot_take(folders):
    with pytest.raises(ValueError, match="compile"):
        LLM(str(folders["mixtral"]), kv_cache_gib=0.01, compile=True)


# ---------------------------------------------------------------- GGUF (llama.cpp's Mixtral layout)
@pytest.fixture(scope="module")
def mixtral_gguf(tmp_path_factory):
    """(HF Mixtral, {qtype: .gguf path}) with the GGUF cache in a private folder."""
    folder = tmp_path_factory.mktemp("mixtral_gguf")
    hf = make_model("mixtral", folder)
    paths = {}
    for qtype in ("F32", "Q8_0"):
        paths[qtype] = folder / f"tiny-mixtral-{qtype}.gguf"
        write_llama_gguf(hf, folder / "tokenizer.json", paths[qtype], qtype, "default")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_CACHE", str(tmp_path_factory.mktemp("kvcache")))
        yield hf, paths


def _experts_of(model) -> list[torch.nn.Module]:
    return [e for block in _moe_blocks(model).values() for x in block.experts
            for e in (x.gate_proj, x.up_proj, x.down_proj)]


@pytest.mark.parametrize("blocks", [False, True], ids=["dequantized", "blocks"])
def test_gguf_f32_matches_hf(mixtral_gguf, blocks):
    hf, paths = mixtral_gguf
    loaded = load_model(paths["F32"], gguf_blocks=blocks, gguf_activations="float")
    moe = loaded.config.moe
    assert (moe.num_experts, moe.top_k, moe.layers, moe.norm_topk_prob) == (4, 2, (0, 1, 2), True)
    assert all(type(e) is (GGMLLinear if blocks else torch.nn.Linear) for e in _experts_of(loaded.model))
    ids = _prompts([40], seed=7)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (_prefill_logits(loaded, ids) - ref).abs().max().item() < LOGIT_TOL


def test_gguf_q8_experts_run_as_blocks(mixtral_gguf):
    """Q8_0 experts stay the file's blocks (34 bytes per 32 weights) on the GGML kernels: with
    float activations the logits and the engine's greedy tokens are the dequantized file's; with
    int8 activations (llama.cpp's arithmetic, the engine's default) the logits stay within 5% of
    their range (a wrong expert slice would be off by the logits' own size)."""
    _, paths = mixtral_gguf
    blocks = load_model(paths["Q8_0"], gguf_blocks=True, gguf_activations="float")
    experts = _experts_of(blocks.model)
    assert experts and all(type(e) is GGMLLinear and e.ggml_type.name == "Q8_0" for e in experts)
    assert all(e.raw.numel() == e.out_features * e.in_features // 32 * 34 for e in experts)
    dequantized = load_model(paths["Q8_0"])
    ids = _prompts([40], seed=7)[0]
    diff = (_prefill_logits(blocks, ids) - _prefill_logits(dequantized, ids)).abs().max().item()
    assert diff < LOGIT_TOL, diff
    prompts = _prompts([5, 17, 30])
    ref = LLM(str(paths["Q8_0"]), kv_cache_gib=0.01).generate(prompts, GREEDY)
    out = LLM(str(paths["Q8_0"]), weights="gguf", gguf_activations="float", kv_cache_gib=0.01).generate(prompts,
                                                                                                        GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    int8 = load_model(paths["Q8_0"], gguf_blocks=True)
    assert all(e.int8_path for e in _experts_of(int8.model))
    want = _prefill_logits(dequantized, ids)
    assert (_prefill_logits(int8, ids) - want).abs().max().item() < 0.05 * want.abs().max().item()


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
@pytest.mark.parametrize("qtype,blocks", [("F32", False), ("F32", True), ("Q8_0", True)])
def test_gguf_qwen_moe(tmp_path, arch, qtype, blocks, monkeypatch):
    """Qwen2-MoE and Qwen3-MoE as llama.cpp's qwen2moe / qwen3moe architectures (q/k not permuted;
    qwen2moe: q/k/v biases and a shared expert with its sigmoid gate; qwen3moe: q/k norms and
    renormalised top-k weights): F32 loads give HF's logits; Q8_0 experts (and the shared expert)
    run as blocks with the dequantized file's logits (float activations)."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    qwen2 = arch == "qwen2moe"
    # llama.cpp's qwen MoE files: every layer sparse
    hf = make_model("qwen2_moe" if qwen2 else "qwen3_moe", tmp_path, mlp_only_layers=[])
    path = tmp_path / f"tiny-{arch}-{qtype}.gguf"
    write_llama_gguf(hf, tmp_path / "tokenizer.json", path, qtype, "default", arch=arch)
    loaded = load_model(path, gguf_blocks=blocks, gguf_activations="float")
    moe = loaded.config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_intermediate_size, moe.layers,
            moe.norm_topk_prob, moe.shared_expert_gate) == (6, 2, 32, 64 if qwen2 else 0, (0, 1, 2), not qwen2, qwen2)
    assert (loaded.config.qkv_bias, loaded.config.qk_norm) == (qwen2, not qwen2)
    ids = _prompts([40], seed=7)[0]
    ours = _prefill_logits(loaded, ids)
    if qtype == "F32":
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].float()
    else:
        shared = [b.shared_experts.down_proj for b in _moe_blocks(loaded.model).values() if qwen2]
        assert all(type(e) is GGMLLinear for e in _experts_of(loaded.model) + shared)
        want = _prefill_logits(load_model(path), ids)
    assert (ours - want).abs().max().item() < LOGIT_TOL


def test_gguf_expert_metadata_checked(mixtral_gguf, tmp_path):
    """A file whose expert tensors disagree with expert_count is refused naming the tensor."""
    import gguf

    hf, _ = mixtral_gguf
    path = tmp_path / "bad.gguf"
    write_llama_gguf(hf, _tokenizer_of(mixtral_gguf), path, "F32", "default")
    reader = gguf.GGUFReader(str(path), "r+")
    reader.fields["llama.expert_count"].parts[-1][0] = 3  # the file holds 4 experts per tensor
    reader.data.flush()
    del reader
    with pytest.raises(ModelLoadError, match="ffn_gate_exps"):
        load_model(path)


def _tokenizer_of(mixtral_gguf):
    _, paths = mixtral_gguf
    return paths["F32"].parent / "tokenizer.json"


# ---------------------------------------------------------------- other weight and engine paths
def test_bf16_checkpoint_keeps_experts_16bit(tmp_path):
    """A bf16 MoE checkpoint on the CPU ("auto"): every expert stays a 16-bit HalfLinear, the
    router is float, and the logits are the fp32 load's (the same values, other summation order)."""
    make_model("qwen2_moe", tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    auto, fp32 = load_model(tmp_path, "auto"), load_model(tmp_path, "float32")
    experts = _experts_of(auto.model)
    assert experts and all(type(e) is HalfLinear and e.weight.dtype == torch.bfloat16 for e in experts)
    assert all(b.gate.weight.dtype == torch.float32 for b in _moe_blocks(auto.model).values())
    ids = _prompts([40], seed=7)[0]
    want = _prefill_logits(fp32, ids)
    assert (_prefill_logits(auto, ids) - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_engine_paths_that_refuse_moe(folders):
    """Tensor parallelism refuses MoE models (experts are not sharded) naming them; CUDA graphs
    are not captured for them (the dispatch's shapes follow the routing)."""
    cfg = read_hf_config(folders["qwen2_moe"])
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_shardable(cfg, 2)
    check_shardable(replace(cfg, moe=None, intermediate_size=128), 2)  # the same shapes without MoE split
    engine = EngineConfig(model=str(folders["qwen2_moe"]), device="cuda")
    assert not cuda_graphs_fit(engine, cfg, None)
    assert cuda_graphs_fit(engine, replace(cfg, moe=None), None)
