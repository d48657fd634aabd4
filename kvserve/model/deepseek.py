"""DeepSeek-V2/V3 with dense MLPs: MLA attention (kvserve/model/mla.py) in a pre-norm decoder
layer. MoE layers are not implemented (the loader refuses checkpoints that have them)."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata, KVCache
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import GatedMLP, RMSNorm
from kvserve.model.mla import MLAttention


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos_sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos_sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekForCausalLM(CausalLM):
    """The rotary tables are built for cfg.head_dim, which for MLA is qk_rope_head_dim."""

    layer_cls = DeepseekDecoderLayer
