"""Structured pruning (kvserve/compress/prune/structured.py, importance.py): nothing removed is the same
model bit for bit; each kind gives a smaller config whose folder we and HF transformers load with
the same logits; the importance scores find units made inert by hand."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.compress.prune.importance import (
    channel_importance,
    compute_importance,
    head_importance,
    layer_importance,
    neuron_importance,
)
from kvserve.compress.prune.structured import count_params, kept_width, structured_prune
from kvserve.loading import load_model
from kvserve.loading.save import save_model
from tests.logits import all_position_logits

IDS = [2, 5, 17, 40, 3, 99, 250, 7, 11, 64, 128, 300, 1, 42, 8, 19, 23]
KINDS = ["llama", "gemma3"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("prune_structured")
    for kind in KINDS:
        make_model(kind, root / kind)
    return root


def calib(n: int = 4, length: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 320, (n, length), generator=g)


def expected_params(cfg, norms_per_layer: int) -> int:
    """Every parameter of a dense model of this config (no biases in the tiny models)."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.intermediate_size + norms_per_layer * d
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + head + cfg.num_layers * per_layer + d


@pytest.mark.parametrize("kind", KINDS)
def test_nothing_removed_reproduces_the_logits_exactly(sources, kind):
    loaded = load_model(sources / kind)
    want = all_position_logits(loaded, IDS)
    for windows in (None, calib()):
        pruned = structured_prune(loaded, calibration=windows, prune_heads=0, ffn_keep=1.0, hidden_keep=1.0,
                                  drop_layers=0)
        assert pruned.model is not loaded.model
        assert pruned.config == loaded.config
        assert torch.equal(all_position_logits(pruned, IDS), want)
    # flags not given on the command line arrive as None: nothing of that kind is removed
    only_ffn = structured_prune(loaded, calibration=calib(), prune_heads=None, ffn_keep=0.5, hidden_keep=None,
                                drop_layers=None)
    assert only_ffn.config == dataclasses.replace(loaded.config, intermediate_size=64)


