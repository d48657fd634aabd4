"""Writing a dense model folder (kvserve/loading/save.py): HF transformers reads it back with the
same logits, and so do we, also after the model's shape changed."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.loading import load_model
from kvserve.loading.save import save_model
from tests.logits import all_position_logits

IDS = [2, 5, 17, 40, 3, 99, 250, 7, 11, 64, 128, 300, 1, 42, 8, 19, 23]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("save_model")
    for kind in ("llama", "gemma3"):
        make_model(kind, root / kind)
    return root


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_saved_folder_loads_in_hf_and_here_with_the_same_logits(sources, tmp_path, kind):
    import transformers as tf

    loaded = load_model(sources / kind)
    want = all_position_logits(loaded, IDS)
    out = save_model(loaded, tmp_path / "out")
    back = load_model(out)
    assert torch.equal(all_position_logits(back, IDS), want)
    hf = tf.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(want, ref, atol=2e-4, rtol=2e-4)


def test_a_changed_shape_is_written_with_its_config(sources, tmp_path):
    """Drop the last layer: the saved folder has one layer less and computes the same logits as
    the model in memory."""
    loaded = load_model(sources / "llama")
    model = loaded.model
    del model.layers[-1]
    cfg = dataclasses.replace(loaded.config, num_layers=loaded.config.num_layers - 1,
                              layer_types=loaded.config.layer_types[:-1])
    model.config = cfg
    loaded = dataclasses.replace(loaded, model=model, config=cfg)
    want = all_position_logits(loaded, IDS)
    back = load_model(save_model(loaded, tmp_path / "out"))
    assert back.config.num_layers == cfg.num_layers
    assert torch.equal(all_position_logits(back, IDS), want)


def test_bf16_storage_and_quantized_models_refused(sources, tmp_path):
    loaded = load_model(sources / "gemma3")
    out = save_model(loaded, tmp_path / "bf16", dtype=torch.bfloat16)
    back = load_model(out, dtype="bfloat16")
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    from kvserve.compress.quant import quantize_model

    quantize_model(loaded.model, "rtn", bits=8, granularity="channel", progress=False)
    with pytest.raises(ValueError, match="save_quantized"):
        save_model(loaded, tmp_path / "q")
    with pytest.raises(ValueError, match="tokenizer"):
        save_model(load_model(sources / "llama").model, tmp_path / "nt")
