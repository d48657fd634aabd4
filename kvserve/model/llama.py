"""The Llama family: Llama 2/3 (GQA, SwiGLU, llama3 RoPE scaling), Mistral, Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm), and the mixture-of-experts Mixtral and Qwen2-MoE (the MLP of their sparse
layers is kvserve/model/moe.py's block). One pre-norm decoder layer covers them all."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.model.attention import Attention, AttentionMetadata, KeptRows, KVCache
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import RMSNorm
from kvserve.model.moe import feed_forward


class LlamaDecoderLayer(nn.Module):
    takes_kept_rows = True  # forward(..., keep=KeptRows): see CausalLM.forward

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer, gemma_norm=False)
        self.mlp = feed_forward(cfg, layer, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, kv_cache: KVCache,
                meta: AttentionMetadata, keep: KeptRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # The layer's input is residual + x; the add is left to the next norm (one kernel on CUDA).
        residual, x = self.input_layernorm.add_and_norm(residual, x)
        a, residual = self.self_attn.with_residual(x, residual, cos_sin, kv_cache, meta, keep)
        if a.shape[0] == 0:  # no kept rows: the K/V write was all
            return a, a
        residual, x = self.post_attention_layernorm.add_and_norm(residual, a)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
