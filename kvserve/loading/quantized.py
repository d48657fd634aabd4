"""Save a quantized model as a self-contained HF-style folder in the compressed-tensors layout,
and load any folder in that layout (llm-compressor, GPTQModel, vLLM checkpoints, ours).

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
* `model.safetensors`: every tensor under HF names. Floating tensors (embedding, norms,
  unquantized linears) as they are in memory; each quantized module exactly as
  compressed-tensors 0.20's "pack-quantized" compressor stores it (kvserve/loading/ct_format.py:
  weight_packed, weight_scale, weight_zero_point packed along the outputs, weight_shape), and
  its bias. The scale is stored in the dtype the layer's kernel keeps it in (bfloat16 for the
  int4 / int8 kernels with bf16 activations, float32 otherwise), so it is exact.

`quantization_config` is what compressed-tensors' ModelCompressor writes (no other keys):

    {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": null,
                                   "output_activations": null, "targets": ["Linear"],
                                   "weights": {"dynamic": false, "group_size": 128, "num_bits": 4,
                                               "strategy": "group", "symmetric": false, "type": "int"}}},
     "format": "pack-quantized", "global_compression_ratio": null, "ignore": ["lm_head"],
     "kv_cache_scheme": null, "moe_sparsity_config": null, "quant_method": "compressed-tensors",
     "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
     "version": "0.20.1"}

One group per distinct grid. The largest group targets the classes "Linear" (and "Embedding"
when the token table is quantized), the others list their module names and come first (the
first matching target wins); every floating linear is in `ignore`. A quantized tied table
(QuantEmbedding sharing the LM head's codes) is stored under both `lm_head` and
`model.embed_tokens`, as the layout has no sharing; loading finds the two equal and shares them.

Nothing kvserve-specific is stored, so the loader chooses the kernel from the layout alone:
`choose_kernel` on the grid and shape, activations in bfloat16 when the scales are bfloat16
(the kernels' table keeps them exactly), float32 otherwise. A model quantized with the default
kernel choice therefore computes the same numbers after a save and load. Two things do not
survive: a kernel forced by `quantize_model(kernel=...)` (the layer comes back on the automatic
one: same weights, that kernel's activation rounding), and an int4 asymmetric layer whose float
zero table s (8 - z) was rounded from a scale that was not itself rounded to the kernel's dtype
(quantize_model always rounds it first): the table is rebuilt from the stored scale, within
a relative 2^-7 of each zero-table entry (three half-ulp roundings in bfloat16).
One deviation from compressed-tensors 0.20: a GPTQ act-order layer with a g_idx (column groups
not contiguous; `act_order` without `static_groups`) is written as compressed-tensors <= 0.1x did
(`"actorder": "group"` and a `weight_g_idx` int32 [K] tensor, which vLLM reads); 0.20 refuses
that config ("actorder='group' has been removed"). Static-group act-order needs no g_idx.

Loading (`quantized_parts`, called by kvserve.loading.load_model when config.json has a
`quantization_config`): the config is parsed (kvserve/loading/ct_format.py: formats
pack-quantized, int-quantized and naive-quantized, int 2..8 bits, symmetric or not, strategies
tensor / channel / group, targets as class names, "re:" regexes or module names, `ignore`;
activation quantization, float types, sparsity, transforms and KV-cache schemes are refused
naming the field); the model is built on the meta device and each matched linear is replaced by
a QuantLinear built from its codes (`QuantLinear.from_quantized`); the remaining tensors are
adopted as in an HF folder. Weights are never dequantized to float. A missing or corrupt tensor
raises ModelLoadError naming the file and the tensor.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvserve.loading import ct_format as ct
from kvserve.loading.ct_format import pack_to_int32, unpack_from_int32  # noqa: F401  (the layout's packing)
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
from kvserve.loading.tensors import TensorFiles
from kvserve.model.registry import empty_model
from kvserve.weights.embedding import QuantEmbedding
from kvserve.weights.linear import QuantLinear
from kvserve.weights.spec import is_quantized_module


# --- save --------------------------------------------------------------------------------------

def _scale_storage_dtype(layer: QuantLinear) -> torch.dtype:
    """The dtype the layer's kernel keeps its scales in (so storing in it is exact)."""
    if layer.kernel == "int4":
        return layer.scales_and_zeros.dtype
    return layer.scales.dtype


def quantized_tensors(layer: QuantLinear) -> dict[str, torch.Tensor]:
    """One QuantLinear's tensors in the saved layout (see the module docstring), unprefixed."""
    out = ct.layer_tensors(layer.quantized_weight(), _scale_storage_dtype(layer))
    if layer.bias is not None:
        out["bias"] = layer.bias.detach().contiguous()
    return out


