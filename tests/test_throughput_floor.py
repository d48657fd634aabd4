"""kvserve/tools/analysis/floor.py: the workload's unavoidable work, counted by hand on a toy model."""
from __future__ import annotations

import pytest

from kvserve.model.config import FULL, SLIDING, ModelConfig, RopeConfig
from kvserve.tools.analysis import floor as floor_module
from kvserve.tools.bench.throughput import Workload


@pytest.fixture(scope="module")
def floor():
    return floor_module


def toy(**kw) -> ModelConfig:
    rope = {FULL: RopeConfig(theta=10_000.0), SLIDING: RopeConfig(theta=10_000.0)}
    args = dict(family="gemma3", model_type="toy", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
                num_heads=2, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6, max_position_embeddings=64,
                layer_types=[SLIDING, FULL], rope=rope, attn_scale=1.0, sliding_window=3)
    return ModelConfig(**{**args, **kw})


def test_counts_match_a_hand_count(floor):
    # One request: a 4-token prompt, 3 output tokens. A whole layer: q 4x4 + k,v 4x2 each + o 4x4 + MLP
    # 3 x 4x8 = 144 multiply-adds a row; K/V alone 16. Rows through the body: 4 + 3 - 1 = 6.
    work = floor.count_work(toy(), Workload(prompts=[[1, 2, 3, 4]], output_lens=[3]))
    assert work.body_macs == 6 * 144 + 3 * 144 + 3 * 16  # layer 0 for all rows; the last layer in full for 3
    # Contexts: sliding (window 3) prompt 1,2,3,3 and generated 3,3; full prompt 1..4 and generated 5,6.
    # QK^T and PV: 2 heads x 2 dims x 2 = 8 multiply-adds a context token; K/V: 2 x 2 dims x 4 bytes.
    assert work.prefill_attn_macs == 8 * (9 + 10)
    assert work.decode_attn_macs == 8 * (6 + 11)
    assert work.decode_kv_bytes == 16 * (6 + 11)
    assert work.head_macs == 3 * 10 * 4
    assert work.min_steps == 3 and work.output_tokens == 3


def test_each_part_takes_the_larger_of_its_arithmetic_and_its_bytes(floor):
    work = floor.Work(body_macs=50e9, prefill_attn_macs=5e9, decode_attn_macs=1e9, decode_kv_bytes=40e9,
                      head_macs=20e9, body_weight_bytes_per_step=1e9, head_int8_bytes_per_step=1e8, min_steps=10,
                      output_tokens=100)
    f = floor.floor_seconds(work, fp32_gflops=100.0, int16_gmacs=200.0, read_gbs=20.0, head="int16")
    assert f["parts_s"] == pytest.approx({"body": 1.0, "prefill attention": 0.1, "decode attention": 2.0,
                                          "head (int16 screen)": 0.1})
    assert f["output_tok_s"] == pytest.approx(100 / 3.2)
    fp32 = floor.floor_seconds(work, fp32_gflops=100.0, int16_gmacs=200.0, read_gbs=20.0, head="fp32")
    assert fp32["parts_s"]["head (fp32)"] == pytest.approx(0.4)  # 2 x 20e9 FLOP at 100 GFLOP/s > 4e9 B at 20 GB/s


def test_cross_layer_kv_is_refused_by_name(floor):
    cfg = toy(kv_source=(0, 0), layer_types=[SLIDING, SLIDING])
    with pytest.raises(ValueError, match="toy"):
        floor.count_work(cfg, Workload(prompts=[[1, 2]], output_lens=[1]))
