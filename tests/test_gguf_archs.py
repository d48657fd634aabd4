"""GGUF files of the other dense families CPU users run, written as llama.cpp's converter writes
them, must load as the HF model they came from: Qwen2 ("qwen2": q/k/v biases, tied embeddings,
q/k rows as stored), Qwen3 ("qwen3": q/k RMSNorm, head_dim 32 beside a hidden size of 64), and
Llama 3.1+ ("llama" with a rope_freqs tensor: the llama3 RoPE scaling as per-frequency divisors;
the tiny model's original_max_position_embeddings of 64 puts its frequencies in all three bands).

Oracle: the original HF model (fp32) for every position's logits and for greedy tokens, on both
the fp32 conversion and the file's own blocks (float activations)."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.loading import gguf as kv_gguf
from kvserve.loading import load_model
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.save import hf_config_dict
from kvserve.loading.tokenizer import HF_TOKENIZER_CLASSES, convert_gguf_tokenizer
from tests.logits import all_position_logits
from tests.test_gguf_llama import write_llama_gguf
from tests.tiny_models import hf_greedy, make_model, random_prompts

CASES = {"qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen3"), "llama31": ("llama", "llama")}  # arch, kind


def _write(name: str, tmp_path_factory):
    """(case name, original HF model, F32 .gguf path) with the conversion cache in a private folder."""
    arch, kind = CASES[name]
    folder = tmp_path_factory.mktemp(f"gguf_{name}")
    hf = make_model(kind, folder / "hf")
    path = folder / f"tiny-{name}.gguf"
    write_llama_gguf(hf, folder / "hf" / "tokenizer.json", path, "F32", "default", arch=arch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_CACHE", str(folder / "cache"))
        yield name, hf, path


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    yield from _write(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    yield from _write("llama31", tmp_path_factory)


def test_config_from_metadata(case):
    name, hf, path = case
    cfg = load_model(path).config
    o = hf.config
    assert (cfg.family, cfg.model_type) == ("llama", CASES[name][0])
    head_dim = getattr(o, "head_dim", None) or o.hidden_size // o.num_attention_heads
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (o.num_attention_heads, o.num_key_value_heads, head_dim)
    assert cfg.qkv_bias == (name == "qwen2") and cfg.qk_norm == (name == "qwen3")
    assert cfg.tie_word_embeddings == o.tie_word_embeddings
    scaling = cfg.rope["full_attention"].scaling_dict
    if name == "llama31":
        assert scaling["rope_type"] == "freq_factors" and len(scaling["factors"]) == head_dim // 2
        assert len(set(scaling["factors"])) > 2  # unscaled, blended and scaled frequencies all present
    else:
        assert scaling is None


@pytest.mark.parametrize("blocks", [False, True], ids=["fp32", "blocks"])
def test_prompt_logits_match_the_hf_model(case, blocks):
    name, hf, path = case
    loaded = load_model(path, gguf_blocks=blocks, gguf_activations="float")
    ids = random_prompts([40], seed=7)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (all_position_logits(loaded, ids) - ref).abs().max().item()
    assert diff < 1e-4, f"{name}: max abs logit diff {diff}"


def test_greedy_matches_the_hf_model(case):
    name, hf, path = case
    prompts = random_prompts([5, 23], seed=12)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for weights in ("float", "gguf"):
        outs = LLM(str(path), weights=weights, gguf_activations="float", kv_cache_gib=0.01).generate(prompts, params)
        for p, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf, p, 16), f"{name} ({weights}): {p}"


def test_rope_freqs_are_what_the_logits_depend_on(llama31, monkeypatch, tmp_path):
    """Without the file's frequency factors (every divisor 1), the Llama 3.1 file's logits part
    from HF's: the match above is sensitive to them."""
    _, hf, path = llama31
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(kv_gguf, "_rope_freq_factors", lambda reader, head_dim, path: (1.0,) * (head_dim // 2))
    broken = load_model(path, gguf_blocks=True, gguf_activations="float")
    ids = random_prompts([40], seed=7)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (all_position_logits(broken, ids) - ref).abs().max().item() > 1e-2


def test_freq_factors_have_no_hf_config_form(llama31):
    _, _, path = llama31
    with pytest.raises(ValueError, match="RoPE frequency factors"):
        hf_config_dict(load_model(path, gguf_blocks=True).config)


def _rewrite(src, dst, replace: dict, meta: dict | None = None) -> None:
    """A copy of GGUF `src` with some tensors' data replaced (name -> f32 array) and metadata
    added (`meta`: key -> str or float)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY
                        else None)
    for t in r.tensors:
        data = replace.get(t.name, np.asarray(t.data))
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=None if t.name in replace else t.tensor_type)
    for key, value in (meta or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("factors", [np.ones(3, np.float32), np.array([1, 2, 0, -1, 1, 1, 1, 1], np.float32)],
                         ids=["wrong length", "not positive"])
def test_bad_rope_freqs_are_refused_naming_the_tensor(llama31, tmp_path, monkeypatch, factors):
    _, _, path = llama31
    bad = tmp_path / "bad.gguf"
    _rewrite(path, bad, {"rope_freqs.weight": factors})
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight must hold 8 positive values"):
        load_model(bad, gguf_blocks=True)


def test_rope_freqs_beside_a_rope_scaling_type_is_refused(llama31, tmp_path, monkeypatch):
    """Two rope scalings at once (the factors tensor and a scaling type): refused, naming both."""
    _, _, path = llama31
    both = tmp_path / "both.gguf"
    _rewrite(path, both, {}, {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight and llama.rope.scaling.type 'linear' together"):
        load_model(both, gguf_blocks=True)


@pytest.mark.parametrize("arch,kind,name", [
    ("llama", "llama", "tiny-llama"), ("llama", "llama", "tiny-mistral"), ("qwen2", "qwen2", "tiny-qwen2"),
    ("qwen3", "qwen3", "tiny-qwen3"), ("qwen2moe", "qwen2_moe", "tiny-qwen2moe"), ("qwen3moe", "qwen3_moe", "tiny-qwen3moe")])
def test_the_named_tokenizer_class_converts_as_autotokenizer(tmp_path, arch, kind, name):
    """A tokenizer conversion names transformers' class for the file's architecture
    (`HF_TOKENIZER_CLASSES`) instead of letting AutoTokenizer read the whole file to find it: the
    oracle is AutoTokenizer on the same file, for every architecture the loader reads (gemma3: the
    bundled file, tests/test_tokenizer_spm.py). A "mistral" general.name turns HF's model type
    for a llama file into mistral's."""
    import transformers

    assert set(HF_TOKENIZER_CLASSES) == set(kv_gguf.SUPPORTED_ARCHS)
    hf = make_model(kind, tmp_path / "hf", **({"mlp_only_layers": []} if "moe" in kind else {}))
    path = tmp_path / "gguf" / f"{name}.gguf"
    path.parent.mkdir()
    write_llama_gguf(hf, tmp_path / "hf" / "tokenizer.json", path, "F32", "default", arch=arch, name=name)
    convert_gguf_tokenizer(path, tmp_path / "tokenizer.json")
    auto = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(auto).__name__ == HF_TOKENIZER_CLASSES[arch]
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads(auto.backend_tokenizer.to_str())
