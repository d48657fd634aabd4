"""Bad input gets a clear error naming the bad field or file: never a traceback from deep
inside a library, a hang, or a leaked KV block."""
from __future__ import annotations

import json
import shutil

import pytest

from kvserve import LLM, EngineConfig, SamplingParams
from kvserve.loading import ModelLoadError, load_model
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_model("llama", folder)
    return folder


def _edited_copy(tmp_path, tiny_folder, edit):
    """A copy of the tiny model whose config.json went through `edit(dict)`."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or folder") as e:
        load_model(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(e.value)


def test_file_that_is_neither_gguf_nor_folder(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="weights.bin"):
        load_model(f)


def test_truncated_gguf(tmp_path, gemma_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "truncated.gguf"
    with open(gemma_path, "rb") as src:
        bad.write_bytes(src.read(3_000_000))  # header and vocabulary, tensors cut off
    with pytest.raises(ModelLoadError) as e:
        load_model(bad)
    assert "truncated.gguf" in str(e.value)
    assert not any((tmp_path / "cache").rglob("config.json")), "a failed conversion must not leave a cache entry"


def test_garbage_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="garbage.gguf.*GGUF"):
        load_model(bad)


def test_truncated_safetensors(tmp_path, tiny_folder):
    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    st = next(folder.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=st.name):
        load_model(folder)


def test_corrupt_config_json(tmp_path, tiny_folder):
    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json.*not valid JSON"):
        load_model(folder)


def test_unknown_architecture(tmp_path, tiny_folder):
    folder = _edited_copy(tmp_path, tiny_folder, lambda c: c.update(model_type="gpt_bigcode"))
    with pytest.raises(ModelLoadError, match="model_type 'gpt_bigcode' is not supported"):
        load_model(folder)


def test_config_missing_field(tmp_path, tiny_folder):
    folder = _edited_copy(tmp_path, tiny_folder, lambda c: c.pop("hidden_size"))
    with pytest.raises(ModelLoadError, match="config.json.*hidden_size"):
        load_model(folder)


def test_weights_not_matching_config(tmp_path, tiny_folder):
    folder = _edited_copy(tmp_path, tiny_folder, lambda c: c.update(intermediate_size=96))
    with pytest.raises(ModelLoadError, match="mlp.*shape"):
        load_model(folder)


def test_missing_tokenizer(tmp_path, tiny_folder):
    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(folder)


@pytest.mark.parametrize("field,value", [("dtype", "int3"), ("device", "tpu"), ("block_size", 0),
                                         ("kv_cache_gib", -1.0), ("max_num_seqs", "8"), ("max_model_len", 0),
                                         ("seed", "7"), ("seed", True), ("enable_prefix_caching", "yes")])
def test_engine_config_names_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_unknown_engine_argument(gemma):
    with pytest.raises(ValueError, match="unknown engine argument.*max_batch"):
        LLM(loaded=gemma, max_batch=4)


@pytest.fixture(scope="module")
def small_llm(gemma):
    return LLM(loaded=gemma, kv_cache_gib=0.05, max_model_len=256)


def _no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished()


def test_empty_prompt(small_llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        small_llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        small_llm.generate([[]], SamplingParams(max_tokens=4))
    _no_leak(small_llm)


def test_prompt_longer_than_context(small_llm):
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens.*max_model_len\) is 256"):
        small_llm.generate("word " * 400, SamplingParams(max_tokens=4))
    _no_leak(small_llm)


def test_out_of_vocabulary_token_ids(small_llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small_llm.generate([[2, 10**9]], SamplingParams(max_tokens=4))
    _no_leak(small_llm)


def test_bad_request_in_batch_queues_nothing(small_llm):
    """A bad prompt among good ones fails before anything runs, and leaves no request behind."""
    with pytest.raises(ValueError):
        small_llm.generate(["fine prompt", ""], SamplingParams(max_tokens=4))
    _no_leak(small_llm)
    assert small_llm.generate("fine prompt", SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_output_capped_by_context(small_llm):
    """A request that would run past max_model_len stops with finish_reason 'length'."""
    prompt = "word " * 240  # ~240 tokens: 200 more would pass 256 within a few steps
    n_prompt = len(small_llm.tokenizer.encode(prompt))
    assert n_prompt < 256 - 8
    out = small_llm.generate(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert n_prompt + len(out.token_ids) == 256
    _no_leak(small_llm)
