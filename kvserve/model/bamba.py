"""Bamba (IBM): a hybrid of Mamba2 mixer layers and attention layers (a few, placed by
`attn_layer_indices`), each followed by a SwiGLU MLP in a pre-norm block. Attention layers read
and write the paged KV pool like any other model's, rotating the first half of each head
(partial rotary); Mamba layers keep a per-sequence recurrent state in the state pool
(kvserve/model/mamba.py, kvserve/model/state_cache.py)."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import Attention, AttentionMetadata, KVCache
from kvserve.model.base import CausalLM
from kvserve.model.config import MAMBA, ModelConfig
from kvserve.model.layers import GatedMLP, RMSNorm
from kvserve.model.mamba import Mamba2Mixer


class BambaDecoderLayer(nn.Module):
    """HF's names: `mamba` or `self_attn`, `feed_forward`, `input_layernorm`, `pre_ff_layernorm`."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.is_mamba = cfg.layer_types[layer] == MAMBA
        if self.is_mamba:
            self.mamba = Mamba2Mixer(cfg, layer)
        else:
            self.self_attn = Attention(cfg, layer, gemma_norm=False)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = self.input_layernorm.add_and_norm(residual, x)
        if self.is_mamba:
            if meta is None or meta.recurrent is None:
                raise ValueError("a Mamba layer needs the step's recurrent metadata (the engine's state pool)")
            a = self.mamba(x, meta.recurrent)
        else:
            a = self.self_attn(x, cos_sin, kv_cache, meta)
        h, x = self.pre_ff_layernorm.add_and_norm(h, a)
        return self.feed_forward(x), h


class BambaForCausalLM(CausalLM):
    layer_cls = BambaDecoderLayer
