"""Saving a quantized model as a folder and loading it back (kvserve/loading/quantized.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.compress.quant import quantize_model
from kvserve.loading import load_model
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.quantized import pack_to_int32, save_quantized, unpack_from_int32
from kvserve.weights.linear import QuantLinear

ROOT = Path(__file__).resolve().parents[1]
IDS = [2, 5, 17, 40, 3, 99, 250, 7, 11, 64, 128, 300, 1, 42, 8, 19, 23]
# Wide enough that every linear takes groups of 128 (hidden 128, 4 heads of 32, MLP 256).
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32)
RECIPES = {"int4-g128": dict(bits=4, group_size=128), "int8-channel": dict(bits=8, sym=True, granularity="channel")}

_FRESH = """
import sys, torch
from kvserve.loading import load_model
from tests.logits import all_position_logits
loaded = load_model(sys.argv[1])
torch.save(all_position_logits(loaded, [int(i) for i in sys.argv[3].split(',')]), sys.argv[2])
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("quant_io")
    out = {}
    for kind in ("llama", "gemma3"):
        make_model(kind, root / kind, **SHAPE)
        out[kind] = root / kind
    return out


def _logits(loaded, ids=IDS):
    from tests.logits import all_position_logits

    return all_position_logits(loaded, ids)


def _folder_weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


