"""`kvserve bench latency` on a tiny random model: the numbers it prints are measured, and the
bytes-per-token behind its bandwidth bound are counted right."""
from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.tools.bench.latency import decode_bytes_per_token, weight_bytes


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from tests.tiny_models import make_model

    folder = tmp_path_factory.mktemp("tiny-gemma3-latency")
    make_model("gemma3", folder)  # sliding window 8 on 4 of 6 layers
    return folder


def test_bytes_per_token_counts_weights_once_and_windowed_kv(tiny_gemma):
    from kvserve.loading import load_model

    loaded = load_model(tiny_gemma)
    cfg = loaded.config
    params = {p.data_ptr(): p.numel() * 4 for p in loaded.model.parameters()}
    assert weight_bytes(loaded.model) == sum(params.values())
    per_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    # context 100: 4 sliding layers read 8 positions, 2 full layers read 100.
    expected_kv = per_layer_token * (4 * 8 + 2 * 100)
    assert decode_bytes_per_token(loaded, 100) == sum(params.values()) + expected_kv
    # Packed for the engine: greedy steps read the head's int8 screen instead of the fp32 head.
    from kvserve.accel.greedy_head import drop_head_screen, head_screen
    from kvserve.accel.prepare import prepare_model

    prepare_model(loaded.model, "cpu")
    screen = head_screen(loaded.model)
    if screen is not None:
        head = cfg.vocab_size * cfg.hidden_size * 4
        assert screen.nbytes == (-(-cfg.vocab_size // 16) * 16 * (cfg.hidden_size + cfg.hidden_size % 2)
                                 + 3 * 8 * cfg.vocab_size)
        assert decode_bytes_per_token(loaded, 100) == sum(params.values()) - head + screen.nbytes + expected_kv
        drop_head_screen(loaded.model)
    # A quantized model: its packed codes and scales are buffers, counted as stored.
    from kvserve.compress.quant import quantize_model

    report = quantize_model(loaded.model, "rtn", bits=8, granularity="channel", progress=False)
    quantized = sum(params.values()) - report.bytes_before + report.bytes_after
    assert weight_bytes(loaded.model) == quantized < sum(params.values())


def test_bench_latency_cli(tiny_gemma, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", str(tiny_gemma), "--input-len", "40", "--output-len", "8",
               "--repeats", "2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "batch-1 decode" in text and "achieved fraction of the bound" in text
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 2 and data["input_len"] == 40
    assert data["prefill_tok_s"] > 0 and data["decode_tok_s"] > 0 and data["ttft_s"] > 0
    assert data["bound_tok_s"] == pytest.approx(data["bandwidth_gbs"] * 1e9 / data["bytes_per_token"])
    assert data["fraction_of_bound"] == pytest.approx(data["decode_tok_s"] / data["bound_tok_s"])


def test_bench_latency_rejects_one_output_token(capsys):
    assert main(["bench", "latency", "--output-len", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and "--output-len" in err
