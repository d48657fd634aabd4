"""N:M compressed storage (kvserve/weights/sparse_nm.py, kvserve/loading/sparse_nm.py): bit packing, exact round trips of 2:4 and
4:8 weights, SparseNMLinear = dense F.linear on CPU, compressed folders through load_model."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model

from kvserve.compress.prune import prune_model
from kvserve.compress.prune.masks import nm_mask
from kvserve.loading import load_model
from kvserve.loading.save import save_model
from kvserve.loading.sparse_nm import save_compressed
from kvserve.tools.eval.windows import window_hidden
from kvserve.weights import sparse_nm
from kvserve.weights.sparse_nm import (
    SparseNMLinear,
    compress_model,
    compress_nm,
    decompress_nm,
    index_bits,
    pack_bits,
    unpack_bits,
)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 1 << bits, (7, 37), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, -(-37 * bits // 8))
    assert torch.equal(unpack_bits(packed, bits, 37), codes)


def test_two_bit_layout_is_little_end_first():
    assert pack_bits(torch.tensor([[1, 2, 3, 0]]), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def _nm_weight(rows, k, n, m, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g)
    w = w * nm_mask(w.abs(), n, m)
    w[0, :m] = 0  # a group with fewer than n non-zeros
    w[1, :m] = torch.tensor([0.0, 5.0] + [0.0] * (m - 2))
    return w.to(dtype)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nm_compression_round_trips_exactly(n, m, dtype):
    w = _nm_weight(32, 64, n, m, dtype)
    values, indices = compress_nm(w, n, m)
    assert values.shape == (32, 64 * n // m) and values.dtype == dtype
    assert indices.dtype == torch.uint8 and indices.shape == (32, -(-64 * n // m * index_bits(m) // 8))
    assert torch.equal(decompress_nm(values, indices, n, m, 64), w)


def test_two_four_sizes_are_half_the_values_plus_two_bit_indices():
    w = _nm_weight(64, 256, 2, 4)
    values, indices = compress_nm(w, 2, 4)
    assert values.numel() == w.numel() // 2 and indices.numel() == w.numel() // 8  # 2 bits per kept value
    assert index_bits(4) == 2 and index_bits(8) == 3


def test_a_dense_weight_is_refused():
    with pytest.raises(ValueError, match="not 2:4 sparse"):
        compress_nm(torch.ones(4, 8), 2, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        compress_nm(torch.zeros(4, 6), 2, 4)


def test_sparse_linear_matches_dense_on_cpu_and_logs_the_fallback(caplog, monkeypatch):
    lin = torch.nn.Linear(64, 24)
    with torch.no_grad():
        lin.weight.copy_(_nm_weight(24, 64, 2, 4))
    mod = SparseNMLinear.from_linear(lin, "2:4")
    x = torch.randn(3, 5, 64)
    monkeypatch.setattr(sparse_nm, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="kvserve.weights.sparse_nm"):
        y = mod(x)
        mod(x)
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    assert sum("dense fallback" in r.message for r in caplog.records) == 1
    assert torch.equal(mod.dense_weight(), lin.weight)


@pytest.mark.skipif(not sparse_nm.semi_structured_available(), reason="needs CUDA semi-structured sparsity")
def test_semi_structured_cuda_matches_dense():
    lin = torch.nn.Linear(128, 128).cuda().half()
    with torch.no_grad():
        lin.weight.copy_(_nm_weight(128, 128, 2, 4).half())
    mod = SparseNMLinear.from_linear(lin, "2:4").cuda()
    x = torch.randn(64, 128, device="cuda", dtype=torch.half)
    torch.testing.assert_close(mod(x), lin(x), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gemma_nm")
    make_model("gemma3", folder)
    lm = load_model(folder)
    prune_model(lm.model, "magnitude", pattern="2:4", progress=False)
    return lm


def test_compressed_folder_loads_back_exactly(pruned, tmp_path):
    out = save_compressed(pruned, tmp_path / "c24", "2:4")
    dense_out = save_model(pruned, tmp_path / "dense")
    back = load_model(out)
    sparse_mods = {n: m for n, m in back.model.named_modules() if isinstance(m, SparseNMLinear)}
    assert len(sparse_mods) == 6 * 7
    for name, mod in sparse_mods.items():
        assert torch.equal(mod.dense_weight(), pruned.model.get_submodule(name).weight), name
    windows = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(window_hidden(back.model, windows), window_hidden(pruned.model, windows),
                                   rtol=1e-5, atol=1e-5)
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(out) < size(dense_out)


def test_compress_model_in_memory_and_refusals(pruned, tmp_path):
    import copy

    m = copy.deepcopy(pruned.model)
    names = compress_model(m, "2:4")
    assert len(names) == 42 and isinstance(m.layers[0].mlp.down_proj, SparseNMLinear)
    back = load_model(save_compressed(m, tmp_path / "mem", "2:4", tokenizer=pruned.tokenizer))
    assert torch.equal(back.model.layers[2].self_attn.o_proj.dense_weight(),
                       pruned.model.layers[2].self_attn.o_proj.weight)
    with pytest.raises(ValueError, match="no block linear"):
        save_compressed(pruned, tmp_path / "x", "1:4")
    folder = save_compressed(pruned, tmp_path / "bad", "2:4")
    import json
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sparsity_config"]["format"] = "sparse-24-bitmask"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported format"):
        load_model(folder)