def _quantized_modules(model) -> tuple[dict[str, QuantLinear], list[str], bool]:
    """(HF name -> QuantLinear, HF names of the floating linears, whether the embedding lookup
    shares the LM head's codes)."""
    quant: dict[str, QuantLinear] = {}
    ignore: list[str] = []
    emb = model.embed_tokens
    tied_embedding = isinstance(emb, QuantEmbedding) and emb.tied
    if tied_embedding and model.lm_head is not emb.source:
        raise ValueError("save_quantized: the tied quantized embedding does not read the model's LM head")
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            # An untied QuantEmbedding's table is stored as the module "embed_tokens" itself.
            quant[hf_name("embed_tokens" if name == "embed_tokens.table" else name)] = mod
        elif isinstance(mod, nn.Linear):
            ignore.append(hf_name(name))
        elif name and not list(mod.children()) and any(True for _ in mod.buffers(recurse=False)) \
                and is_quantized_module(mod):
            raise ValueError(f"save_quantized: module {name!r} ({type(mod).__name__}) has no saved format; "
                             f"only QuantLinear (weight-only) layers can be saved")
    if not quant:
        raise ValueError("save_quantized: the model has no QuantLinear layers (quantize it first)")
    if tied_embedding:  # the layout has no sharing: the table is stored as its own module too
        quant["model.embed_tokens"] = model.lm_head
    if model.lm_head is None:  # tied and not quantized: HF's lm_head is still a Linear to skip
        ignore.append("lm_head")
    return quant, ignore, tied_embedding


def _config_groups(quant: dict[str, QuantLinear]) -> dict[str, dict]:
    """One group per distinct grid (plus g_idx): the largest targets the classes, placed last so
    the groups naming their modules take precedence (compressed-tensors: first match wins)."""
    by_grid: dict[tuple, list[str]] = {}
    for name, layer in quant.items():
        spec = layer.spec
        key = (spec.bits, spec.sym, spec.granularity, spec.group_size if spec.granularity == "group" else None,
               layer.g_idx is not None if layer.kernel == "dequant" else False)
        by_grid.setdefault(key, []).append(name)
    order = sorted(by_grid, key=lambda k: len(by_grid[k]))  # stable: ties keep model order
    groups = {}
    for i, key in enumerate(order):
        names = by_grid[key]
        if i == len(order) - 1:
            names = ["Linear"] + (["Embedding"] if "model.embed_tokens" in names else [])
        spec = quant[by_grid[key][0]].spec
        groups[f"group_{i}"] = {"format": ct.PACKED, "input_activations": None, "output_activations": None,
                                "targets": names, "weights": ct.weights_entry(spec, key[4])}
    return groups


def quantization_config(quant: dict[str, QuantLinear], ignore: list[str]) -> dict:
    """The config.json entry compressed-tensors' ModelCompressor.update_config writes."""
    return {"config_groups": _config_groups(quant), "format": ct.PACKED, "global_compression_ratio": None,
            "ignore": ignore, "kv_cache_scheme": None, "moe_sparsity_config": None,
            "quant_method": ct.QUANT_METHOD, "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": ct.LAYOUT_VERSION}


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
    quant, ignore, tied_embedding = _quantized_modules(model)

    tensors: dict[str, torch.Tensor] = {}
    for name, layer in quant.items():
        for key, t in quantized_tensors(layer).items():
            tensors[f"{name}.{key}"] = t if name != "model.embed_tokens" or not tied_embedding else t.clone()
    own = tuple(f"{n.removeprefix('model.')}." for n in quant) + ("embed_tokens.table.",)
    for name, t in model.state_dict().items():
        if not name.startswith(own):
            tensors[hf_name(name)] = t.detach().contiguous()
    if cfg.tie_word_embeddings and "lm_head" not in quant:
        tensors.pop("lm_head.weight", None)

    hf = hf_config_dict(cfg)
    hf["torch_dtype"] = dtype_name(model.norm.weight.dtype)
    hf["quantization_config"] = quantization_config(quant, ignore)
    try:
        return write_folder(out, cfg, hf, tensors, tokenizer, source)
    except ValueError as e:
        raise ValueError(f"save_quantized: {e}") from None


# --- load --------------------------------------------------------------------------------------

def read_quantization_config(folder: Path) -> dict | None:
    """config.json's quantization_config, or None if absent (validated by quantized_parts)."""
    cfg_path = folder / "config.json"
    q = read_json(cfg_path).get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise ModelLoadError(cfg_path, "quantization_config must be an object")
    return q


