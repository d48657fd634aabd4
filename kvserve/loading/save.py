"""Write a model as a self-contained HF-style folder that `load_model` (and HF transformers, for
a dense model) reads back: `config.json`, `generation_config.json`, `tokenizer.json` (+ the
tokenizer side files of an HF source folder, or the chat template written out) and
`model.safetensors` under HF tensor names (`model.layers.0.self_attn.q_proj.weight`, ...).

`save_model` writes a dense model (pruned, distilled, converted: whatever the ModelConfig now
says, e.g. fewer layers or a narrower MLP). The quantized writer (kvserve/loading/quantized.py) shares
the config and side-file helpers. Before the weights are written the config is read back
through `read_hf_config` and must give the same ModelConfig, so a field the HF vocabulary
cannot say fails at save time, not at load time.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.loading.cache import fsync_path, temp_sibling
from kvserve.loading.hf import read_hf_config
from kvserve.loading.serialize import config_to_dict
from kvserve.model.config import FULL, SLIDING
from kvserve.weights.spec import is_quantized_module

WEIGHTS_FILE = "model.safetensors"
_TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_HF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def hf_name(name: str) -> str:
    """Our parameter / module name -> the HF one ("layers.0..." -> "model.layers.0...")."""
    return name if name == "lm_head" or name.startswith("lm_head.") else f"model.{name}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config_dict(cfg) -> dict:
    """A ModelConfig in the HF config.json vocabulary that kvserve/loading/hf.py reads."""
    gemma = cfg.family == "gemma3"
    model_type = "gemma3_text" if gemma else cfg.model_type
    if model_type not in _HF_ARCH:
        raise ValueError(f"cannot write an HF config for model_type {cfg.model_type!r} "
                         f"(supported: {', '.join(_HF_ARCH)})")
    rope = {}
    for t, r in cfg.rope.items():
        entry = dict(r.scaling_dict or {"rope_type": "default"})
        if entry.get("rope_type") == "freq_factors":
            raise ValueError("cannot write an HF config for RoPE frequency factors (a GGUF's rope_freqs tensor): "
                             "transformers has no such rope_type; write the model from its HF checkpoint")
        entry["rope_theta"] = r.theta
        rope[t] = entry
    if not gemma:  # one rotary for every layer: transformers reads the flat form for these families
        rope = rope[FULL] if FULL in rope else next(iter(rope.values()))
    d = {"architectures": [_HF_ARCH[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
         "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
         "max_position_embeddings": cfg.max_position_embeddings, "layer_types": list(cfg.layer_types),
         "rope_parameters": rope, "hidden_act": cfg.hidden_act, "attention_bias": cfg.qkv_bias,
         "mlp_bias": cfg.mlp_bias, "tie_word_embeddings": cfg.tie_word_embeddings,
         "final_logit_softcapping": cfg.final_logit_softcapping, "bos_token_id": cfg.bos_token_id,
         "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id, "torch_dtype": "float32"}
    if SLIDING in cfg.layer_types:
        d["sliding_window"] = cfg.sliding_window
    if cfg.kv_source is not None:  # kvserve's own key: transformers has no cross-layer KV sharing
        d["kvserve_kv_source"] = list(cfg.kv_source)
    if gemma:
        qpas = cfg.attn_scale ** -2
        d["query_pre_attn_scalar"] = round(qpas) if abs(qpas - round(qpas)) < 1e-6 else qpas
        d["hidden_activation"] = cfg.hidden_act
        d["attn_logit_softcapping"] = None
        if SLIDING in cfg.rope:
            d["rope_local_base_freq"] = cfg.rope[SLIDING].theta
    return d


def config_mismatches(a, b) -> list[str]:
    """Fields where two ModelConfigs differ (rope compared as dicts; names and templates skipped)."""
    da, db = config_to_dict(a), config_to_dict(b)
    # add_bos_token lives in tokenizer_config.json (written there), which read_hf_config does not read.
    skip = {"model_type", "chat_template", "add_bos_token"}
    bad = [k for k in da if k not in skip and da[k] != db[k]]
    if a.family == "gemma3" and "attn_scale" in bad and math.isclose(a.attn_scale, b.attn_scale, rel_tol=1e-12):
        bad.remove("attn_scale")
    return bad


def unpack_loaded(model, source, tokenizer, who: str):
    """(model, source, tokenizer) from a kvserve LoadedModel or a bare CausalLM + arguments."""
    if hasattr(model, "model") and hasattr(model, "tokenizer"):  # a LoadedModel
        source = source if source is not None else model.source
        tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        model = model.model
    if tokenizer is None:
        raise ValueError(f"{who}: a tokenizer (kvserve Tokenizer or tokenizer.json path) is needed "
                         f"so the folder is self-contained")
    return model, source, tokenizer


def write_folder(out: Path, cfg, hf: dict, tensors: dict[str, torch.Tensor], tokenizer, source,
                 metadata: dict[str, str] | None = None) -> Path:
    """Write config.json (checked by reading it back), the tokenizer and side files and
    model.safetensors into a private sibling of `out`, flushed, then move them into `out`, the
    config last; weight files of an earlier save that these replace (a sharded index and its
    shards) go first. A failure or a kill while writing leaves `out` as it was."""
    src = Path(source).expanduser() if source is not None else None
    if src is not None and src.is_dir() and out.exists() and src.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the source folder: write into a new folder")
    staging = temp_sibling(out)
    staging.mkdir(parents=True)
    try:
        _write_staged(staging, cfg, hf, tensors, tokenizer, src, metadata)
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_staged(folder: Path, cfg, hf: dict, tensors: dict[str, torch.Tensor], tokenizer, src: Path | None,
                  metadata: dict[str, str] | None) -> None:
    if isinstance(tokenizer, (str, Path)):
        shutil.copyfile(tokenizer, folder / "tokenizer.json")
    else:
        tokenizer.save_json(folder / "tokenizer.json")
    if src is not None and src.is_dir():
        for f in _TOKENIZER_EXTRAS:
            if (src / f).is_file():
                shutil.copyfile(src / f, folder / f)
    if cfg.chat_template and not (folder / "chat_template.jinja").exists():
        (folder / "chat_template.jinja").write_text(cfg.chat_template)
    if not cfg.add_bos_token:
        tc = folder / "tokenizer_config.json"
        doc = json.loads(tc.read_text()) if tc.is_file() else {}
        doc["add_bos_token"] = False
        tc.write_text(json.dumps(doc, indent=1))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
           "pad_token_id": cfg.pad_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=1))
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    back = read_hf_config(folder)
    bad = config_mismatches(cfg, back)
    if bad:
        raise ValueError(f"config fields {bad} do not survive the HF config.json "
                         f"({', '.join(f'{k}: {getattr(cfg, k)!r} -> {getattr(back, k)!r}' for k in bad)})")
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})


def _publish(staging: Path, out: Path) -> None:
    """Move the staged files into `out` (each rename atomic; config.json, which makes a folder a
    model, last), after removing the weight files of an earlier save that would shadow them."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / "model.safetensors.index.json", *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    staged = sorted(staging.iterdir(), key=lambda f: f.name == "config.json")
    for f in staged:
        fsync_path(f)
    for f in staged:
        os.replace(f, out / f.name)
    fsync_path(out)


