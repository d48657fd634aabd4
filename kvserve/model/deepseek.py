"""DeepSeek-V2/V3: MLA attention (kvserve/model/mla.py) in a pre-norm decoder layer whose MLP is
dense in the first first_k_dense_replace layers and a mixture of experts (kvserve/model/moe.py:
routed plus shared experts) in the others."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata, KVCache
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import RMSNorm
from kvserve.model.mla import MLAttention
from kvserve.model.moe import feed_forward


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.mlp = feed_forward(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = self.input_layernorm.add_and_norm(residual, x)
        h, x = self.post_attention_layernorm.add_and_norm(h, self.self_attn(x, cos_sin, kv_cache, meta))
        return self.mlp(x), h


class DeepseekForCausalLM(CausalLM):
    """The rotary tables are built for cfg.head_dim, which for MLA is qk_rope_head_dim."""

    layer_cls = DeepseekDecoderLayer
