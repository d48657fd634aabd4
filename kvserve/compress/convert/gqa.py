"""GQA / MQA from a checkpoint with more K/V heads: mean-pool each group of K/V heads (Ainslie et
al. 2023, the initialization their uptraining starts from).

A model with H query heads and G K/V heads (MHA: G = H) becomes one with K K/V heads, K dividing
G: K/V head k of the result is the mean of the original heads k*r .. k*r + r - 1 (r = G / K),
i.e. the rows of k_proj / v_proj (and their biases) averaged per group. Query head i already
reads K/V head i // (H / G); after pooling it reads head i // (H / K), which is the pooled group
that contains its old head, so no query weight moves. K/V per-head norms (Qwen3's k_norm, Gemma's)
act on head_dim and are shared by all heads, so they carry over. The KV cache shrinks by G / K.

Training-free pooling changes the function unless the pooled heads were equal; `kvserve distill`
heals the result (the GQA paper uptrains on 5% of the pre-training compute).
"""
from __future__ import annotations

import dataclasses

from kvserve.loading.loader import LoadedModel, build_model
from kvserve.weights.spec import is_quantized_module


def pool_kv_heads(loaded: LoadedModel, num_kv_heads: int) -> LoadedModel:
    """A new LoadedModel with `num_kv_heads` K/V heads (see the module docstring); `loaded` is left
    as it was."""
    cfg = loaded.config
    g = cfg.num_kv_heads
    if getattr(cfg, "mla", False):
        raise ValueError("--kv-heads: an MLA model caches one latent per token, there are no K/V heads to pool")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"--kv-heads must be a positive integer, got {num_kv_heads!r}")
    if num_kv_heads > g or g % num_kv_heads:
        raise ValueError(f"--kv-heads {num_kv_heads} must divide the model's {g} K/V heads "
                         f"(and be at most {g})")
    for name, mod in loaded.model.named_modules():
        if is_quantized_module(mod):
            raise ValueError(f"--kv-heads: module {name!r} is quantized; convert the float model, then quantize")
    r, d = g // num_kv_heads, cfg.head_dim
    dtype = next(loaded.model.parameters()).dtype
    device = next(loaded.model.parameters()).device
    sd = {}
    for name, t in loaded.model.state_dict().items():
        parts = name.split(".")
        if len(parts) >= 4 and parts[-3] == "self_attn" and parts[-2] in ("k_proj", "v_proj"):
            # weight [G * D, hidden] -> [K, r, D, hidden] -> mean over r; bias [G * D] likewise.
            t = t.detach().float().reshape(num_kv_heads, r, d, *t.shape[1:]).mean(1)
            t = t.reshape(num_kv_heads * d, *t.shape[2:]).to(dtype)
        sd[name] = t.detach()
    new_cfg = dataclasses.replace(cfg, num_kv_heads=num_kv_heads)
    model = build_model(new_cfg, sd, dtype, device, loaded.source)
    return LoadedModel(model, new_cfg, loaded.tokenizer, loaded.source)
