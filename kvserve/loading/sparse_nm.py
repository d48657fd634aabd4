"""Folders of N:M-compressed models (kvserve/weights/sparse_nm.py's SparseNMLinear).

`save_compressed(model, out_dir, pattern)` writes an HF-style folder (the same
config.json / tokenizer files as `save_model`) where each N:M linear `P` is stored as
`P.weight_values`, `P.weight_indices` (uint8) and `P.weight_shape` (int64 [2]) and listed in
config.json's

    "sparsity_config": {"format": "kvserve-sparse-nm", "sparsity_structure": "2:4",
                        "index_bits": 2, "targets": ["model.layers.0.mlp.down_proj", ...],
                        "kvserve_format_version": 1}

(compressed-tensors calls its 2:4 layout "sparse-24-bitmask"; ours is a different layout, so
it has its own name). `load_model(DIR)` sees the `sparsity_config` and builds SparseNMLinear
modules for the targets (`sparse_parts`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.loading.errors import ModelLoadError
from kvserve.loading.hf import read_json, safetensors_files
from kvserve.loading.save import hf_config_dict, hf_name, unpack_loaded, write_folder
from kvserve.weights.sparse_nm import (
    FORMAT,
    FORMAT_VERSION,
    SparseNMLinear,
    index_bits,
    nm_linear_names,
    parse_pattern,
)


def save_compressed(model, out_dir: str | Path, pattern: tuple[int, int] | str, *, source=None,
                    tokenizer=None, config=None) -> Path:
    """Write a (LoadedModel or CausalLM) model whose block linears are N:M sparse (dense nn.Linear
    with zeros, or SparseNMLinear) as an N:M-compressed folder (module docstring) -> out_dir.
    Linears that are not N:M sparse are stored dense. ValueError if none is."""
    model, source, tokenizer = unpack_loaded(model, source, tokenizer, "save_compressed")
    n, m = parse_pattern(pattern)
    cfg = config if config is not None else model.config
    targets: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    compressed: dict[str, SparseNMLinear] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, SparseNMLinear):
            if (mod.n, mod.m) != (n, m):
                raise ValueError(f"save_compressed: {name} is {mod.n}:{mod.m}, the folder is {n}:{m}")
            compressed[name] = mod
    for name in nm_linear_names(model, (n, m)):
        compressed[name] = SparseNMLinear.from_linear(model.get_submodule(name), (n, m))
    if not compressed:
        raise ValueError(f"save_compressed: no block linear of the model is {n}:{m} sparse (prune it first)")
    skip = set()
    for name, mod in compressed.items():
        skip.update({f"{name}.{k}" for k in ("weight", "bias", "weight_values", "weight_indices")})
        targets.append(hf_name(name))
        tensors[hf_name(name) + ".weight_values"] = mod.weight_values.detach().contiguous()
        tensors[hf_name(name) + ".weight_indices"] = mod.weight_indices.contiguous()
        tensors[hf_name(name) + ".weight_shape"] = torch.tensor([mod.out_features, mod.in_features])
        if mod.bias is not None:
            tensors[hf_name(name) + ".bias"] = mod.bias.detach().contiguous()
    for key, t in model.state_dict().items():
        if key not in skip:
            tensors[hf_name(key)] = t.detach().contiguous()
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    hf = hf_config_dict(cfg)
    hf["sparsity_config"] = {"format": FORMAT, "sparsity_structure": f"{n}:{m}", "index_bits": index_bits(m),
                             "targets": sorted(targets), "kvserve_format_version": FORMAT_VERSION}
    return write_folder(Path(out_dir).expanduser(), cfg, hf, tensors, tokenizer, source, {"kvserve_sparse": FORMAT})


def read_sparsity_config(folder: Path) -> dict | None:
    """config.json's sparsity_config (None if absent), validated; ModelLoadError otherwise."""
    cfg_path = Path(folder) / "config.json"
    c = read_json(cfg_path)
    s = c.get("sparsity_config")
    if s is None:
        return None
    if not isinstance(s, dict) or s.get("format") != FORMAT:
        raise ModelLoadError(cfg_path, f"sparsity_config: unsupported format "
                                       f"{s.get('format') if isinstance(s, dict) else s!r} (kvserve loads {FORMAT!r})")
    if s.get("kvserve_format_version") != FORMAT_VERSION:
        raise ModelLoadError(cfg_path, f"sparsity_config.kvserve_format_version {s.get('kvserve_format_version')!r} "
                                       f"is not {FORMAT_VERSION}")
    try:
        parse_pattern(s.get("sparsity_structure"))
    except ValueError as e:
        raise ModelLoadError(cfg_path, f"sparsity_config.sparsity_structure: {e}") from None
    targets = s.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ModelLoadError(cfg_path, "sparsity_config.targets must be a list of module names")
    return s


def sparse_parts(folder: Path, cfg, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module]]:
    """The parts of a folder written by save_compressed: (plain tensors by name, SparseNMLinear
    modules by name), for kvserve.loading.load_model to build the model from."""
    folder = Path(folder)
    s = read_sparsity_config(folder)
    n, m = parse_pattern(s["sparsity_structure"])
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            with safe_open(str(f), framework="pt") as h:
                tensors.update({k: h.get_tensor(k) for k in h.keys()})
        except Exception as e:
            raise ModelLoadError(f, f"not a readable safetensors file ({e})") from None
    modules: dict[str, nn.Module] = {}
    for target in s["targets"]:
        keys = [f"{target}.weight_{x}" for x in ("values", "indices", "shape")]
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ModelLoadError(folder, f"sparsity_config target {target!r}: tensors {missing} are missing")
        values, indices, shape = (tensors.pop(k) for k in keys)
        bias = tensors.pop(f"{target}.bias", None)
        try:
            mod = SparseNMLinear(int(shape[1]), int(shape[0]), n, m, values.to(dtype), indices,
                                 None if bias is None else bias.to(dtype))
        except ValueError as e:
            raise ModelLoadError(folder, f"{target}: {e}") from None
        modules[target.removeprefix("model.")] = mod
    plain = {k.removeprefix("model."): v for k, v in tensors.items()
             if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    return plain, modules
