"""Cross-layer KV sharing (kvserve/compress/convert/cla.py, `kvserve convert --share-kv-every`): which
layers share, logits against an independent reference forward, the engine's paged / batched /
chunked / prefix-cached greedy tokens against full recomputation, KV bytes measured in the pool,
the saved folder, refusals."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.compress.convert.cla import kv_source_every, share_kv
from kvserve.loading import load_model
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.save import save_model
from kvserve.model.config import FULL, SLIDING, kv_layer_groups
from kvserve.model.layers import apply_rope
from kvserve.tools.eval.ppl import window_hidden
from tests.logits import all_position_logits
from tests.tiny_models import make_model, random_prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models: one intra-op thread (see conftest)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: (original folder, CLA folder)} for a tiny Llama (3 full layers) and a tiny Gemma 3
    (S S F S S F, sliding window 8)."""
    root = tmp_path_factory.mktemp("cla")
    out = {}
    for kind in ("llama", "gemma3"):
        make_model(kind, root / kind)
        out[kind] = (root / kind, save_model(share_kv(load_model(root / kind), 2), root / f"{kind}-cla"))
    return out


def _prompts(lengths, seed=3) -> list[list[int]]:
    return random_prompts(lengths, seed)


def reference_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Independent of the pool and the attention module: a plain loop over a Llama-family model
    in which a layer attends over the RoPE'd K/V its kv_source layer computed, with an explicit
    causal softmax -> logits [T, vocab]."""
    m, cfg = loaded.model, loaded.config
    T = len(ids)
    pos = torch.arange(T)
    h = m.embed(torch.tensor(ids))
    cos, sin = m.rotary[FULL].cos_sin(pos, h.dtype)
    kv = {}
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rope(a.q_proj(x).view(T, cfg.num_heads, cfg.head_dim), cos, sin)
            if cfg.kv_source[i] == i:
                k = apply_rope(a.k_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
                kv[i] = (k, a.v_proj(x).view(T, cfg.num_kv_heads, cfg.head_dim))
            k, v = kv[cfg.kv_source[i]]
            rep = cfg.num_heads // cfg.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = torch.einsum("thd,shd->hts", q, k) * cfg.attn_scale
            p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            o = torch.einsum("hts,shd->thd", p, v).reshape(T, -1)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.compute_logits(m.norm(h))


def _recompute_greedy(loaded, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    """Greedy tokens by a full forward over the whole context at every step (no KV cache reuse)."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            hidden = window_hidden(loaded.model, torch.tensor([ids]))[0, -1:]
            ids.append(int(loaded.model.compute_logits(hidden).argmax(-1)))
    return ids[len(prompt):]


# ---------------------------------------------------------------- which layers share
def test_runs_pair_layers_of_the_same_type(folders, gemma):
    tiny = load_model(folders["gemma3"][0]).config
    assert tiny.layer_types == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
    assert kv_source_every(tiny, 2) == (0, 0, 2, 3, 3, 2)
    assert kv_source_every(tiny, 3) == (0, 0, 2, 0, 4, 2)  # sliding runs (0, 1, 3), (4)
    # Gemma 3 270M: 15 local layers in pairs (the 5th of a run pairs across the global layer),
    # global layers 5, 11, 17 as (5, 11), (17): 10 of 18 layers keep K/V.
    src = kv_source_every(gemma.config, 2)
    assert [i for i, s in enumerate(src) if s == i] == [0, 2, 4, 5, 7, 9, 12, 14, 16, 17]
    assert src[6] == 4 and src[11] == 5
    for i, s in enumerate(src):
        assert gemma.config.layer_types[i] == gemma.config.layer_types[s]


def test_layer_groups_cover_only_the_layers_that_store_kv(folders):
    cfg = load_model(folders["gemma3"][1]).config
    assert cfg.kv_layers == (0, 2, 3)
    groups = kv_layer_groups(cfg)
    assert sorted(i for g in groups for i in g.layers) == [0, 2, 3]
    assert {len(g.layers) for g in groups} == {1}
    assert [g.window for g in groups] == [None, 8, 8]


