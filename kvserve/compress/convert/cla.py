"""Cross-layer attention (CLA, Brandon et al. 2024): layers reuse an earlier layer's K/V.

`share_kv(loaded, every=N)` groups the layers of each attention type, in order, into runs of N;
the first layer of a run keeps its K/V projections and the pool keeps its K/V, the other N - 1
drop their k_proj / v_proj (and k_norm) and attend over the first one's K/V with their own
queries. Runs are formed per type because a sliding-window layer cannot read a global layer's
cache and a global layer cannot read a sliding one's (the pages of a sliding layer are released);
with Gemma 3's 5:1 pattern the 15 local layers pair as (0, 1), (2, 3), (4, 6), ... and the 3 global
ones as (5, 11), (17) — the KV cache keeps 8 + 2 = 10 of 18 layers. With one attention type the
runs are plain neighbours and the cache shrinks by N (rounded up).

`init` chooses the kept projection: "copy" (the first layer's own, as trained) or "mean" (the
average over the run, so every layer's keys contribute; the kept layer's own attention changes
too). CLA is trained from scratch in the paper; converting a trained model without training
changes its function, and `kvserve distill --student DIR` heals it.
"""
from __future__ import annotations

import dataclasses

import torch

from kvserve.loading.loader import LoadedModel, build_model
from kvserve.model.config import ModelConfig
from kvserve.weights.spec import is_quantized_module

INITS = ("copy", "mean")


def kv_source_every(cfg: ModelConfig, every: int) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it uses: runs of `every` layers of the same type."""
    source = list(range(cfg.num_layers))
    for t in dict.fromkeys(cfg.layer_types):
        layers = [i for i, lt in enumerate(cfg.layer_types) if lt == t]
        for start in range(0, len(layers), every):
            run = layers[start:start + every]
            for i in run:
                source[i] = run[0]
    return tuple(source)


def _check(loaded: LoadedModel, every: int, init: str) -> None:
    cfg = loaded.config
    if isinstance(every, bool) or not isinstance(every, int) or every < 2:
        raise ValueError(f"--share-kv-every must be an integer >= 2, got {every!r}")
    if init not in INITS:
        raise ValueError(f"--kv-share-init must be one of {INITS}, got {init!r}")
    if cfg.mla:
        raise ValueError("--share-kv-every: an MLA model caches one latent per token; cross-layer sharing of "
                         "MLA latents is not supported")
    if cfg.kv_source is not None:
        raise ValueError("--share-kv-every: the model already shares K/V across layers (kvserve_kv_source)")
    for name, mod in loaded.model.named_modules():
        if is_quantized_module(mod):
            raise ValueError(f"--share-kv-every: module {name!r} is quantized; convert the float model, then quantize")


def share_kv(loaded: LoadedModel, every: int, init: str = "copy") -> LoadedModel:
    """A new LoadedModel whose layers share K/V in runs of `every` (module docstring); `loaded` is
    left as it was."""
    _check(loaded, every, init)
    cfg = loaded.config
    source = kv_source_every(cfg, every)
    params = next(loaded.model.parameters())
    state = loaded.model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        parts = name.split(".")
        if len(parts) >= 4 and parts[0] == "layers" and parts[2] == "self_attn" and parts[3] in (
                "k_proj", "v_proj", "k_norm"):
            layer = int(parts[1])
            if source[layer] != layer:
                continue  # a reusing layer has no K/V projections
            if init == "mean":
                run = [i for i, s in enumerate(source) if s == layer]
                t = torch.stack([state[".".join(["layers", str(i), *parts[2:]])].float() for i in run]).mean(0)
                t = t.to(params.dtype)
        sd[name] = t.detach()
    new_cfg = dataclasses.replace(cfg, kv_source=source)
    model = build_model(new_cfg, sd, params.dtype, params.device, loaded.source)
    return LoadedModel(model, new_cfg, loaded.tokenizer, loaded.source)
