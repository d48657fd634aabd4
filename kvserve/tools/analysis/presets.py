"""Hardware and model presets, and model shapes read from an HF config.json or a GGUF file.

Hardware figures are peak dense bf16 FLOP/s and memory bandwidth from the vendors' data sheets
(the lecture's H100 SXM: 989 TFLOP/s, 3.35 TB/s, so an intensity of about 295). Capacities are in
decimal GB as the lecture counts them (an "80 GB" H100 holds 80e9 bytes here).
"""
from __future__ import annotations

import json
from pathlib import Path

from kvserve.loading.cache import entry_dir
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf import open_gguf, read_gguf_config
from kvserve.loading.hf import (
    layer_types_of,  # the engine's reading of sliding-window layouts
)
from kvserve.loading.loader import default_model_path
from kvserve.loading.serialize import config_from_dict
from kvserve.model.config import SLIDING
from kvserve.tools.analysis.roofline import Hardware, ModelShape

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM", flops=989e12, bandwidth=3.35e12, memory=80e9),
    "h200": Hardware("H200", flops=989e12, bandwidth=4.8e12, memory=141e9),
    "a100": Hardware("A100 80GB", flops=312e12, bandwidth=2.0e12, memory=80e9),
}

MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-2-7b", layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32,
               head_dim=128, vocab=32000),
    ModelShape("llama-2-13b", layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40,
               head_dim=128, vocab=32000),
    ModelShape("llama-2-70b", layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8,
               head_dim=128, vocab=32000),
    ModelShape("llama-3-8b", layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
               head_dim=128, vocab=128256),
    ModelShape("gemma-3-270m", layers=18, hidden=640, intermediate=2048, heads=4, kv_heads=1,
               head_dim=256, vocab=262144, tied_embeddings=True, sliding_window=512, sliding_layers=15,
               norms_per_layer=4, qk_norm=True),
    # MLA (d_c = 512, d_rope = 64, 128-wide heads) and MoE (64 routed experts of 1408, 6 per token,
    # 2 shared; layer 0 dense): 15.7B parameters, 2.4B active.
    # Bamba-9B: 32 layers, attention at 9, 18 and 27 (GQA, 8 KV heads), Mamba2 elsewhere (128 heads
    # of 64, one group, d_state 128, conv 4); its recurrent state is flat in the sequence length.
    ModelShape("bamba-9b", layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128,
               vocab=128256, mamba_layers=29, mamba_heads=128, mamba_head_dim=64, mamba_groups=1, mamba_state=128,
               mamba_conv=4),
    ModelShape("deepseek-v2-lite", layers=27, hidden=2048, intermediate=10944, heads=16, kv_heads=16,
               head_dim=128, vocab=102400, kv_latent=512, rope_dim=64, experts=64, experts_per_token=6,
               shared_experts=2, expert_intermediate=1408, dense_layers=1),
)}


def hardware_preset(name: str) -> Hardware:
    key = name.lower().replace(" ", "").removesuffix("-sxm").removesuffix("sxm")
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r} (known: {', '.join(HARDWARE)}; or --measure for this machine)")
    return HARDWARE[key]


def _kv_share(source) -> int:
    """kvserve's cross-layer sharing (`kvserve_kv_source`, runs of N same-type layers written by
    `kvserve convert --share-kv-every N`) as a run length: the most layers sharing one source."""
    if not source:
        return 1
    return max(list(source).count(s) for s in set(source))


def _shared_experts(c: dict) -> int:
    """Shared experts in units of one routed expert: DeepSeek's n_shared_experts, or Qwen2-MoE's
    one shared expert of shared_expert_intermediate_size (4 x 1408 in Qwen1.5-MoE-A2.7B)."""
    if c.get("n_shared_experts"):
        return int(c["n_shared_experts"])
    if c.get("shared_expert_intermediate_size") and c.get("moe_intermediate_size"):
        return round(int(c["shared_expert_intermediate_size"]) / int(c["moe_intermediate_size"]))
    return 0


def _dense_layers(c: dict, layers: int) -> int:
    """Layers with a dense MLP: DeepSeek's first_k_dense_replace; Qwen2-MoE's mlp_only_layers
    and the layers decoder_sparse_step skips."""
    if c.get("first_k_dense_replace"):
        return int(c["first_k_dense_replace"])
    step, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or ())
    return sum(1 for i in range(layers) if i in dense or (i + 1) % step)