CASES = {
    "heads": dict(prune_heads=2),  # 4 query heads over 2 KV heads -> 1 per group
    "ffn": dict(ffn_keep=0.5),  # 128 -> 64 neurons
    "hidden": dict(hidden_keep=0.75),  # 64 -> 48 channels
    "layers": dict(drop_layers=2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_gives_a_smaller_model_that_saves_and_loads_here_and_in_hf(sources, tmp_path, kind, case):
    import transformers as tf

    loaded = load_model(sources / kind)
    before = all_position_logits(loaded, IDS)
    pruned = structured_prune(loaded, calibration=calib(), **CASES[case])
    cfg, old = pruned.config, loaded.config
    shape = {"heads": ("num_heads", 2), "ffn": ("intermediate_size", 64), "hidden": ("hidden_size", 48),
             "layers": ("num_layers", old.num_layers - 2)}[case]
    assert getattr(cfg, shape[0]) == shape[1]
    for field in ("num_heads", "intermediate_size", "hidden_size", "num_layers"):
        if field != shape[0]:
            assert getattr(cfg, field) == getattr(old, field)
    assert len(cfg.layer_types) == cfg.num_layers
    norms = 4 if kind == "gemma3" else 2
    assert count_params(pruned.model) == expected_params(cfg, norms) < expected_params(old, norms)
    assert count_params(loaded.model) == expected_params(old, norms)
    # the original is untouched
    assert torch.equal(all_position_logits(loaded, IDS), before)

    want = all_position_logits(pruned, IDS)
    assert not torch.allclose(want, before)
    out = save_model(pruned, tmp_path / "out")
    back = load_model(out)
    assert back.config == cfg
    assert torch.equal(all_position_logits(back, IDS), want)
    hf = tf.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(want, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_an_identity_block_ranks_least_important_and_dropping_it_keeps_the_logits(sources, kind):
    loaded = load_model(sources / kind)
    block = loaded.model.layers[1]
    block.self_attn.o_proj.weight.zero_()  # the block now adds exactly 0 to the residual stream
    block.mlp.down_proj.weight.zero_()
    want = all_position_logits(loaded, IDS)
    scores = layer_importance(loaded.model, calib())
    assert int(scores.argmin()) == 1 and float(scores[1]) < 1e-6 < float(scores.sort().values[1])
    pruned = structured_prune(loaded, calibration=calib(), drop_layers=1)
    assert pruned.config.num_layers == loaded.config.num_layers - 1
    assert pruned.config.layer_types == [t for i, t in enumerate(loaded.config.layer_types) if i != 1]
    assert torch.equal(all_position_logits(pruned, IDS), want)


@pytest.mark.parametrize("kind", KINDS)
def test_inert_neurons_heads_and_channels_rank_least_important(sources, kind):
    """"contribution" criterion: a neuron / head whose output weights are zero writes nothing and
    scores 0; a channel every residual norm outputs as 0 scores lowest."""
    loaded = load_model(sources / kind)
    m, cfg = loaded.model, loaded.config
    neuron, head, channel = 37, 2, 11
    m.layers[0].mlp.down_proj.weight[:, neuron] = 0  # the neuron writes nothing
    d = cfg.head_dim
    m.layers[2].self_attn.o_proj.weight[:, head * d:(head + 1) * d] = 0  # the head writes nothing
    for name, mod in m.named_modules():  # every residual norm outputs 0 in this channel
        if name.endswith("layernorm") or name == "norm":
            mod.weight[channel] = -1.0 if mod.offset else 0.0
    imp = compute_importance(m, calib()).select("contribution")
    assert int(imp.neurons[0].argmin()) == neuron and float(imp.neurons[0, neuron]) == 0
    assert int(imp.heads[2].argmin()) == head and float(imp.heads[2, head]) == 0
    assert int(imp.channels.argmin()) == channel
    # the single-kind helpers give the same numbers (one pass each)
    assert torch.equal(neuron_importance(m, calib(), criterion="contribution"), imp.neurons)
    assert torch.equal(head_importance(m, calib(), criterion="contribution"), imp.heads)
    assert torch.equal(channel_importance(m, calib()), imp.channels)
    # and pruning removes them
    from kvserve.compress.prune.structured import plan_pruning

    plan = plan_pruning(cfg, imp, prune_heads=2, ffn_keep=0.5, hidden_keep=0.75)
    assert neuron not in plan.neurons[0].tolist() and head not in plan.heads[2].tolist()
    assert channel not in plan.channels.tolist()
    # GQA: each of the 2 KV groups keeps one of its own 2 query heads
    for h in plan.heads:
        assert [int(x) // 2 for x in h] == [0, 1]
    pruned = structured_prune(loaded, calibration=calib(), criterion="contribution", ffn_keep=0.5)
    assert pruned.config.intermediate_size == 64


def test_gemma_hidden_pruning_keeps_the_embedding_scale_and_the_tied_head(sources):
    """The model multiplies by sqrt(d') after pruning: the embedding rows carry sqrt(d / d') so the
    residual stream starts as before, and the final norm divides it back out of the tied head."""
    loaded = load_model(sources / "gemma3")
    imp = compute_importance(loaded.model, calib())
    pruned = structured_prune(loaded, calibration=None, importance=imp, hidden_keep=0.75)
    from kvserve.compress.prune.structured import plan_pruning

    ch = plan_pruning(loaded.config, imp, hidden_keep=0.75).channels
    ids = torch.tensor(IDS)
    torch.testing.assert_close(pruned.model.embed(ids), loaded.model.embed(ids)[:, ch], rtol=1e-6, atol=1e-6)
    old_head = (1 + loaded.model.norm.weight[ch])[None, :] * loaded.model.embed_tokens.weight[:, ch]
    new_head = (1 + pruned.model.norm.weight)[None, :] * pruned.model.embed_tokens.weight
    torch.testing.assert_close(new_head, old_head, rtol=1e-6, atol=1e-6)


def test_kept_width_rounds_to_kernel_friendly_multiples():
    assert kept_width(2048, 0.6) == 1216 and kept_width(2048, 1.0) == 2048
    assert kept_width(640, 0.7) == 448 and kept_width(128, 0.5) == 64 and kept_width(64, 0.01) == 16
    assert kept_width(10, 0.5) == 5


@pytest.mark.parametrize("kwargs, flag", [
    (dict(ffn_keep=0.0), "--ffn-keep"), (dict(ffn_keep=1.5), "--ffn-keep"), (dict(ffn_keep=float("nan")), "--ffn-keep"),
    (dict(hidden_keep=-0.1), "--hidden-keep"), (dict(prune_heads=4), "--prune-heads"),
    (dict(prune_heads=1), "--prune-heads"), (dict(prune_heads=-1), "--prune-heads"),
    (dict(drop_layers=3), "--drop-layers"), (dict(drop_layers=-2), "--drop-layers"),
])
def test_bad_arguments_name_the_flag(sources, kwargs, flag):
    loaded = load_model(sources / "llama")  # 4 query heads, 2 KV heads, 3 layers
    with pytest.raises(ValueError, match=flag):
        structured_prune(loaded, calibration=calib(), **kwargs)


def test_removing_something_needs_calibration(sources):
    loaded = load_model(sources / "llama")
    with pytest.raises(ValueError, match="calibration"):
        structured_prune(loaded, calibration=None, ffn_keep=0.5)
    with pytest.raises(ValueError, match="calibration"):
        structured_prune(loaded, calibration=torch.tensor([1, 2, 3]), ffn_keep=0.5)
    with pytest.raises(ValueError, match="calibration"):
        structured_prune(loaded, calibration=torch.full((2, 8), 10_000), ffn_keep=0.5)


def test_importance_of_another_shape_is_refused_and_hand_made_scores_drive_the_plan(sources, tmp_path):
    from kvserve.compress.prune.importance import Importance
    from kvserve.model.config import FULL

    gemma, llama = load_model(sources / "gemma3"), load_model(sources / "llama")
    imp = compute_importance(gemma.model, calib())
    with pytest.raises(ValueError, match="importance"):
        structured_prune(llama, calibration=None, importance=imp, ffn_keep=0.5)
    # Keep only the full-attention layers: no sliding window is left, in the config or the folder.
    full = torch.tensor([float(t == FULL) for t in gemma.config.layer_types], dtype=torch.float64)
    scores = Importance(heads=imp.heads, neurons=imp.neurons, channels=imp.channels, layers=full,
                        num_windows=1, num_tokens=1)
    pruned = structured_prune(gemma, calibration=None, importance=scores, drop_layers=4)
    assert pruned.config.layer_types == [FULL, FULL] and pruned.config.sliding_window is None
    back = load_model(save_model(pruned, tmp_path / "full_only"))
    assert torch.equal(all_position_logits(back, IDS), all_position_logits(pruned, IDS))


def test_all_kinds_at_once_give_a_folder_llm_serves_with_the_models_greedy_tokens(sources, tmp_path):
    """The folder is an ordinary model: LLM(DIR) decodes, and its greedy tokens are the argmax
    chain of the pruned model's own full-prompt logits."""
    from kvserve import LLM, SamplingParams

    loaded = load_model(sources / "gemma3")
    pruned = structured_prune(loaded, calibration=calib(), prune_heads=2, ffn_keep=0.5, hidden_keep=0.75,
                              drop_layers=1)
    cfg = pruned.config
    assert (cfg.num_heads, cfg.intermediate_size, cfg.hidden_size, cfg.num_layers) == (2, 64, 48, 5)
    out = save_model(pruned, tmp_path / "all")
    prompt = [2, 17, 40, 99, 250, 7, 11]
    got = LLM(str(out), kv_cache_gib=0.01).generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True))[0].token_ids
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(all_position_logits(pruned, ids)[-1].argmax()))
    assert got == ids[len(prompt):]


@pytest.mark.parametrize("kind", KINDS)
def test_activation_criterion_is_the_default_and_sees_silent_activations_not_dead_output_weights(sources, kind):
    """Minitron's literal criterion (the default) ranks by the activation alone: a neuron whose
    activation is zero scores 0, one whose output weights are zero does not; "contribution" sees
    both."""
    loaded = load_model(sources / kind)
    m, d = loaded.model, loaded.config.head_dim
    mlp, attn = m.layers[0].mlp, m.layers[1].self_attn
    mlp.up_proj.weight[5] = 0  # neuron 5: act(gate) * 0 = 0
    mlp.down_proj.weight[:, 9] = 0  # neuron 9: active, writes nothing
    attn.o_proj.weight[:, 3 * d:4 * d] = 0  # head 3: active, writes nothing
    imp = compute_importance(m, calib())
    act, con = imp.select("activation"), imp.select("contribution")
    assert act is imp and torch.equal(neuron_importance(m, calib()), imp.neurons)
    assert int(act.neurons[0].argmin()) == 5 and float(act.neurons[0, 5]) == 0 and float(act.neurons[0, 9]) > 0
    assert float(con.neurons[0, 5]) == 0 and float(con.neurons[0, 9]) == 0
    assert float(act.heads[1, 3]) > 0 and float(con.heads[1, 3]) == 0
    with pytest.raises(ValueError, match="--importance"):
        structured_prune(loaded, calibration=None, importance=imp, criterion="magnitude", ffn_keep=0.5)
