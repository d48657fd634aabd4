"""The decoder-only causal LM skeleton shared by every family.

A family supplies its decoder layer class and a few switches (embedding scale, norm style);
the forward pass over a flat batch of tokens is the same for all.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata, KeptRows, KVCache
from kvserve.model.config import ModelConfig
from kvserve.model.layers import PackedMatmul, RMSNorm, RotaryEmbedding


def residual_sum(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The hidden state a (x, residual) pair between decoder layers stands for."""
    return x if residual is None else residual + x


def run_layer(layer: nn.Module, h: torch.Tensor, cos_sin, kv_cache: KVCache | None,
              meta: AttentionMetadata | None) -> torch.Tensor:
    """A decoder layer as a map of hidden states h [T, hidden] -> [T, hidden] (layer-by-layer
    calibration runs blocks this way)."""
    return residual_sum(*layer(h, None, cos_sin, kv_cache, meta))


class CausalLM(nn.Module):
    layer_cls: type[nn.Module]
    gemma_norm: bool = False  # RMSNorm weights stored as (w - 1), applied as (1 + w)
    scale_embedding: bool = False  # multiply embeddings by sqrt(hidden_size)
    head_panels: PackedMatmul | None = None  # a tied head packed for decode steps (kvserve/accel/panels.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=self.gemma_norm)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # One rotary table per layer type (Gemma 3: 10k base for local layers, 1M for global).
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(r, cfg.rotary_dim) for t, r in cfg.rope.items()})
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]; the embedding matrix itself when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.scale_embedding:
            # HF rounds sqrt(hidden) to the weight dtype first; so do we, for identical numbers.
            h = h * torch.tensor(math.sqrt(self.config.hidden_size)).to(h.dtype)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        num_layers: int | None = None,
        keep: KeptRows | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed), or with `keep`
        those of the kept rows, [N, hidden].

        `num_layers` < all: early exit (the final norm applies to that layer's output).
        `keep`: the last layer run writes K/V for every row and computes the rest for the kept
        rows only (a layer class with `takes_kept_rows`; others run whole and the rows are picked
        after).

        The residual stream travels between layers as a pair: a layer takes (x, residual), its
        input being residual + x (residual None: x alone), and returns the next pair, so each
        residual add happens inside the norm that follows it (vLLM's scheme: one kernel on CUDA
        instead of two)."""
        h = self.embed(input_ids)
        cos_sin = self.rope_tables(positions, h.dtype)
        layers = self.layers[:num_layers]
        residual = None
        for i, layer in enumerate(layers):
            cs = cos_sin.get(self.config.layer_types[i])  # None for a Mamba layer (no rotary)
            if keep is not None and i == len(layers) - 1 and getattr(layer, "takes_kept_rows", False):
                h, residual = layer(h, residual, cs, kv_cache, meta, keep=keep)
                if h.shape[0] == 0:
                    return h
                keep = None  # done
            else:
                h, residual = layer(h, residual, cs, kv_cache, meta)
        if keep is not None:
            h = h.index_select(0, keep.rows)
            residual = None if residual is None else residual.index_select(0, keep.rows)
        return h if h.shape[0] == 0 else self.norm.add_and_norm(residual, h)[1]

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) at `positions` for each layer type's rotary table."""
        return {t: rot.cos_sin(positions, dtype) for t, rot in self.rotary.items()}

    def step_graph(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What torch.compile traces (kvserve/accel/compiled.py): input_ids, positions [T] -> final
        hidden states [T, hidden] (normed), every layer's attention an opaque op reading the step
        context."""
        h = self.embed(input_ids)
        cos_sin = self.rope_tables(positions, h.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos_sin.get(self.config.layer_types[i]), None, None)
        return self.norm.add_and_norm(residual, h)[1]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab], fp32 unless upcast=False (then the model's
        dtype: a greedy-only bf16 batch picks its tokens without the ~20 ms fp32 copy of
        [64, 262144] logits; the sampler upcasts when it needs to)."""
        # A module head (untied, or a quantized head: kvserve/weights/linear.py) is called; a tied one
        # multiplies by the embedding table.
        head = self.lm_head
        if head is None:
            logits = head_matmul(hidden, self.embed_tokens.weight, panels=self.head_panels)
        elif type(head) is nn.Linear:
            logits = head_matmul(hidden, head.weight, head.bias)
        else:
            logits = head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            return torch.tanh(logits.float() / cap) * cap
        return logits.float() if upcast else logits


# MKL's fp32 GEMM takes a slow path for a handful of rows against a tall LM head: measured on a
# 2-core Xeon (262144 x 640 head), 8 rows cost 121 ms and 14 rows 179 ms, 16 rows 54 ms.
# Padding 5..15 rows to 16 keeps small decode batches (the tail of an offline run) on the fast one.
HEAD_PAD_ROWS = 16


def head_matmul(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                panels: PackedMatmul | None = None) -> torch.Tensor:
    """hidden [N, d] @ weight [vocab, d]^T (+ bias) -> [N, vocab]: the packed copy's kernel for a
    decode step when there is one, else MKL, padding 5..15 rows to 16 on CPU fp32."""
    if panels is not None:
        logits = panels.matmul(hidden, bias)
        if logits is not None:
            return logits
    n = hidden.shape[0]
    if 4 < n < HEAD_PAD_ROWS and hidden.device.type == "cpu" and hidden.dtype == torch.float32:
        padded = hidden.new_zeros(HEAD_PAD_ROWS, hidden.shape[1])
        padded[:n] = hidden
        return torch.nn.functional.linear(padded, weight, bias)[:n]
    return torch.nn.functional.linear(hidden, weight, bias)


def stored_weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct stored tensor: parameters and persistent buffers (packed codes,
    scales of quantized layers), a tied LM head once, and views of one storage (fused q/k/v rows,
    accel/fused_linear.py) by the bytes they cover together; non-persistent buffers (rotary
    tables) are not weights."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in model.state_dict(keep_vars=True).values():
        if t.numel():
            start = t.data_ptr()
            spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, start + t.numel() * t.element_size()))
    total = 0
    for ranges in spans.values():  # the union of each storage's byte ranges
        end = None
        for a, b in sorted(ranges):
            if end is None or a >= end:
                total += b - a
                end = b
            elif b > end:
                total += b - end
                end = b
    return total