def shape_from_hf_config(c: dict, name: str) -> ModelShape:
    """Map an HF config.json (Llama, Mistral, Qwen, Gemma 3, DeepSeek-V2/V3 MLA, Mixtral/Qwen MoE)
    onto a ModelShape. A multimodal config's `text_config` is used when present."""
    c = {**c, **c["text_config"]} if isinstance(c.get("text_config"), dict) else c
    model_type = str(c.get("model_type", ""))
    gemma = model_type.startswith("gemma")
    try:
        layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        kv_latent = c.get("kv_lora_rank")
        head_dim = int(c.get("qk_nope_head_dim") if kv_latent else c.get("head_dim") or hidden // heads)
        n_sliding = layer_types_of(c, model_type, layers).count(SLIDING)
        experts = int(c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0)
        if experts == 1:  # Bamba's num_experts 1: one dense MLP
            experts = 0
        return ModelShape(**_mamba_fields(c, model_type, layers, hidden, heads),
            name=name, layers=layers, hidden=hidden, intermediate=int(c["intermediate_size"]), heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=head_dim, vocab=int(c["vocab_size"]),
            tied_embeddings=bool(c.get("tie_word_embeddings", gemma)),
            kv_latent=int(kv_latent) if kv_latent else None,
            q_latent=int(c["q_lora_rank"]) if kv_latent and c.get("q_lora_rank") else None,
            rope_dim=int(c.get("qk_rope_head_dim") or 0) if kv_latent else 0,
            sliding_window=int(c["sliding_window"]) if n_sliding else None, sliding_layers=n_sliding,
            experts=experts, experts_per_token=int(c.get("num_experts_per_tok") or 0) if experts else 0,
            shared_experts=_shared_experts(c) if experts else 0,
            expert_intermediate=int(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else 0,
            dense_layers=_dense_layers(c, layers) if experts else 0,
            norms_per_layer=4 if gemma else 2, qk_norm=gemma or model_type.startswith("qwen3"),
            kv_share=_kv_share(c.get("kvserve_kv_source")),
        )
    except KeyError as e:
        raise ValueError(f"{name}: config lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: invalid config value ({e})") from None


def _mamba_fields(c: dict, model_type: str, layers: int, hidden: int, heads: int) -> dict:
    """A Bamba config's Mamba2 layers as ModelShape fields ({} for other models): every layer
    but `attn_layer_indices` is a Mamba layer."""
    if model_type != "bamba":
        return {}
    n_heads, expand = int(c.get("mamba_n_heads", 128)), int(c.get("mamba_expand", 2))
    d_head = c.get("mamba_d_head", "auto")
    return dict(mamba_layers=layers - len(c.get("attn_layer_indices") or []), mamba_heads=n_heads,
                mamba_head_dim=expand * hidden // n_heads if d_head in (None, "auto") else int(d_head),
                mamba_groups=int(c.get("mamba_n_groups", 1)), mamba_state=int(c.get("mamba_d_state", 256)),
                mamba_conv=int(c.get("mamba_d_conv", 4)))


def shape_from_model_config(cfg, name: str) -> ModelShape:
    """A kvserve.model.config.ModelConfig (what the loaders produce) as a ModelShape."""
    n_sliding = cfg.layer_types.count(SLIDING)
    return ModelShape(
        name=name, layers=cfg.num_layers, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
        heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size,
        tied_embeddings=cfg.tie_word_embeddings, sliding_window=cfg.sliding_window if n_sliding else None,
        sliding_layers=n_sliding, norms_per_layer=4 if cfg.family == "gemma3" else 2, qk_norm=cfg.qk_norm,
        kv_share=_kv_share(cfg.kv_source), **_moe_shape(cfg.moe, cfg.num_layers),
        mamba_layers=len(cfg.mamba_layers), mamba_heads=cfg.mamba_n_heads, mamba_head_dim=cfg.mamba_head_dim,
        mamba_groups=cfg.mamba_n_groups, mamba_state=cfg.mamba_d_state, mamba_conv=cfg.mamba_d_conv or 4,
    )


def _moe_shape(moe, layers: int) -> dict:
    """ModelShape's MoE fields of a ModelConfig.moe (a Mixtral GGUF, a loaded folder)."""
    if moe is None:
        return {}
    return dict(experts=moe.num_experts, experts_per_token=moe.top_k, expert_intermediate=moe.intermediate_size,
                shared_experts=round(moe.shared_intermediate_size / moe.intermediate_size),
                dense_layers=layers - len(moe.layers))


def _gguf_config(path: Path):
    """The GGUF's ModelConfig: from kvserve's conversion cache when the file was loaded before
    (instant), else parsed from the metadata (seconds: the vocabulary is read too)."""
    cached = entry_dir("gguf", path) / "config.json"
    if cached.is_file():
        try:
            return config_from_dict(json.loads(cached.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a corrupt cache entry: read the file itself
    return read_gguf_config(open_gguf(path), path)


def resolve_model(spec: str | None) -> ModelShape:
    """A preset name, an HF config.json (or its folder), a .gguf file, or None for the bundled
    Gemma 3 270M GGUF."""
    if spec is None:
        path = default_model_path()
        return shape_from_model_config(_gguf_config(path), "gemma-3-270m (bundled GGUF)")
    if spec.lower() in MODELS:
        return MODELS[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(path, "folder has no config.json")
        path = path / "config.json"
    if path.is_file():
        if path.suffix == ".gguf":
            return shape_from_model_config(_gguf_config(path), path.name)
        try:
            c = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(path, f"not valid JSON ({e})") from None
        if not isinstance(c, dict):
            raise ModelLoadError(path, "not a config.json object")
        return shape_from_hf_config(c, str(path))
    if path.exists() or "/" in spec or path.suffix in (".json", ".gguf"):
        raise ModelLoadError(path, "no such file (expected an HF config.json, its folder, or a .gguf)")
    raise ValueError(f"unknown model {spec!r}: not a preset ({', '.join(MODELS)}) nor a file")
