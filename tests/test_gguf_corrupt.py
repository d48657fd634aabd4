"""A corrupt GGUF file gives an error naming the file and what is wrong, never a traceback from
deep inside the reader: metadata of the wrong type, inconsistent metadata, a truncated file."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from kvserve.loading import ModelLoadError, load_model


def _write(path: Path, **overrides) -> Path:
    meta = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
            "attention.head_count_kv": 2, "context_length": 256, **overrides}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("overrides,message", [
    ({"block_count": "two"}, "'llama.block_count' must be a number, got 'two'"),
    ({"attention.head_count": 0}, "inconsistent GGUF metadata"),
])
def test_bad_metadata_is_named(tmp_path, overrides, message):
    path = _write(tmp_path / "bad.gguf", **overrides)
    with pytest.raises(ModelLoadError, match=message) as err:
        load_model(path)
    assert str(path) in str(err.value)


def test_a_truncated_file_is_named(tmp_path):
    whole = _write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as err:
        load_model(cut)
    assert str(cut) in str(err.value)
