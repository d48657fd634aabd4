"""Compressed-tensors checkpoints both ways, with the `compressed-tensors` library as the oracle.

Loading: tiny random HF models quantized by the library itself (min-max qparams, then its
ModelCompressor and save_pretrained, as llm-compressor does) load into QuantLinear layers whose
codes, scales and zero points give exactly the library's decompressed weights, and whose logits
match transformers reading the same folder. Writing: `save_quantized` folders validate as the
library's QuantizationConfig and decompress, through the library's own ModelCompressor, to
exactly kvserve's weights. Bad folders raise ModelLoadError naming the file and field.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32 as ct_unpack
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import load_file, save_file

from kvserve.compress.quant import quantize_model
from kvserve.loading import load_model
from kvserve.loading.ct_format import pack_to_int32, unpack_from_int32
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.quantized import save_quantized
from kvserve.weights.embedding import QuantEmbedding
from kvserve.weights.linear import QuantLinear
from tests.logits import all_position_logits
from tests.tiny_models import make_model, write_tokenizer

IDS = [2, 5, 17, 40, 3, 99, 250, 7, 11, 64, 128, 300, 1, 42, 8, 19, 23]


# --- the library as the oracle -------------------------------------------------------------------

def _minmax_qparams(module: torch.nn.Module, args: QuantizationArgs) -> None:
    """Set the module's weight_scale / weight_zero_point from the weight's min and max with the
    library's calculate_qparams (the memoryless min-max observer's arithmetic)."""
    w = module.weight.detach()
    if args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        g = w.unflatten(-1, (-1, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape).to(module.weight_zero_point.dtype)


def library_folder(kind: str, root: Path, weights: dict, targets=("Linear",), ignore=("lm_head",),
                   dtype: torch.dtype = torch.float32, fmt: str = "pack-quantized") -> Path:
    """A tiny `kind` model quantized and saved by compressed-tensors (as llm-compressor does)."""
    model = make_model(kind, root / "src").to(dtype)
    args = QuantizationArgs(**weights)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=list(targets), weights=args)},
                            ignore=list(ignore))
    apply_quantization_config(model, qc)
    for _, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _minmax_qparams(module, args)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    out = root / "q"
    model.save_pretrained(out)
    compressor.update_config(str(out))
    write_tokenizer(out)
    return out


def library_decompressed(folder: Path) -> dict[str, torch.Tensor]:
    """{HF module name: weight} of every quantized module, decompressed by the library from the
    folder's own config (QuantizationConfig -> apply_quantization_config -> ModelCompressor), the
    way transformers' compressed-tensors quantizer does."""
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(folder)
    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    model = tf.AutoModelForCausalLM.from_config(cfg)  # tiny: real tensors, so compression packs like on save
    apply_quantization_config(model, qc)
    for _, module in model.named_modules():  # placeholders the file replaces; finite for the compressor
        if getattr(module, "quantization_scheme", None) is not None:
            module.weight_scale.data.fill_(1.0)
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(model)
    quantized = [n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    state = load_file(str(folder / "model.safetensors"))
    wanted = {f"{n}.{k}" for n in quantized for k in model.get_submodule(n).state_dict()
              if k.startswith("weight") or k == "bias"}  # not a module's own buffers (Gemma's embed_scale)
    assert wanted <= set(state), sorted(wanted - set(state))[:5]
    model.load_state_dict({k: state[k] for k in wanted}, strict=False, assign=True)
    compressor.decompress_model(model)
    return {n: model.get_submodule(n).weight.detach() for n in quantized}


def _kvserve_module(loaded, hf_name: str):
    return loaded.model.get_submodule(hf_name.removeprefix("model."))


def _exact_weight(layer: QuantLinear) -> torch.Tensor:
    """scale * (codes - zero) from the layer's canonical codes: exact in float32 for these grids."""
    return layer.quantized_weight().dequantize()


def _kernel_bound(layer: QuantLinear) -> torch.Tensor:
    """How far the kernel's own weight may be from s (q - z): 0 for symmetric grids (s q is exact).
    Asymmetric ones hold a float offset s (z - 2^(b-1)) in the table's dtype (int4: the float
    zero s (8 - z); int8: a float32 offset) and subtract it in float32: half an ulp of the offset
    in the table's dtype plus float32 rounding of the product and the difference."""
    if layer.spec.sym:
        return torch.zeros(())
    qw = layer.quantized_weight()
    offset = 1 << (layer.spec.bits - 1)
    s = qw.scale.repeat_interleave(qw.shape[1] // qw.scale.shape[1], dim=1)
    z = qw.zero.repeat_interleave(qw.shape[1] // qw.zero.shape[1], dim=1)
    z_term, q_term = (s * (z - offset)).abs(), (s * (qw.codes - offset)).abs()
    table = layer.scales_and_zeros.dtype if layer.kernel == "int4" else torch.float32
    eps = torch.finfo(torch.float32).eps
    return (torch.finfo(table).eps / 2 + eps) * z_term + eps * q_term


def assert_weights_match(loaded, oracle: dict[str, torch.Tensor]) -> set[str]:
    """Every library-decompressed weight equals the QuantLinear's codes exactly, in the library's
    dtype, and the kernel's weight within _kernel_bound. -> the kernels used."""
    kernels = set()
    for name, want in oracle.items():
        layer = _kvserve_module(loaded, name)
        layer = layer.source if isinstance(layer, QuantEmbedding) else layer
        assert isinstance(layer, QuantLinear), name
        kernels.add(layer.kernel)
        exact = _exact_weight(layer)
        assert torch.equal(exact.to(want.dtype), want), (name, float((exact - want.float()).abs().max()))
        err = (layer.dequantized_weight() - exact).abs()
        assert (err <= _kernel_bound(layer)).all(), (name, float(err.max()))
    return kernels


def hf_logits(folder: Path) -> torch.Tensor:
    """transformers reading the folder (decompressed by compressed-tensors), in float32."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    quantization_config=tf.CompressedTensorsConfig(dequantize=True))
    with torch.inference_mode():
        return model.float()(torch.tensor([IDS])).logits[0].float()


# --- the packing itself --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_is_the_library_packing(bits):
    """Dense packing, codes straddling words at 3, 5, 6, 7 bits, along either dimension."""
    g = torch.Generator().manual_seed(bits)
    for r, c in [(5, 1), (3, 7), (4, 32), (6, 33), (70, 130)]:
        q = torch.randint(-(1 << bits - 1), 1 << bits - 1, (r, c), generator=g, dtype=torch.int8)
        unsigned = q.to(torch.int32) + (1 << bits - 1)
        for dim, count in ((1, c), (0, r)):
            packed = pack_to_int32(unsigned, bits, dim=dim)
            assert torch.equal(packed, ct_pack(q, bits, packed_dim=dim))
            assert torch.equal(unpack_from_int32(packed, bits, count, dim=dim), unsigned)
            assert torch.equal(ct_unpack(packed, bits, q.shape, packed_dim=dim), q)


# --- loading folders the library wrote -----------------------------------------------------------

LOAD_CASES = {
    "llama-int4-asym-g32": ("llama", dict(num_bits=4, symmetric=False, strategy="group", group_size=32), {}),
    "qwen2-int4-asym-g64": ("qwen2", dict(num_bits=4, symmetric=False, strategy="group", group_size=64), {}),
    "llama-int4-sym-channel": ("llama", dict(num_bits=4, symmetric=True, strategy="channel"), {}),
    "qwen2-int8-sym-channel-regex": ("qwen2", dict(num_bits=8, symmetric=True, strategy="channel"),
                                     dict(targets=("re:.*_proj$",), ignore=("re:.*o_proj",))),
    "gemma3-int8-asym-tensor": ("gemma3", dict(num_bits=8, symmetric=False, strategy="tensor"), {}),
    "llama-int4-sym-g32-actorder-weight-bf16": (
        "llama", dict(num_bits=4, symmetric=True, strategy="group", group_size=32, actorder="weight"),
        dict(dtype=torch.bfloat16)),
    "llama-int8-sym-channel-int-quantized": ("llama", dict(num_bits=8, symmetric=True, strategy="channel"),
                                             dict(fmt="int-quantized")),
}
# Logit tolerance: float32 activations multiply exactly by the weights above (float32 summation
# order apart); bfloat16 scales run the kernels with bfloat16 activations, as in kvserve's own
# quantized models, so their logits carry that rounding.
ATOL = {torch.float32: 5e-5, torch.bfloat16: 0.1}  # measured: 7e-6 and 0.035


@pytest.mark.parametrize("case", LOAD_CASES)
def test_library_folders_load_exactly(tmp_path, case):
    kind, weights, options = LOAD_CASES[case]
    folder = library_folder(kind, tmp_path, weights, **options)
    oracle = library_decompressed(folder)
    loaded = load_model(folder)
    kernels = assert_weights_match(loaded, oracle)
    assert kernels == {"int4" if weights["num_bits"] == 4 else "int8"}
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    n_quant = sum(isinstance(m, QuantLinear) for m in loaded.model.modules())
    assert n_quant == len(oracle) and n_linear == (0 if loaded.config.tie_word_embeddings else 1) + (3 if "regex" in case else 0)
    got, want = all_position_logits(loaded, IDS), hf_logits(folder)
    atol = ATOL[options.get("dtype", torch.float32)]
    assert torch.allclose(got, want, atol=atol, rtol=0), float((got - want).abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_legacy_act_order_g_idx_loads_on_the_exact_path(tmp_path):
    """compressed-tensors <= 0.1x act-order ("actorder": "group" + weight_g_idx): each input
    column's group is read from g_idx; the dequant kernel multiplies by exactly s (q - z)."""
    folder = library_folder("llama", tmp_path, dict(num_bits=4, symmetric=False, strategy="group", group_size=32))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (folder / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    g_idx = {}
    for key in [k for k in state if k.endswith(".weight_packed")]:
        name = key.removesuffix(".weight_packed")
        k = int(state[f"{name}.weight_shape"][1])
        g_idx[name] = (torch.arange(k) // 32)[torch.randperm(k, generator=g)]
        state[f"{name}.weight_g_idx"] = g_idx[name].to(torch.int32)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(folder)
    for name, gi in g_idx.items():
        layer = _kvserve_module(loaded, name)
        assert layer.kernel == "dequant" and torch.equal(layer.g_idx, gi)
        n, k = (int(x) for x in state[f"{name}.weight_shape"])
        q = ct_unpack(state[f"{name}.weight_packed"], 4, (n, k)).float()
        zp = ct_unpack(state[f"{name}.weight_zero_point"], 4, (n, k // 32), packed_dim=0).float()
        want = (q - zp[:, gi]) * state[f"{name}.weight_scale"][:, gi]
        assert torch.equal(layer.dequantized_weight(), want), name


# --- writing: the library reads kvserve's folders ------------------------------------------------

SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_sources")
    for kind in ("llama", "gemma3"):
        make_model(kind, root / kind, **SHAPE)
    return root


def _check_written(folder: Path, loaded_before) -> dict[str, torch.Tensor]:
    """The config is exactly what the library writes for the same QuantizationConfig, and every
    weight the library decompresses equals kvserve's own, before saving and after loading."""
    import compressed_tensors

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    library_view = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
                    "sparsity_config": {}, "transform_config": {}, **parsed.model_dump(exclude=["quant_method"])}
    assert json.loads(json.dumps(library_view)) == qc
    oracle = library_decompressed(folder)
    assert_weights_match(loaded_before, oracle)
    assert_weights_match(load_model(folder), oracle)
    return oracle


def test_rtn_int4_group_folder_is_the_library_layout(sources, tmp_path):
    loaded = load_model(sources / "llama")
    quantize_model(loaded.model, "rtn", bits=4, group_size=128, progress=False)
    out = save_quantized(loaded, tmp_path / "q")
    oracle = _check_written(out, loaded)
    assert len(oracle) == 7 * loaded.config.num_layers
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"] and qc["ignore"] == ["lm_head"]
    # transformers reads the folder too (kvserve's int4 kernel rounds activations to bf16).
    got, want = all_position_logits(loaded, IDS), hf_logits(out)
    assert torch.allclose(got, want, atol=ATOL[torch.bfloat16], rtol=0) and torch.equal(got.argmax(-1), want.argmax(-1))


def test_rtn_int8_channel_and_quantized_tied_table(sources, tmp_path):
    """Gemma 3 (tied) with the head and the embedding lookup quantized: the table is stored
    twice (the layout has no sharing) and comes back shared."""
    loaded = load_model(sources / "gemma3")
    quantize_model(loaded.model, "rtn", bits=8, sym=True, granularity="channel", lm_head=True, embedding=True,
                   progress=False)
    want = all_position_logits(loaded, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    oracle = _check_written(out, loaded)
    assert {"lm_head", "model.embed_tokens"} <= set(oracle)
    back = load_model(out)
    assert back.model.embed_tokens.tied and back.model.embed_tokens.source is back.model.lm_head
    assert torch.equal(all_position_logits(back, IDS), want)


def test_gptq_static_act_order_folder_is_the_library_layout(sources, tmp_path):
    loaded = load_model(sources / "llama")
    calib = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(loaded.model, "gptq", bits=4, group_size=64, sym=True, calibration=calib, progress=False,
                   method_options={"act_order": True, "static_groups": True})
    want = all_position_logits(loaded, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    _check_written(out, loaded)
    assert torch.equal(all_position_logits(load_model(out), IDS), want)


def test_g_idx_layers_are_written_in_the_legacy_layout(sources, tmp_path):
    """The one deviation: act-order with a g_idx has no 0.20 layout; it is written as
    compressed-tensors <= 0.1x did, which 0.20 refuses to parse."""
    loaded = load_model(sources / "llama")
    calib = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    quantize_model(loaded.model, "gptq", bits=4, group_size=64, calibration=calib, progress=False,
                   method_options={"act_order": True}, skip=["layers.1."])
    want = all_position_logits(loaded, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    with pytest.raises(ValueError, match="actorder='group' has been removed"):
        QuantizationConfig.model_validate(qc)
    back = load_model(out)
    assert torch.equal(all_position_logits(back, IDS), want)
    assert back.model.layers[0].mlp.down_proj.g_idx is not None


# --- bad input -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return library_folder("llama", tmp_path_factory.mktemp("ct_good"),
                          dict(num_bits=4, symmetric=False, strategy="group", group_size=32))


def _copy_with(good: Path, tmp_path: Path, edit=None) -> Path:
    d = tmp_path / "copy"
    shutil.copytree(good, d)
    if edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _group(q: dict) -> dict:
    return q["config_groups"]["group_0"]


@pytest.mark.parametrize("edit,field", [
    (lambda q: _group(q).update(format="marlin-24"), r"config_groups\.group_0\.format: unsupported format 'marlin-24'"),
    (lambda q: q.update(format="float-quantized"), r"quantization_config\.format: unsupported format"),
    (lambda q: _group(q).update(input_activations={"num_bits": 8, "type": "int", "symmetric": True,
                                                   "strategy": "token", "dynamic": True}),
     r"config_groups\.group_0\.input_activations: activation quantization"),
    (lambda q: _group(q)["weights"].update(type="float", num_bits=8), r"group_0\.weights\.type: 'float'"),
    (lambda q: _group(q)["weights"].update(strategy="block", block_structure=[32, 32]),
     r"group_0\.weights\.block_structure"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), r"quantization_config\.sparsity_config"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"quantization_config\.kv_cache_scheme"),
    (lambda q: q.update(quantization_status="frozen"), r"quantization_config\.quantization_status: 'frozen'"),
    (lambda q: q.update(kvserve_format_version=1), r"quantization_config\.kvserve_format_version: unsupported field"),
    (lambda q: _group(q)["weights"].update(num_bits=16), r"group_0\.weights\.num_bits: 16"),
])
def test_unsupported_configs_name_the_field(good, tmp_path, edit, field):
    d = _copy_with(good, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=r"config\.json: " + ".*" + field):
        load_model(d)


def test_missing_and_malformed_tensors_name_file_and_tensor(good, tmp_path):
    d = _copy_with(good, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"

    def write(edited):
        save_file(edited, str(d / "model.safetensors"), metadata={"format": "pt"})

    write({k: v for k, v in state.items() if k != f"{name}.weight_zero_point"})
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor '{name}\.weight_zero_point' is missing"):
        load_model(d)
    write({**state, f"{name}.weight_packed": state[f"{name}.weight_packed"][:, :-1].contiguous()})
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor {name}\.weight_packed: expected int32"):
        load_model(d)
    write({**state, f"{name}.weight_zero_point": state[f"{name}.weight_zero_point"].to(torch.int8)})
    with pytest.raises(ModelLoadError, match=rf"tensor {name}\.weight_zero_point: expected int32 .*packed along the outputs"):
        load_model(d)
    write({**state, f"{name}.weight_scale": -state[f"{name}.weight_scale"]})
    with pytest.raises(ModelLoadError, match=rf"tensor {name}\.weight_scale: scales must be finite and positive"):
        load_model(d)
    write({k: v for k, v in state.items() if not k.startswith(name)})
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}\.weight_shape' is missing"):
        load_model(d)
