"""`kvserve roofline`: the lecture's inference arithmetic, pinned (no model weights are loaded).

The lecture's setup: Llama-2-13B (L=40, N=K=40 heads of H=128, D=5120, F=13824, vocab 32000),
bf16 weights and KV cache (2 bytes), sequences of S = 1024 tokens, one H100 SXM (989 TFLOP/s
bf16 dense, 3.35 TB/s, 80 GB). Memory = 2·P + B·KV_per_sequence.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvserve.cli import main
from kvserve.tools.analysis import roofline as rl
from kvserve.tools.analysis.presets import (
    MODELS,
    hardware_preset,
    resolve_model,
    shape_from_hf_config,
)

H100 = hardware_preset("H100")
L13 = MODELS["llama-2-13b"]
S = 1024

LLAMA_2_13B_CONFIG = {
    "model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
    "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000, "tie_word_embeddings": False,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
}


def test_h100_accelerator_intensity_is_about_295():
    assert H100.intensity == pytest.approx(989e12 / 3.35e12)
    assert round(H100.intensity) == 295
    assert hardware_preset("h200").bandwidth == 4.8e12


def test_llama_2_13b_has_13b_parameters():
    assert rl.num_params(L13) == pytest.approx(13.0e9, rel=0.01)
    assert rl.num_params(L13) == 13_015_864_320  # the HF checkpoint's count (norms included)
    assert rl.weight_memory(L13) == 2 * rl.num_params(L13)  # bf16


def test_llama_2_13b_kv_bytes_per_sequence_bf16():
    # 2 (K and V) x 2 bytes x S x K x H x L
    assert rl.kv_bytes_per_token(L13) == 2 * 2 * 40 * 128 * 40 == 819_200
    assert rl.kv_bytes_per_sequence(L13, S) == 838_860_800


def test_batch_256_does_not_fit_in_80_gb_but_a_smaller_batch_does():
    assert H100.memory == 80e9
    assert rl.memory(L13, 256, S) > H100.memory  # 26 GB weights + 256 x 0.84 GB = 241 GB
    assert rl.memory(L13, 64, S) <= H100.memory
    assert rl.max_batch(L13, H100, S) == 64
    assert rl.memory(L13, 65, S) > H100.memory
    sweep = {p.batch: p for p in rl.batch_sweep(L13, H100, S, [1, 64, 256])}
    assert sweep[64].fits and not sweep[256].fits


def test_gqa_divides_kv_and_raises_the_feasible_batch():
    gqa = replace(L13, kv_heads=8)
    assert rl.kv_bytes_per_sequence(gqa, S) * 40 / 8 == rl.kv_bytes_per_sequence(L13, S)
    assert rl.max_batch(gqa, H100, S) > 4 * rl.max_batch(L13, H100, S)
    by_label = dict(rl.kv_variants(L13))
    assert rl.max_batch(by_label["GQA (K=8)"], H100, S) > rl.max_batch(L13, H100, S)


def _op(ops: list[rl.OpCost], name: str) -> rl.OpCost:
    return next(op for op in ops if op.name == name)


def test_matmul_intensity_formula():
    b, d, f = 8, 5120, 13824
    assert rl.matmul("x", b, d, f, 2).intensity == pytest.approx(b * d * f / (b * d + d * f + b * f))


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_mlp_intensity_is_about_the_batch(batch):
    mlp = _op(rl.decode_costs(L13, batch, S), "mlp")
    assert 0.9 * batch < mlp.intensity <= batch
    assert mlp.bound(H100) == "memory"


def test_prefill_mlp_intensity_is_about_batch_times_tokens_clipped():
    d, f = L13.hidden, L13.intermediate
    for b, t in [(1, 16), (1, 1024), (4, 1024)]:
        bt = b * t
        mlp = _op(rl.prefill_costs(L13, b, t), "mlp")
        assert mlp.intensity == pytest.approx(bt * d * f / (bt * d + d * f + bt * f))
        assert mlp.intensity <= min(bt, d * f / (d + f))  # B·T, clipped by the weights' shape
    assert _op(rl.prefill_costs(L13, 1, 16), "mlp").intensity == pytest.approx(16, rel=0.01)
    assert _op(rl.prefill_costs(L13, 1, 1024), "mlp").bound(H100) == "compute"


@pytest.mark.parametrize("s,t", [(1024, 1), (1024, 1024), (4096, 16), (512, 128)])
@pytest.mark.parametrize("batch", [1, 32])
def test_attention_intensity_is_st_over_s_plus_t(s, t, batch):
    """MHA in bf16: S·T/(S+T); prefill (T = S) gives S/2, decode ~1; the batch does not appear."""
    att = rl.attention_core(L13, batch, t, s)
    assert att.intensity == pytest.approx(s * t / (s + t))


def test_gqa_decode_attention_intensity_is_the_group_size():
    att = rl.attention_core(replace(L13, kv_heads=8), 1, 1, S)
    assert att.intensity == pytest.approx(40 / 8, rel=0.01)


def test_mla_kv_bytes_per_token_is_latent_plus_rope():
    ds = MODELS["deepseek-v2-lite"]
    assert rl.kv_bytes_per_token(ds) == (512 + 64) * 2 * 27
    assert rl.kv_bytes_per_sequence(ds, S) == (512 + 64) * 2 * 27 * S
    assert rl.num_params(ds) == pytest.approx(15.7e9, rel=0.01)  # MoE: 64 routed + 2 shared experts
    assert rl.num_params(ds, active=True) < rl.num_params(ds) / 5


def test_sliding_window_layers_cache_at_most_the_window():
    g = MODELS["gemma-3-270m"]
    per_layer_token = 2 * 1 * 256 * 2
    assert rl.kv_bytes_per_sequence(g, 256) == 256 * rl.kv_bytes_per_token(g)
    assert rl.kv_bytes_per_sequence(g, 1024) == (3 * 1024 + 15 * 512) * per_layer_token
    assert rl.num_params(g) == 268_098_176  # HF's count for google/gemma-3-270m


def test_hf_config_mapping_matches_the_presets():
    assert replace(shape_from_hf_config(LLAMA_2_13B_CONFIG, "x"), name=L13.name) == L13
    deepseek = {"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27,
                "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 102400, "kv_lora_rank": 512,
                "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "tie_word_embeddings": False}
    ds = MODELS["deepseek-v2-lite"]
    assert replace(shape_from_hf_config(deepseek, "x"), name=ds.name) == ds
    gemma = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
        "sliding_window": 512, "sliding_window_pattern": 6}}
    g = MODELS["gemma-3-270m"]
    assert replace(shape_from_hf_config(gemma, "x"), name=g.name) == g


def test_bundled_gguf_config_matches_the_gemma_preset():
    assert replace(resolve_model(None), name="gemma-3-270m") == MODELS["gemma-3-270m"]


def test_cli_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["roofline", "--model", "llama-2-13b", "--hardware", "H100", "--batch", "1,64,256",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for s in ("838,860,800", "13,015,864,320", "| accelerator intensity | 295 FLOP/byte |", "OOM", "GQA (K=8)"):
        assert s in text
    r = json.loads(out.read_text())
    assert r["max_batch"] == 64 and r["kv_bytes_per_sequence"] == 838_860_800
    assert [p["fits"] for p in r["sweep"]] == [True, True, False]


def test_cli_kv_heads_and_kv_bits_overrides(tmp_path):
    out = tmp_path / "r.json"
    assert main(["roofline", "--model", "llama-2-13b", "--kv-heads", "8", "--kv-bits", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kv_bytes_per_sequence"] == 838_860_800 / 5 / 2


def test_cli_hf_config_file_and_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_13B_CONFIG))
    for spec in (tmp_path / "config.json", tmp_path):
        assert main(["roofline", "--model", str(spec), "--batch", "8"]) == 0
        assert "838,860,800" in capsys.readouterr().out


def test_cli_plot_writes_pngs(tmp_path, capsys):
    assert main(["roofline", "--model", "llama-2-13b", "--plot", str(tmp_path / "plots")]) == 0
    for name in ("roofline_latency_throughput.png", "roofline_memory_vs_batch.png", "roofline_kv_variants.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000


def test_cli_measure_uses_this_machine(monkeypatch, capsys):
    from kvserve.tools.analysis import measure

    assert measure.matmul_flops(n=128, repeats=2) > 0
    monkeypatch.setattr(measure, "measure_hardware", lambda: rl.Hardware("probe", 1e11, 2e10, 16e9))
    assert main(["roofline", "--measure", "--model", "gemma-3-270m", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "on probe" in out and "4-byte weights" in out  # the CPU engine runs fp32


@pytest.mark.parametrize("argv,named", [
    (["--model", "llama-9"], "llama-9"),
    (["--model", "missing/config.json"], "missing/config.json"),
    (["--hardware", "tpu"], "tpu"),
    (["--model", "llama-2-13b", "--kv-heads", "3"], "--kv-heads"),
    (["--model", "llama-2-13b", "--prompt-len", "2048"], "--prompt-len"),
    (["--model", "deepseek-v2-lite", "--kv-heads", "1"], "--kv-heads"),
])
def test_cli_bad_input_is_a_message(argv, named, capsys):
    assert main(["roofline", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_cli_bad_json_config_is_a_message(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["roofline", "--model", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["roofline", "--model", str(bad)]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--batch", "0"], ["--seq-len", "x"], ["--dtype-bytes", "-1"]])
def test_cli_bad_flag_exits_naming_it(flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["roofline", *flag])
    assert e.value.code == 2
    assert flag[0] in capsys.readouterr().err


def test_cross_layer_sharing_halves_the_cache_per_attention_type():
    l13 = MODELS["llama-2-13b"]
    cla = replace(l13, kv_share=2)
    assert rl.kv_bytes_per_sequence(cla, 1024) == 838_860_800 // 2
    assert rl.max_batch(cla, hardware_preset("h100"), 1024) > 2 * rl.max_batch(l13, hardware_preset("h100"), 1024) - 2
    # 20 of 40 layers lose k_proj and v_proj (MHA: 2 x 5120 x 5120 each)
    assert rl.num_params(l13) - rl.num_params(cla) == 20 * 2 * 5120 * 5120
    # Gemma 3 270M: runs per type, 15 sliding -> 8, 3 full -> 2 layers keep K/V
    g = replace(MODELS["gemma-3-270m"], kv_share=2)
    assert g.kv_layers == 10
    assert rl.kv_bytes_per_token(g) == 10 * 2 * 256 * 2
    assert any("CLA" in label for label, _ in rl.kv_variants(l13))


def test_cla_folder_config_matches_the_measured_pool(tmp_path):
    import json

    from kvserve import LLM
    from kvserve.compress.convert.cla import share_kv
    from kvserve.loading import load_model
    from kvserve.loading.save import save_model
    from kvserve.tools.analysis.presets import shape_from_hf_config
    from tests.tiny_models import make_model

    make_model("gemma3", tmp_path / "g")
    out = save_model(share_kv(load_model(tmp_path / "g"), 2), tmp_path / "cla")
    shape = shape_from_hf_config(json.loads((out / "config.json").read_text()), "tiny-cla")
    assert shape.kv_share == 2 and shape.kv_layers == 3
    eng = LLM(str(out), kv_cache_gib=0.01, sliding_window_release=False).engine
    assert rl.kv_bytes_per_token(replace(shape, kv_bytes=4.0)) == eng.kv_cache.nbytes / eng.kv_cache.num_slots
