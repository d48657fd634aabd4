"""GQA / MQA conversion by mean-pooling K/V heads (kvserve/compress/convert/gqa.py, `kvserve convert`)."""
from __future__ import annotations

import pytest
import torch

from kvserve.compress.convert import pool_kv_heads
from kvserve.loading import load_model
from kvserve.loading.save import save_model
from tests.logits import all_position_logits

IDS = [2, 5, 17, 40, 3, 99, 250, 7, 11, 64, 128, 300, 1, 42, 8, 19, 23]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("gqa")
    make_model("llama", root / "llama", num_key_value_heads=4)  # MHA: 4 query heads, 4 K/V heads
    return root / "llama"


def test_keeping_every_head_changes_nothing(source):
    loaded = load_model(source)
    same = pool_kv_heads(loaded, 4)
    assert torch.equal(all_position_logits(same, IDS), all_position_logits(loaded, IDS))


def test_pooling_heads_that_are_already_equal_is_exact(source):
    """Make each pair of K/V heads identical: MQA-from-pairs (4 -> 2) and then all-equal (-> 1)
    must not change the logits, and the pooled rows are the group means."""
    loaded = load_model(source)
    d = loaded.config.head_dim
    with torch.no_grad():
        for layer in loaded.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(4, d, -1)
                w[1], w[3] = w[0].clone(), w[2].clone()
    want = all_position_logits(loaded, IDS)
    two = pool_kv_heads(loaded, 2)
    assert two.config.num_kv_heads == 2
    assert torch.equal(all_position_logits(two, IDS), want)
    one = pool_kv_heads(load_model(source), 1)
    w = load_model(source).model.layers[0].self_attn.k_proj.weight.view(4, d, -1)
    torch.testing.assert_close(one.model.layers[0].self_attn.k_proj.weight, w.mean(0), rtol=0, atol=1e-7)


def test_converted_folder_matches_hf_and_shrinks_the_pool(source, tmp_path):
    import transformers as tf

    from kvserve import LLM

    loaded = load_model(source)
    out = save_model(pool_kv_heads(loaded, 1), tmp_path / "mqa")
    ours = load_model(out)
    hf = tf.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads == 1
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(all_position_logits(ours, IDS), ref, atol=2e-4, rtol=2e-4)
    # KV bytes per token, measured in the engine's pool: 4 K/V heads -> 1.
    per_slot = {}
    for name, path in (("mha", source), ("mqa", out)):
        kv = LLM(model=str(path), kv_cache_gib=0.01).engine.kv_cache
        per_slot[name] = kv.nbytes / kv.num_slots
    assert per_slot["mha"] == 4 * per_slot["mqa"]


def test_bad_head_counts_and_models_are_refused(source, capsys):
    from kvserve.cli import main
    from kvserve.compress.quant import quantize_model

    loaded = load_model(source)
    for k in (0, 3, 8):
        with pytest.raises(ValueError, match="--kv-heads"):
            pool_kv_heads(loaded, k)
    quantize_model(loaded.model, "rtn", bits=8, granularity="channel", progress=False)
    with pytest.raises(ValueError, match="quantized"):
        pool_kv_heads(loaded, 2)
    assert main(["convert", str(source), "--kv-heads", "3", "--out", "/tmp/never-written"]) == 2
    assert "--kv-heads 3 must divide" in capsys.readouterr().err


def test_cli_writes_a_servable_folder(source, tmp_path):
    from kvserve import LLM, SamplingParams
    from kvserve.cli import main

    assert main(["convert", str(source), "--kv-heads", "2", "--out", str(tmp_path / "gqa")]) == 0
    out = LLM(model=str(tmp_path / "gqa")).generate([IDS], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5
