"""q/k/v and gate/up fused into one matmul each (kvserve/accel/fused_linear.py, the CUDA
engine's preparation), checked on the CPU: the same outputs, the parts as views of the fused
rows (no memory added, the state dict and saving unchanged)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.accel.fused_linear import FusedLinear, fuse_linear_projections
from kvserve.loading import load_model
from kvserve.loading.save import save_model
from kvserve.model.base import stored_weight_bytes
from tests.tiny_models import make_model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def _run(loaded) -> list:
    llm = LLM(loaded=loaded, pack_weights=False, kv_cache_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    return llm.generate([[2, 5, 6, 7, 8], [2, 40, 41]], params)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])  # qwen2: q/k/v biases; gemma3: GELU-tanh, q/k norms
def test_fused_projections_compute_the_same(kind, tmp_path):
    make_model(kind, tmp_path / "src")
    loaded = load_model(tmp_path / "src")
    model = loaded.model
    keys = {k: v.shape for k, v in model.state_dict().items()}
    weight_bytes = stored_weight_bytes(model)
    before = _run(loaded)
    layers = model.config.num_layers
    assert fuse_linear_projections(model) == 2 * layers
    assert fuse_linear_projections(model) == 0  # idempotent
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedLinear)
    # The parts are views of the fused rows: one storage, nothing added, the state dict as before.
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert q.untyped_storage().data_ptr() == attn.qkv_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    assert stored_weight_bytes(model) == weight_bytes
    after = _run(loaded)
    for b, a in zip(before, after):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lb, la in zip(b.outputs[0].logprobs, a.outputs[0].logprobs):
            assert la == pytest.approx(lb, abs=1e-4)
    # Saving writes the parts (copied out of the shared storage) and reads back the same model.
    out = save_model(loaded, tmp_path / "saved")
    again = _run(load_model(out))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in before]


def test_stored_weight_bytes_counts_overlapping_views_once():
    base = torch.nn.Linear(4, 6, bias=False)
    whole = base.weight.data
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(whole[:4])  # rows 0-3
    m.b = torch.nn.Parameter(whole[2:])  # rows 2-5: overlaps a
    m.c = torch.nn.Parameter(torch.zeros(3))
    assert stored_weight_bytes(m) == 6 * 4 * 4 + 3 * 4