# ---------------------------------------------------------------- logits
def test_logits_match_the_reference_forward(folders):
    cla = load_model(folders["llama"][1])
    assert cla.config.kv_source == (0, 0, 2)
    assert cla.model.layers[1].self_attn.k_proj is None
    ids = _prompts([23])[0]
    torch.testing.assert_close(all_position_logits(cla, ids), reference_logits(cla, ids), rtol=1e-4, atol=1e-4)
    # ... and it really is a different model from the original (layer 1 lost its own K/V)
    orig = load_model(folders["llama"][0])
    assert not torch.allclose(all_position_logits(orig, ids), all_position_logits(cla, ids), atol=1e-3)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_window_forward_hook_equals_the_paged_pool(folders, kind):
    """The evaluation / calibration / training forward (AttentionMetadata.custom, the source's K/V
    handed on through meta.shared_kv) computes the same logits as the paged pool."""
    cla = load_model(folders[kind][1])
    ids = _prompts([30], seed=9)[0]
    with torch.no_grad():
        hooked = cla.model.compute_logits(window_hidden(cla.model, torch.tensor([ids]))[0])
    torch.testing.assert_close(hooked, all_position_logits(cla, ids), rtol=1e-4, atol=1e-4)


def test_mean_init_averages_the_run(folders):
    orig = load_model(folders["llama"][0])
    mean = share_kv(orig, 2, init="mean")
    for name in ("k_proj", "v_proj"):
        want = (getattr(orig.model.layers[0].self_attn, name).weight
                + getattr(orig.model.layers[1].self_attn, name).weight) / 2
        torch.testing.assert_close(getattr(mean.model.layers[0].self_attn, name).weight, want, rtol=0, atol=1e-7)
        # layer 2 is a run of one: unchanged
        assert torch.equal(getattr(mean.model.layers[2].self_attn, name).weight,
                           getattr(orig.model.layers[2].self_attn, name).weight)


# ---------------------------------------------------------------- the engine
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_engine_batched_chunked_prefix_cached_equals_recompute(folders, kind):
    cla = load_model(folders[kind][1])
    prefix = _prompts([16], seed=4)[0]
    prompts = [prefix + p for p in _prompts([3, 14, 29], seed=5)] + _prompts([9, 40], seed=6)
    want = [_recompute_greedy(cla, p) for p in prompts]
    llm = LLM(str(folders[kind][1]), kv_cache_gib=0.01, max_num_batched_tokens=16)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    # a repeated batch: prefix hits on every prompt, same tokens
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


@pytest.mark.parametrize("kind,kept", [("llama", 2 / 3), ("gemma3", 3 / 6)])
def test_kv_bytes_measured_in_the_pool(folders, kind, kept):
    per_token = {}
    for name, folder in zip(("orig", "cla"), folders[kind]):
        # one layer group (no sliding-window release), so a slot holds one token of every stored layer
        eng = LLM(str(folder), kv_cache_gib=0.01, sliding_window_release=False).engine
        per_token[name] = eng.kv_cache.nbytes / eng.kv_cache.num_slots
        assert per_token[name] == eng.model_config.kv_bytes_per_token(4)
    assert per_token["cla"] == pytest.approx(kept * per_token["orig"])


def test_int8_kv_pool_with_sharing_runs(folders):
    prompts = _prompts([11, 27], seed=8)
    cla = load_model(folders["gemma3"][1])
    want = [_recompute_greedy(cla, p, 4) for p in prompts]
    got = LLM(str(folders["gemma3"][1]), kv_cache_gib=0.01, kv_cache_dtype="int8").generate(
        prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in got] == want  # int8 K/V: the tiny model's top token survives


# ---------------------------------------------------------------- folder, CLI, refusals
def test_saved_folder_round_trips(folders, tmp_path):
    folder = folders["gemma3"][1]
    assert json.loads((folder / "config.json").read_text())["kvserve_kv_source"] == [0, 0, 2, 3, 3, 2]
    first = load_model(folder)
    again = load_model(save_model(first, tmp_path / "again"))
    ids = _prompts([13])[0]
    assert torch.equal(all_position_logits(first, ids), all_position_logits(again, ids))
    # 3 reusing layers lost k_proj, v_proj [kv, d] and k_norm [head_dim]; num_params counts no norms
    orig = load_model(folders["gemma3"][0])
    lost = 3 * 2 * 64 * orig.config.num_kv_heads * orig.config.head_dim
    assert orig.config.num_params - first.config.num_params == lost
    count = lambda m: sum(p.numel() for p in m.model.parameters())  # noqa: E731
    assert count(orig) - count(first) == lost + 3 * orig.config.head_dim