def save_model(model, out_dir: str | Path, *, source: str | Path | None = None, tokenizer=None,
               config=None, dtype: torch.dtype | None = None) -> Path:
    """Write a dense `model` (a CausalLM or a LoadedModel) to `out_dir` -> out_dir.

    config: the ModelConfig to write (default model.config: a transform that changed the shape
    updates it). dtype: store floating tensors in this dtype (default: as in memory).
    A model holding quantized modules is refused (kvserve.loading.quantized.save_quantized writes those).
    """
    model, source, tokenizer = unpack_loaded(model, source, tokenizer, "save_model")
    cfg = config if config is not None else model.config
    for name, mod in model.named_modules():
        if is_quantized_module(mod):
            raise ValueError(f"save_model: module {name!r} ({type(mod).__name__}) is quantized; "
                             f"save it with kvserve.loading.quantized.save_quantized")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[hf_name(name)] = t.contiguous()
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    _unshare(tensors)
    hf = hf_config_dict(cfg)
    hf["torch_dtype"] = dtype_name(tensors["model.embed_tokens.weight"].dtype)
    return write_folder(Path(out_dir).expanduser(), cfg, hf, tensors, tokenizer, source)


def _unshare(tensors: dict[str, torch.Tensor]) -> None:
    """Copy the tensors that are views of one storage (fused q/k/v rows on CUDA,
    accel/fused_linear.py): safetensors refuses shared memory."""
    storages: dict[int, int] = {}
    for t in tensors.values():
        key = t.untyped_storage().data_ptr()
        storages[key] = storages.get(key, 0) + 1
    for name, t in tensors.items():
        if storages[t.untyped_storage().data_ptr()] > 1:
            tensors[name] = t.clone()