@pytest.mark.parametrize("bits", range(2, 9))
def test_int32_packing_round_trips(bits):
    g = torch.Generator().manual_seed(bits)
    for k in (1, 7, 32, 33, 130):
        codes = torch.randint(0, 1 << bits, (5, k), generator=g, dtype=torch.int32)
        packed = pack_to_int32(codes, bits)
        assert packed.dtype == torch.int32 and packed.shape == (5, -(-k * bits // 32))  # dense
        assert torch.equal(unpack_from_int32(packed, bits, k), codes)


def test_int32_packing_layout_is_little_end_first():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.int32)
    assert pack_to_int32(codes, 4).item() == -(2**32) + 0xF7654321
    assert pack_to_int32(torch.tensor([[0x01, 0x80, 0xFF]]), 8).item() == 0xFF8001


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_save_then_load_in_a_fresh_process_gives_identical_logits(sources, tmp_path, kind, recipe):
    loaded = load_model(sources[kind])
    report = quantize_model(loaded.model, "rtn", progress=False, **RECIPES[recipe])
    assert set(report.kernels()) == {"int4" if recipe.startswith("int4") else "int8"}
    want = _logits(loaded)
    out = save_quantized(loaded, tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert cfg["model_type"] == ("gemma3_text" if kind == "gemma3" else "llama")
    assert (out / "tokenizer.json").is_file()
    # Fresh interpreter: nothing cached from this process.
    res = tmp_path / "logits.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(out), str(res), ",".join(map(str, IDS))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(res)
    assert torch.equal(got, want), float((got - want).abs().max())
    # The loaded layers are QuantLinear on the same kernels, and the folder is small.
    again = load_model(out)
    kernels = {m.kernel for m in again.model.modules() if isinstance(m, QuantLinear)}
    assert kernels == set(report.kernels())
    fp32 = _folder_weight_bytes(sources[kind])
    saved = _folder_weight_bytes(out)
    assert saved < fp32 * (0.45 if recipe.startswith("int4") else 0.55), (saved, fp32)


def test_other_grids_heads_and_act_order_round_trip(sources, tmp_path):
    """Asymmetric per-tensor int8, a 6-bit group grid on the dequant path with act-order g_idx,
    a quantized tied LM head and skipped (floating) layers: all come back bitwise."""
    from kvserve.weights.spec import QuantizedWeight

    loaded = load_model(sources["gemma3"])
    quantize_model(loaded.model, bits=8, sym=False, granularity="tensor", skip=["layers.1."], lm_head=True,
                   progress=False)
    # Replace one layer by a 6-bit act-order layer on the dequant path.
    lin = loaded.model.layers[1].mlp.down_proj
    g = torch.Generator().manual_seed(0)
    k, n = lin.in_features, lin.out_features
    from kvserve.compress.quant import QuantSpec

    spec = QuantSpec(bits=6, sym=False, granularity="group", group_size=64)
    qw = QuantizedWeight(torch.randint(0, 64, (n, k), generator=g, dtype=torch.int32),
                         torch.rand(n, k // 64, generator=g) * 0.01 + 1e-3,
                         torch.randint(0, 64, (n, k // 64), generator=g, dtype=torch.int32), spec,
                         g_idx=torch.randperm(k, generator=g) % (k // 64))
    loaded.model.layers[1].mlp.down_proj = QuantLinear.from_quantized(qw)
    want = _logits(loaded)
    out = save_quantized(loaded.model, tmp_path / "q", source=sources["gemma3"], tokenizer=loaded.tokenizer)
    back = load_model(out)
    assert torch.equal(_logits(back), want)
    assert isinstance(back.model.lm_head, QuantLinear)
    assert isinstance(back.model.layers[1].self_attn.q_proj, torch.nn.Linear)
    assert back.model.layers[1].mlp.down_proj.kernel == "dequant"
    assert torch.equal(back.model.layers[1].mlp.down_proj.g_idx, qw.g_idx)


def test_generate_cli_runs_a_saved_folder(sources, tmp_path):
    loaded = load_model(sources["llama"])
    quantize_model(loaded.model, bits=4, group_size=128, progress=False)
    out = save_quantized(loaded, tmp_path / "q")
    from kvserve import LLM, SamplingParams

    text = LLM(str(out)).generate("The quick", SamplingParams(max_tokens=5, temperature=0.0))[0].outputs[0].text
    proc = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--model", str(out),
                           "The quick", "--max-tokens", "5", "--temperature", "0"],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert text in proc.stdout


@pytest.fixture(scope="module")
def saved(sources, tmp_path_factory):
    loaded = load_model(sources["llama"])
    quantize_model(loaded.model, bits=4, group_size=128, progress=False)
    return save_quantized(loaded, tmp_path_factory.mktemp("saved") / "q")


def _copy(saved: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(saved, dst)
    return dst


def _edit_config(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_unknown_quant_format_names_the_field(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _edit_config(d, lambda c: c["quantization_config"].update(quant_method="gptq"))
    with pytest.raises(ModelLoadError, match=r"config\.json.*quant_method 'gptq'"):
        load_model(d)
    _edit_config(d, lambda c: c["quantization_config"].update(quant_method="compressed-tensors",
                                                              format="marlin-24"))
    with pytest.raises(ModelLoadError, match=r"format 'marlin-24'"):
        load_model(d)


def test_missing_config_field_names_it(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _edit_config(d, lambda c: c["quantization_config"]["config_groups"]["group_0"].pop("targets"))
    with pytest.raises(ModelLoadError, match=r"config\.json.*config_groups\.group_0\.targets: must be"):
        load_model(d)


def test_missing_or_corrupt_weights_name_the_file(saved, tmp_path):
    d = _copy(saved, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(d)


def test_missing_or_bad_tensor_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(saved, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_scale"
    bad = dict(sd)
    bad.pop(name)
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight_scale' is missing"):
        load_model(d)
    bad[name] = sd[name][:, :0].contiguous()
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj\.weight_scale: expected a float"):
        load_model(d)


def test_saving_an_unquantized_model_is_refused(sources, tmp_path):
    loaded = load_model(sources["llama"])
    with pytest.raises(ValueError, match="no QuantLinear"):
        save_quantized(loaded, tmp_path / "q")


def test_serve_runs_a_saved_folder(saved):
    """`kvserve serve DIR` as a real process answers a completion from the quantized folder."""
    import shutil as sh
    import time

    import httpx

    from kvserve import LLM, SamplingParams
    from tests.server_harness import free_socket, wait_healthy

    want = LLM(str(saved)).generate("The quick", SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text
    with free_socket() as sock:
        port = sock.getsockname()[1]
    exe = sh.which("kvserve") or str(Path(sys.executable).with_name("kvserve"))
    proc = subprocess.Popen([exe, "serve", str(saved), "--port", str(port), "--kv-cache-gib", "0.05",
                             "--served-model-name", "q"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180)
        r = httpx.post(url + "/v1/completions", json={"model": "q", "prompt": "The quick", "max_tokens": 6,
                                                        "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_unrounded_int4_scales_come_back_within_the_stated_bound(sources, tmp_path):
    """Scales not rounded to the kernel's bf16 before the zero points were set: the layout stores
    no float zero table, so the int4 kernel's s (8 - z) is rebuilt from the stored scale, each
    entry within a relative 2^-7 of the saved layer's; codes and scales come back bitwise."""
    from kvserve.compress.quant import QuantSpec
    from kvserve.weights.spec import QuantizedWeight

    loaded = load_model(sources["llama"])
    g = torch.Generator().manual_seed(1)
    lin = loaded.model.layers[0].mlp.up_proj
    n, k = lin.out_features, lin.in_features
    spec = QuantSpec(bits=4, sym=False, granularity="group", group_size=32)
    qw = QuantizedWeight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32),
                         torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3,
                         torch.randint(0, 16, (n, k // 32), generator=g, dtype=torch.int32), spec)
    saved_layer = QuantLinear.from_quantized(qw)
    loaded.model.layers[0].mlp.up_proj = saved_layer
    out = save_quantized(loaded, tmp_path / "q")
    back = load_model(out)
    got_layer = back.model.layers[0].mlp.up_proj
    assert got_layer.kernel == "int4" and torch.equal(got_layer.qweight, saved_layer.qweight)
    before, after = saved_layer.scales_and_zeros.float(), got_layer.scales_and_zeros.float()
    assert torch.equal(after[..., 0], before[..., 0])
    zf_diff = (after[..., 1] - before[..., 1]).abs()
    assert zf_diff.max() > 0  # the case this test is about: some entries did move
    assert (zf_diff <= before[..., 1].abs() * 2**-7).all()
    # The weight the kernel multiplies by moves by exactly those amounts, nothing else.
    assert (got_layer.dequantized_weight() - saved_layer.dequantized_weight()).abs().max() == zf_diff.max()
