"""Save a quantized model as a self-contained HF-style folder, and load it back.

`save_quantized(model, out_dir, source=..., tokenizer=...)` writes

* `config.json`: the HF fields our HF loader (kvserve/loading/hf.py) reads for the model's own
  type (`llama`/`mistral`/`qwen2`/`qwen3`, or `gemma3_text` for Gemma 3, whatever the source
  was: GGUF or HF), with layer types, per-type rope parameters, softcapping, norms eps, tying, ...
  plus a `quantization_config` (below). Before writing, the config is read back through
  `read_hf_config` and must give the same ModelConfig, so a field the HF vocabulary cannot say
  fails at save time, not at load time.
* `generation_config.json` (eos/bos/pad ids), `tokenizer.json` (+ `tokenizer_config.json`,
  `special_tokens_map.json`, `chat_template.jinja` copied from an HF source folder, or the chat
  template written out), so `LLM(DIR)`, `kvserve generate --model DIR`, `kvserve serve DIR` need
  nothing else.
* `model.safetensors`: every tensor under HF names (`model.layers.0.self_attn.q_proj...`,
  `model.embed_tokens.weight`, `lm_head...`). Floating tensors (embedding, norms, unquantized
  linears) are stored as they are in memory. Each quantized linear `P` is stored as
  (compressed-tensors "pack-quantized" layout):

    P.weight_packed      int32 [N, ceil(K / (32 // b))]: b-bit codes packed little end first
                         along the inputs, 32 // b per int32 (8 at 4 bits, 4 at 8 bits, 10 at
                         3 bits; the high bits of a word unused when b does not divide 32). A
                         stored code is the signed code + 2^(b-1), i.e. unsigned in [0, 2^b - 1].
    P.weight_scale       [N, G] (G groups per row; [1] for strategy "tensor"), in the dtype the
                         layer's kernel keeps its scales (bfloat16 for the int4/int8 kernels by
                         default, float32 for the dequant fallback).
    P.weight_zero_point  int8 [N, G] ([1] for "tensor"), asymmetric grids only: the zero point in
                         the signed code range (zero - 2^(b-1)). Not packed (compressed-tensors
                         packs int4 zero points along N; ours are 1 byte each, a small deviation).
    P.weight_shape       int64 [2] = [N, K].
    P.weight_g_idx       int32 [K], act-order (GPTQ) layers only: the scale group of each input.
    P.weight_zero_float  (kvserve extension, rare) [N, K/g] in the int4 kernel's dtype: its float
                         zero table s * (8 - z), saved only when it cannot be recomputed bit for
                         bit from the stored scale (a scale that was not rounded to the kernel's
                         dtype before the codes were chosen; quantize_model always rounds it).
    P.bias               floating [N] when the layer has one.

  W = scale * (signed code - signed zero) over each group of `group_size` inputs, which equals
  our canonical QuantizedWeight (kvserve/weights/spec.py) term by term.

`quantization_config` (compressed-tensors vocabulary where it fits):

    {"quant_method": "compressed-tensors", "format": "pack-quantized",
     "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": [module names, e.g. "model.layers.0.mlp.down_proj"],
                                   "weights": {"num_bits": 4, "type": "int", "symmetric": false,
                                               "strategy": "group", "group_size": 128,
                                               "dynamic": false, "actorder": null},
                                   "input_activations": null, "output_activations": null,
                                   "kvserve": {"kernel": "int4", "act_dtype": "bfloat16",
                                               "scale_dtype": "bfloat16"}}, ...},
     "ignore": [floating linears, e.g. "lm_head"],
     "kvserve_format_version": 1}

Targets are exact module names (one group per distinct grid + kernel). The `kvserve` entry of a
group (an extension) records which kernel the layers ran on and its activation dtype, so the
loaded model computes with the same kernel and rounding as the one that was saved.

Loading (`quantized_parts`, called by kvserve.loading.load_model when config.json has a
`quantization_config`): the model is built on the meta device, each target linear is replaced by
a QuantLinear rebuilt from its codes (`QuantLinear.from_quantized`; the int4 kernel's tiled
layout is re-derived there), the remaining tensors are adopted as in an HF folder. Weights are
never dequantized to float. An unknown `quant_method` / `format`, a missing or malformed field,
a missing or corrupt tensor raises ModelLoadError naming the file and the field or tensor.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.loading.errors import ModelLoadError
from kvserve.loading.hf import read_json, safetensors_files
from kvserve.loading.save import (
    WEIGHTS_FILE,
    dtype_name,
    hf_config_dict,
    hf_name,
    unpack_loaded,
    write_folder,
)
from kvserve.weights.embedding import QuantEmbedding
from kvserve.weights.linear import KERNELS, QuantLinear
from kvserve.weights.spec import QuantizedWeight, QuantSpec, is_quantized_module

FORMAT_VERSION = 1
QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- int32 packing (compressed-tensors pack_to_int32 convention) -------------------------------

def pack_to_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [N, K] in [0, 2^bits - 1] -> int32 [N, ceil(K / (32 // bits))], code k of a
    word at bits [bits * k, bits * (k + 1)), the first column in the lowest bits."""
    per = 32 // bits
    n, k = codes.shape
    words = math.ceil(k / per)
    c = torch.zeros(n, words * per, dtype=torch.int64)
    c[:, :k] = codes.to(torch.int64)
    c = c.view(n, words, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (c << shifts).sum(-1)  # disjoint bit fields: the sum is the OR, < 2^32
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)  # two's complement
    return packed.to(torch.int32).contiguous()