class _Tensors:
    """The folder's tensors by stored name (a TensorFiles, kvserve/loading/tensors.py), remembering
    which were read; a missing one is an error naming the file it was looked for in."""

    def __init__(self, folder: Path):
        self.files = TensorFiles(safetensors_files(folder))
        self.where = set(self.files.names())
        self.used: set[str] = set()
        self.hint = next(iter(safetensors_files(folder)), folder / WEIGHTS_FILE)

    def has(self, name: str) -> bool:
        return name in self.where

    def file(self, name: str) -> Path:
        return self.files.file(name) if name in self.where else self.hint

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ModelLoadError(self.hint, f"tensor {name!r} is missing")
        self.used.add(name)
        return self.files.get(name)


def _candidates(cfg) -> list[tuple[str, str]]:
    """(HF module name, class name) of the model's linears and embedding, in model order: what
    the config's targets can match."""
    model = empty_model(cfg)
    out = [(hf_name(n), type(m).__name__) for n, m in model.named_modules()
           if type(m) in (nn.Linear, nn.Embedding)]
    if model.lm_head is None:  # tied: HF still has an lm_head Linear
        out.append(("lm_head", "Linear"))
    return out


def _act_dtype(scale_dtype: torch.dtype) -> torch.dtype:
    """bfloat16 scales: the kernels' bf16 path (the table keeps them exactly); anything else
    (float32, float16) is exact in float32."""
    return torch.bfloat16 if scale_dtype == torch.bfloat16 else torch.float32


def _load_layer(tensors: _Tensors, name: str, scheme: ct.Scheme) -> QuantLinear:
    qw, scale_dtype = ct.read_layer(lambda key: tensors.get(f"{name}.{key}"),
                                    lambda key: tensors.file(f"{name}.{key}"), name, scheme)
    bias = tensors.get(f"{name}.bias") if tensors.has(f"{name}.bias") else None
    if bias is not None and (not bias.dtype.is_floating_point or tuple(bias.shape) != (qw.shape[0],)):
        raise ModelLoadError(tensors.file(f"{name}.bias"), f"tensor {name}.bias: expected floating "
                                                           f"[{qw.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    try:
        return QuantLinear.from_quantized(qw, bias, act_dtype=_act_dtype(scale_dtype))
    except ValueError as e:
        raise ModelLoadError(tensors.file(f"{name}.weight_scale"), f"module {name}: {e}") from None


def _same_layer(a: QuantLinear, b: QuantLinear) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return a.spec == b.spec and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _embedding(modules: dict[str, nn.Module], cfg, dtype: torch.dtype) -> None:
    """A quantized table becomes a lookup: shared with the quantized LM head when the model is
    tied and the two hold the same codes (save_quantized stores a tied table twice), else its own."""
    table = modules.get("embed_tokens")
    if table is None:
        return
    head = modules.get("lm_head")
    if cfg.tie_word_embeddings and head is None:  # the head is the table: quantized once
        modules["lm_head"] = head = table
    tied = cfg.tie_word_embeddings and _same_layer(table, head)
    modules["embed_tokens"] = QuantEmbedding(head if tied else table, dtype, tied=tied)


def quantized_parts(folder: Path, cfg, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module]]:
    """The parts of an HF-style folder in the compressed-tensors layout (see the module docstring):
    (plain tensors by our name, QuantLinear / QuantEmbedding modules by our name), for
    kvserve.loading.load_model to build the model from."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    q = read_quantization_config(folder)
    if q is None:
        raise ModelLoadError(cfg_path, "no quantization_config")
    schemes, ignore = ct.read_config(q, cfg_path)
    tensors = _Tensors(folder)
    assigned = ct.assign_schemes(_candidates(cfg), schemes, ignore, cfg_path)
    if not assigned:
        raise ModelLoadError(cfg_path, "quantization_config: no module of the model matches the targets of "
                                       "config_groups (outside ignore)")
    modules: dict[str, nn.Module] = {}
    for name, scheme in assigned.items():
        if name == "lm_head" and cfg.tie_word_embeddings and not any(k.startswith("lm_head.") for k in tensors.where):
            continue  # a tied head stored only as its table (model.embed_tokens)
        modules[name.removeprefix("model.")] = _load_layer(tensors, name, scheme)
    _embedding(modules, cfg, dtype)
    plain: dict[str, torch.Tensor] = {}
    for key in tensors.where:
        if key in tensors.used:
            continue
        name = key.removeprefix("model.")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        plain[name] = tensors.get(key)
    return plain, modules
