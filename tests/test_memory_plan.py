"""Memory you can plan: the weights' footprint read from file headers before loading, a refusal
with the numbers when the model will not fit, and the automatic KV pool sized from max_model_len
and the memory available."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve import LLM
from kvserve.accel.prepare import fast_path_nbytes
from kvserve.engine import builder
from kvserve.loading.footprint import file_tensors, weight_footprint
from kvserve.model.base import stored_weight_bytes
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_model("llama", folder)
    return folder


def test_footprint_from_headers_matches_what_the_engine_then_holds(tiny_llama):
    elements, stored = file_tensors(tiny_llama)
    llm = LLM(model=str(tiny_llama), kv_cache_gib=0.01)
    model = llm.engine.loaded.model
    assert elements == sum(p.numel() for p in model.parameters())
    held = stored_weight_bytes(model) + fast_path_nbytes(model)
    predicted = weight_footprint(tiny_llama, "float", torch.float32, pack=True)
    assert predicted == 2 * 4 * elements
    # The packed copy pads panels and adds the head's int8 screen, and skips the norms: near the plan.
    assert 0.9 * predicted <= held <= 1.35 * predicted
    assert weight_footprint(tiny_llama, "float", torch.float32, pack=False) == stored_weight_bytes(model)
    assert weight_footprint(tiny_llama, "float", torch.bfloat16, pack=True) == 2 * elements
    # int4: the quantized weights (streamed load) plus the float bytes held while quantizing
    q = LLM(model=str(tiny_llama), weights="int4", kv_cache_gib=0.01).engine.loaded.model
    planned = weight_footprint(tiny_llama, "int4", torch.float32, pack=True)
    assert stored_weight_bytes(q) < planned < 8 * elements  # (tiny: the head's RTN temporaries dominate)


def test_footprint_of_a_16bit_checkpoint_kept_in_16_bits(tmp_path):
    make_model("llama", tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    model = LLM(model=str(tmp_path), kv_cache_gib=0.01).engine.loaded.model  # dtype auto
    assert weight_footprint(tmp_path, "float", "auto", pack=True) == stored_weight_bytes(model) + fast_path_nbytes(model)
    elements, _ = file_tensors(tmp_path)
    assert weight_footprint(tmp_path, "float", "float32", pack=True) == 8 * elements  # explicit fp32: as before
    for kind in ("int8", "int4"):
        quantized = LLM(model=str(tmp_path), weights=kind, kv_cache_gib=0.01).engine.loaded.model
        held = stored_weight_bytes(quantized)
        assert held < weight_footprint(tmp_path, kind, "auto", pack=True) < held + 8 * elements


def test_gguf_blocks_footprint_is_the_files_tensor_bytes(gemma_path, gemma_gguf_reader):
    elements, stored = file_tensors(gemma_path)  # the header scanned without the metadata's arrays
    reader = gemma_gguf_reader
    assert elements == sum(int(t.n_elements) for t in reader.tensors)
    assert stored == sum(int(t.n_bytes) for t in reader.tensors)
    assert weight_footprint(gemma_path, "gguf", torch.float32, pack=True) == stored


def test_unreadable_headers_name_the_file(tmp_path):
    from kvserve.loading.errors import ModelLoadError

    import struct

    bad = tmp_path / "bad.gguf"
    for header in (b"GGUF" + bytes(8),  # cut short
                   struct.pack("<4sIQQ", b"GGUF", 3, 1, 0) + struct.pack("<Q", 1) + b"w" + struct.pack("<I", 10**9),
                   # metadata: an array of arrays nested deeper than any reader recurses
                   struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
                   + struct.pack("<IQ", 9, 1) * 5000):
        bad.write_bytes(header)
        with pytest.raises(ModelLoadError, match="bad.gguf.*unreadable GGUF header"):
            file_tensors(bad)


def test_a_model_that_will_not_fit_is_refused_before_loading(tiny_llama, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("loaded despite the refusal")

    monkeypatch.setattr(builder, "load_model", no_load)
    monkeypatch.setattr(builder, "available_memory_bytes", lambda: 10**6)
    with pytest.raises(builder.InsufficientMemoryError) as e:
        LLM(model=str(tiny_llama), kv_cache_gib=0.01)
    weights = weight_footprint(tiny_llama, "float", torch.float32, pack=True)
    assert f"weights {weights / 1e9:.2f} GB as --weights float" in str(e.value)
    assert "KV pool 0.01 GB (--kv-cache-gib)" in str(e.value) and "0.00 GB of memory is available" in str(e.value)
    assert isinstance(e.value, MemoryError)


def test_automatic_pool_holds_max_model_len_within_the_memory_available(tiny_llama, monkeypatch):
    llm = LLM(model=str(tiny_llama), max_model_len=512)
    eng = llm.engine
    groups = len(eng.layer_groups)
    assert eng.num_blocks == groups * math.ceil(512 / eng.config.block_size)
    assert eng.max_model_len == 512
    # Little memory left: the pool is half of it, and the context is capped to what it holds.
    page = eng.page_bytes
    monkeypatch.setattr(builder, "available_memory_bytes", lambda: 2 * 6 * groups * page)
    small = LLM(loaded=eng.loaded, max_model_len=512).engine  # loaded: the refusal before loading does not apply
    assert small.num_blocks == 6 * groups
    assert small.max_model_len < 512
    assert builder.auto_kv_bytes(512, page, groups, 16, available=None) == groups * 32 * page



def test_loading_and_serving_a_model_imports_no_compiler(tiny_llama):
    """Building the empty model on the meta device must not run meta-device ops (torch routes
    them through torch._refs, whose first use imports torch._dynamo with sympy and triton: ~150
    MB resident that a model not using torch.compile pays for nothing)."""
    import subprocess
    import sys

    code = ("import sys; from kvserve import LLM, SamplingParams; "
            f"llm = LLM(model={str(tiny_llama)!r}, kv_cache_gib=0.01); "
            "llm.generate([2, 5, 9], SamplingParams(max_tokens=3, temperature=0)); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