def unpack_from_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of pack_to_int32 -> int32 [N, k] in [0, 2^bits - 1]."""
    per = 32 // bits
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    c = (p[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(packed.shape[0], -1)[:, :k].to(torch.int32)


# --- save --------------------------------------------------------------------------------------

def _scale_storage_dtype(layer: QuantLinear) -> torch.dtype:
    if layer.kernel == "int4":
        return layer.scales_and_zeros.dtype
    return layer.scales.dtype


def quantized_tensors(layer: QuantLinear) -> dict[str, torch.Tensor]:
    """One QuantLinear's tensors in the saved layout (see the module docstring), unprefixed."""
    qw = layer.quantized_weight()
    spec = qw.spec
    offset = 1 << (spec.bits - 1)
    unsigned = qw.codes + offset if spec.sym else qw.codes
    n, k = qw.shape
    scale, zero = qw.scale, qw.zero
    if spec.granularity == "tensor":
        scale, zero = scale[:1, 0], None if zero is None else zero[:1, 0]
    out = {"weight_packed": pack_to_int32(unsigned, spec.bits),
           "weight_scale": scale.to(_scale_storage_dtype(layer)).contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if zero is not None:
        out["weight_zero_point"] = (zero - offset).to(torch.int8).contiguous()
    if qw.g_idx is not None:
        out["weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()
    if layer.kernel == "int4" and not spec.sym:
        # The int4 kernel keeps a float zero s * (8 - z) rounded to act_dtype. Rebuilt from the
        # stored (already rounded) scale it can differ in the last bit from the one computed from
        # an unrounded scale; then the kernel's own table is saved too, so loading is exact.
        stored = layer.scales_and_zeros[..., 1].t()  # [N, K / kernel group]
        reps = stored.shape[1] // qw.scale.shape[1]
        rebuilt = qw.scale.repeat_interleave(reps, dim=1) * (8 - qw.zero.repeat_interleave(reps, dim=1)).float()
        if not torch.equal(rebuilt.to(stored.dtype), stored):
            out["weight_zero_float"] = stored.contiguous()
    if layer.bias is not None:
        out["bias"] = layer.bias.detach().contiguous()
    return out


def _weights_entry(spec: QuantSpec, actorder: bool) -> dict:
    return {"num_bits": spec.bits, "type": "int", "symmetric": spec.sym, "strategy": spec.granularity,
            "group_size": spec.group_size if spec.granularity == "group" else None, "dynamic": False,
            "actorder": "group" if actorder else None}


def save_quantized(model, out_dir: str | Path, *, source: str | Path | None = None, tokenizer=None,
                   config=None) -> Path:
    """Write `model` (a CausalLM with QuantLinear layers from kvserve.compress.quant.quantize_model, or a
    kvserve.loading.LoadedModel) to `out_dir` as described in the module docstring.

    source: the folder/file the model came from (tokenizer side files are copied from an HF
    folder). tokenizer: a kvserve Tokenizer or a path to a tokenizer.json (required unless
    `model` is a LoadedModel). config: the ModelConfig (default model.config). -> out_dir.
    """
    model, source, tokenizer = unpack_loaded(model, source, tokenizer, "save_quantized")
    cfg = config if config is not None else model.config
    out = Path(out_dir).expanduser()

    quant: dict[str, QuantLinear] = {}
    ignore: list[str] = []
    emb = model.embed_tokens
    tied_embedding = isinstance(emb, QuantEmbedding) and emb.tied
    if tied_embedding and model.lm_head is not emb.source:
        raise ValueError("save_quantized: the tied quantized embedding does not read the model's LM head")
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            # An untied QuantEmbedding's table is stored as the module "embed_tokens" itself.
            quant["embed_tokens" if name == "embed_tokens.table" else name] = mod
        elif isinstance(mod, nn.Linear):
            ignore.append(hf_name(name))
        elif name and not list(mod.children()) and any(True for _ in mod.buffers(recurse=False)) \
                and is_quantized_module(mod):
            raise ValueError(f"save_quantized: module {name!r} ({type(mod).__name__}) has no saved format; "
                             f"only QuantLinear (weight-only) layers can be saved")
    if not quant:
        raise ValueError("save_quantized: the model has no QuantLinear layers (quantize it first)")

    tensors: dict[str, torch.Tensor] = {}
    groups: dict[tuple, dict] = {}
    for name, layer in quant.items():
        for key, t in quantized_tensors(layer).items():
            tensors[f"{hf_name(name)}.{key}"] = t
        spec = layer.spec
        gkey = (spec, layer.kernel, layer.act_dtype, layer.g_idx is not None if layer.kernel == "dequant" else False)
        if gkey not in groups:
            groups[gkey] = {"targets": [], "weights": _weights_entry(spec, gkey[3]), "input_activations": None,
                            "output_activations": None,
                            "kvserve": {"kernel": layer.kernel, "act_dtype": dtype_name(layer.act_dtype),
                                        "scale_dtype": dtype_name(spec.scale_dtype)}}
        groups[gkey]["targets"].append(hf_name(name))
    prefixes = tuple(f"{n}." for n in quant) + ("embed_tokens.table.",)
    for name, t in model.state_dict().items():
        if name.startswith(prefixes):
            continue
        tensors[hf_name(name)] = t.detach().contiguous()
    if cfg.tie_word_embeddings and "lm_head" not in quant:
        tensors.pop("lm_head.weight", None)

    hf = hf_config_dict(cfg)
    hf["torch_dtype"] = dtype_name(model.norm.weight.dtype)
    hf["quantization_config"] = {
        "quant_method": QUANT_METHOD, "format": FORMAT, "quantization_status": "compressed",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
        "ignore": ignore, "kv_cache_scheme": None, "kvserve_format_version": FORMAT_VERSION}
    if tied_embedding:  # the lookup reads the quantized head's codes: nothing else to store
        hf["quantization_config"]["kvserve_embedding"] = "lm_head"

    try:
        return write_folder(out, cfg, hf, tensors, tokenizer, source, {"kvserve_quant": FORMAT})
    except ValueError as e:
        raise ValueError(f"save_quantized: {e}") from None


# --- load --------------------------------------------------------------------------------------

def read_quantization_config(folder: Path) -> dict | None:
    """config.json's quantization_config (None if absent), validated as ours; ModelLoadError
    naming config.json and the field otherwise."""
    cfg_path = folder / "config.json"
    c = read_json(cfg_path)
    q = c.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelLoadError(cfg_path, "quantization_config must be an object")
    method, fmt = q.get("quant_method"), q.get("format")
    if method != QUANT_METHOD or fmt != FORMAT:
        raise ModelLoadError(cfg_path, f"quantization_config: unsupported quant_method {method!r} / format {fmt!r} "
                                       f"(kvserve loads quant_method {QUANT_METHOD!r} with format {FORMAT!r})")
    version = q.get("kvserve_format_version")
    if version != FORMAT_VERSION:
        raise ModelLoadError(cfg_path, f"quantization_config.kvserve_format_version {version!r} is not "
                                       f"{FORMAT_VERSION} (written by another tool or version)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(cfg_path, "quantization_config.config_groups must be a non-empty object")
    return q


def _group_spec(gname: str, g: dict, cfg_path: Path) -> tuple[QuantSpec, str, torch.dtype, list[str]]:
    where = f"quantization_config.config_groups.{gname}"
    try:
        w, ext, targets = g["weights"], g["kvserve"], g["targets"]
        if w.get("type", "int") != "int" or w.get("dynamic"):
            raise ValueError(f"weights type {w.get('type')!r} dynamic={w.get('dynamic')!r} (only static int)")
        if g.get("input_activations") is not None:
            raise ValueError("input_activations quantization is not supported")
        kernel = ext["kernel"]
        if kernel not in KERNELS:
            raise ValueError(f"kvserve.kernel {kernel!r} not in {KERNELS}")
        act, sdt = ext["act_dtype"], ext.get("scale_dtype", "float32")
        if act not in _DTYPES or sdt not in _DTYPES:
            raise ValueError(f"kvserve.act_dtype {act!r} / scale_dtype {sdt!r} not in {sorted(_DTYPES)}")
        spec = QuantSpec(bits=int(w["num_bits"]), sym=bool(w["symmetric"]), granularity=w["strategy"],
                         group_size=int(w["group_size"]) if w.get("group_size") else 128, scale_dtype=_DTYPES[sdt])
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ValueError("targets must be a list of module names")
    except KeyError as e:
        raise ModelLoadError(cfg_path, f"{where}: missing field {e}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(cfg_path, f"{where}: {e}") from None
    return spec, kernel, _DTYPES[act], targets


class _Tensors:
    """Lazy access to the folder's safetensors files by tensor name, errors naming the file."""

    def __init__(self, folder: Path):
        self.where: dict[str, Path] = {}
        self.handles = {}
        for f in safetensors_files(folder):
            try:
                h = safe_open(str(f), framework="pt")
                keys = list(h.keys())
            except Exception as e:
                raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
            self.handles[f] = h
            for k in keys:
                self.where[k] = f
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, file_hint: Path) -> torch.Tensor:
        if name not in self.where:
            raise ModelLoadError(file_hint, f"tensor {name!r} is missing")
        f = self.where[name]
        try:
            t = self.handles[f].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f, f"cannot read tensor {name!r} ({e})") from None
        self.used.add(name)
        return t


def _load_layer(tensors: _Tensors, name: str, spec: QuantSpec, kernel: str, act_dtype: torch.dtype,
                actorder: bool, file_hint: Path) -> QuantLinear:
    def get(key):
        return tensors.get(f"{name}.{key}", file_hint)

    def bad(key, problem):
        return ModelLoadError(tensors.where.get(f"{name}.{key}", file_hint), f"tensor {name}.{key}: {problem}")

    shape = get("weight_shape")
    if shape.dtype != torch.int64 or shape.shape != (2,):
        raise bad("weight_shape", f"expected int64 [2], got {shape.dtype} {tuple(shape.shape)}")
    n, k = (int(x) for x in shape)
    per = 32 // spec.bits
    packed = get("weight_packed")
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, math.ceil(k / per)):
        raise bad("weight_packed", f"expected int32 {(n, math.ceil(k / per))}, got {packed.dtype} "
                                   f"{tuple(packed.shape)}")
    offset = 1 << (spec.bits - 1)
    unsigned = unpack_from_int32(packed, spec.bits, k)
    codes = unsigned - offset if spec.sym else unsigned
    try:
        g = spec.num_groups(k)
    except ValueError as e:
        raise bad("weight_shape", str(e)) from None
    scale = get("weight_scale")
    want = (1,) if spec.granularity == "tensor" else (n, g)
    if not scale.dtype.is_floating_point or tuple(scale.shape) != want:
        raise bad("weight_scale", f"expected floating {want}, got {scale.dtype} {tuple(scale.shape)}")
    scale = scale.float()
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise bad("weight_scale", "scales must be finite and positive")
    zero = None
    if not spec.sym:
        z = get("weight_zero_point")
        if z.dtype != torch.int8 or tuple(z.shape) != want:
            raise bad("weight_zero_point", f"expected int8 {want}, got {z.dtype} {tuple(z.shape)}")
        zero = z.to(torch.int32) + offset
    if spec.granularity == "tensor":
        scale = scale.reshape(1, 1).expand(n, 1).contiguous()
        zero = None if zero is None else zero.reshape(1, 1).expand(n, 1).contiguous()
    g_idx = None
    if actorder:
        gi = get("weight_g_idx")
        if gi.dtype.is_floating_point or tuple(gi.shape) != (k,) or (gi.numel() and (gi.min() < 0 or gi.max() >= g)):
            raise bad("weight_g_idx", f"expected integer [{k}] in [0, {g})")
        g_idx = gi.to(torch.int64)
    bias = get("bias") if tensors.has(f"{name}.bias") else None
    try:
        layer = QuantLinear.from_quantized(QuantizedWeight(codes, scale, zero, spec, g_idx), bias,
                                           act_dtype=act_dtype, kernel=kernel)
    except ValueError as e:
        raise bad("weight_packed", f"cannot build kernel {kernel} ({e})") from None
    if tensors.has(f"{name}.weight_zero_float"):
        zf = get("weight_zero_float")
        want_zf = tuple(layer.scales_and_zeros.shape[1::-1]) if kernel == "int4" else None
        if want_zf is None or tuple(zf.shape) != want_zf or zf.dtype != layer.scales_and_zeros.dtype:
            raise bad("weight_zero_float", f"expected {layer.scales_and_zeros.dtype} {want_zf} for kernel int4, "
                                           f"got {zf.dtype} {tuple(zf.shape)} (kernel {kernel})")
        with torch.no_grad():
            layer.scales_and_zeros[..., 1] = zf.t()
    return layer


def quantized_parts(folder: Path, cfg, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module]]:
    """The parts of an HF-style folder written by save_quantized (see the module docstring):
    (plain tensors by name, QuantLinear / QuantEmbedding modules by name), for
    kvserve.loading.load_model to build the model from."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    q = read_quantization_config(folder)
    if q is None:
        raise ModelLoadError(cfg_path, "no quantization_config")
    tensors = _Tensors(folder)
    file_hint = next(iter(tensors.handles), folder / WEIGHTS_FILE)
    modules: dict[str, nn.Module] = {}
    for gname, g in q["config_groups"].items():
        if not isinstance(g, dict):
            raise ModelLoadError(cfg_path, f"quantization_config.config_groups.{gname} must be an object")
        spec, kernel, act_dtype, targets = _group_spec(gname, g, cfg_path)
        actorder = g["weights"].get("actorder") is not None
        for target in targets:
            ours = target.removeprefix("model.")
            if ours in modules:
                raise ModelLoadError(cfg_path, f"quantization_config: module {target!r} is in two groups")
            modules[ours] = _load_layer(tensors, target, spec, kernel, act_dtype, actorder, file_hint)
    if "embed_tokens" in modules:  # an untied quantized table: a lookup, not a linear
        modules["embed_tokens"] = QuantEmbedding(modules["embed_tokens"], dtype, tied=False)
    shared = q.get("kvserve_embedding")
    if shared is not None:
        if shared != "lm_head" or "lm_head" not in modules or not cfg.tie_word_embeddings:
            raise ModelLoadError(cfg_path, f"quantization_config.kvserve_embedding {shared!r}: only 'lm_head' of a "
                                           f"tied model whose LM head is quantized is supported")
        modules["embed_tokens"] = QuantEmbedding(modules["lm_head"], dtype, tied=True)
    plain: dict[str, torch.Tensor] = {}
    for key in tensors.where:
        if key in tensors.used:
            continue
        name = key.removeprefix("model.")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        plain[name] = tensors.get(key, file_hint)
    return plain, modules
