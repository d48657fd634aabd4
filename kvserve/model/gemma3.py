"""Gemma 3 (text): MQA/GQA with q/k RMSNorm, sandwich norms, GELU-tanh MLP, 5:1 local/global."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import Attention, AttentionMetadata, KeptRows, KVCache
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import GatedMLP, RMSNorm


class Gemma3DecoderLayer(nn.Module):
    takes_kept_rows = True  # forward(..., keep=KeptRows): see CausalLM.forward

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer, gemma_norm=True)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, kv_cache: KVCache,
                meta: AttentionMetadata, keep: KeptRows | None = None) -> tuple[torch.Tensor, None]:
        h, x = self.input_layernorm.add_and_norm(residual, x)
        a, h = self.self_attn.with_residual(x, h, cos_sin, kv_cache, meta, keep)
        if a.shape[0] == 0:  # no kept rows: the K/V write was all
            return a, None
        # h + norm(a), and the pre-feedforward norm of that, in one kernel call
        h, x = self.post_attention_layernorm.add_to(h, a, then=self.pre_feedforward_layernorm)
        m = self.mlp(x)
        # The sandwich norm's add closes the layer's residual stream itself (one kernel).
        return self.post_feedforward_layernorm.add_to(h, m), None


class Gemma3ForCausalLM(CausalLM):
    layer_cls = Gemma3DecoderLayer
    gemma_norm = True
    scale_embedding = True