def test_cli(folders, tmp_path, capsys):
    from kvserve.cli import main

    src = folders["llama"][0]
    assert main(["convert", str(src), "--share-kv-every", "3", "--kv-share-init", "mean", "--kv-heads", "1",
                 "--out", str(tmp_path / "both")]) == 0
    assert "768 -> 128 (6.00x smaller)" in capsys.readouterr().out  # 3 layers x 2 heads -> 1 layer x 1 head
    cfg = load_model(tmp_path / "both").config
    assert cfg.kv_source == (0, 0, 0) and cfg.num_kv_heads == 1
    assert main(["convert", str(src), "--out", str(tmp_path / "none")]) == 2
    assert "--kv-heads K and/or --share-kv-every N" in capsys.readouterr().err
    assert main(["convert", str(src), "--share-kv-every", "1", "--out", str(tmp_path / "one")]) == 2
    assert "--share-kv-every must be an integer >= 2" in capsys.readouterr().err
    assert not (tmp_path / "one").exists()


def test_refusals(folders, tmp_path):
    from kvserve.compress.quant import quantize_model

    cla = load_model(folders["llama"][1])
    with pytest.raises(ValueError, match="already shares"):
        share_kv(cla, 2)
    with pytest.raises(ValueError, match="streaming_window is not supported"):
        LLM(str(folders["llama"][1]), kv_cache_gib=0.01, streaming_window=16)
    orig = load_model(folders["llama"][0])
    quantize_model(orig.model, "rtn", bits=8, granularity="channel", progress=False)
    with pytest.raises(ValueError, match="quantized"):
        share_kv(orig, 2)
    # a hand-edited config naming a layer of another type, or a later layer, names the field
    bad = tmp_path / "bad"
    save_model(load_model(folders["gemma3"][1]), bad)
    for src, words in (([0, 0, 0, 3, 3, 2], "same attention type"), ([1, 1, 2, 3, 3, 5], "earlier")):
        c = json.loads((bad / "config.json").read_text())
        c["kvserve_kv_source"] = src
        (bad / "config.json").write_text(json.dumps(c))
        with pytest.raises(ModelLoadError, match=f"kv_source.*{words}"):
            load_model(bad)



def test_calibrated_compression_refused_rtn_works(folders):
    from kvserve.compress.quant import quantize_model

    calib = torch.tensor(_prompts([16, 16], seed=2))
    for method in ("gptq", "awq"):
        with pytest.raises(ValueError, match="cross-layer KV sharing"):
            quantize_model(load_model(folders["gemma3"][1]).model, method, bits=4, group_size=32,
                           calibration=calib, progress=False)
    cla = load_model(folders["gemma3"][1])
    quantize_model(cla.model, "rtn", bits=8, granularity="channel", progress=False)
    assert len(all_position_logits(cla, _prompts([9])[0])) == 9


def test_distill_heals_a_shared_kv_student(folders, tmp_path):
    """The training forward hands the source's K/V on (meta.shared_kv) with gradients: a few
    distillation steps from the original lower the student's KL on held-out text."""
    from kvserve.cli import main

    text = tmp_path / "text.txt"
    text.write_text("Paged attention keeps keys and values in blocks of sixteen tokens. " * 60)
    orig, cla = folders["gemma3"]
    rc = main(["distill", "--teacher", str(orig), "--student", str(cla), "--out", str(tmp_path / "healed"),
               "--text-file", str(text), "--seqlen", "16", "--batch-size", "2", "--lr", "3e-3", "--steps", "12",
               "--alpha", "1", "--eval-windows", "3", "--eval-seqlen", "32", "--eval-file", str(text),
               "--no-progress", "--log-every", "0", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    info = json.loads((tmp_path / "r.json").read_text())
    assert info["after"]["kl_to_teacher"] < 0.85 * info["before"]["kl_to_teacher"]
    healed = load_model(tmp_path / "healed")
    assert healed.config.kv_source == (0, 0, 2, 3, 3, 2)
    before, after = load_model(cla).model, healed.model
    assert not torch.equal(before.layers[0].self_attn.k_proj.weight, after.layers[0].self_attn.k_proj.weight)
