"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3) over the paged KV pool.

Per token and layer the pool holds ONE vector [c_kv | k_pe] of d_c + d_rope values (K of a
KVCache with one head and a V of width 0): the latent c_kv = RMSNorm(W_DKV x) and the rotated
RoPE key k_pe shared by every head. Per head h, with kv_b_proj = [W_UK_h; W_UV_h] (rows):

    k_h = [W_UK_h c_kv | k_pe],  v_h = W_UV_h c_kv,  q_h = [q_nope_h | q_pe_h]

Two exactly equivalent ways to attend (they differ only in rounding):

* materialized (prefill chunks, `meta.seqs`): up-project the cached latents to per-head
  k_nope, v and run causal attention like any multi-head layer;
* absorbed (decode, `meta.decode`): fold W_UK_h into the query, q_lat_h = q_nope_h W_UK_h
  [d_c], so score_h = q_lat_h . c_kv + q_pe_h . k_pe is attention of H query rows against
  the cached vectors themselves (MQA with one d_c + d_rope "head"), and fold W_UV_h into the
  output: out_h = (softmax . c_kv) W_UV_h^T. No per-head K/V is ever built.

The C paged-decode kernel (kvserve/kernels) assumes K and V of equal width, so MLA decode uses
torch's SDPA over gathered slots (DecodeBatch.groups); KV int8/fp8 storage and StreamingLLM are
not supported (the engine refuses them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention import CAUSAL, AttentionMetadata, DecodeBatch, KVCache
from kvserve.model.config import ModelConfig
from kvserve.model.layers import RMSNorm, apply_rope

LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


class MLAttention(nn.Module):
    """MLA with HF DeepSeek-V2/V3 parameter names (q_proj or q_a_proj/q_a_layernorm/q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    # Linears whose weight matrix the layer reads itself (the absorbed decode splits kv_b_proj
    # into W_UK and W_UV): weight quantizers leave them in float.
    weight_read = ("kv_b_proj",)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        if not cfg.mla:
            raise ValueError("MLAttention needs kv_lora_rank in the model config")
        self.layer = layer
        self.window = cfg.window(layer)
        self.num_heads = h = cfg.num_heads
        self.d_c, self.d_rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.d_nope, self.d_v = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.scale = cfg.attn_scale
        self.interleave = cfg.rope_interleave
        self.absorb = True  # decode in the absorbed form (False: materialized, for tests)
        qk = self.d_nope + self.d_rope
        hidden = cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.d_c + self.d_rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.d_c, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.d_c, h * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(h * self.d_v, hidden, bias=cfg.o_bias)

    # ------------------------------------------------------------ projections
    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> q [T, H, d_nope + d_rope] (before RoPE)."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.d_nope + self.d_rope)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d_rope] rotated. DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... are
        first gathered to halves [x0, x2, ... | x1, x3, ...]: the same rotation in the half
        layout (queries and keys are permuted alike, so scores are unchanged)."""
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, d_nope, d_c] and W_UV [H, d_v, d_c], views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.d_nope + self.d_v))
        return w[:, : self.d_nope], w[:, self.d_nope :]

    # ------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Writes [c_kv | k_pe] of every token at meta.slot_mapping."""
        if meta.custom is not None:
            raise ValueError("MLA attention does not support a custom attention hook (e.g. StreamingLLM)")
        T = x.shape[0]
        q = self._query(x)
        cos, sin = cos_sin
        q_nope, q_pe = q[..., : self.d_nope], self._rope(q[..., self.d_nope :], cos, sin)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.d_c, self.d_rope], dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), self._rope(k_pe[:, None], cos, sin)[:, 0]), dim=-1)

        meta = meta.for_group(kv_cache.group_of(self.layer))
        kv_cache.write(self.layer, meta.slot_mapping, latent[:, None], latent[:, None, :0])

        out = q.new_empty(T, self.num_heads, self.d_v)
        if meta.decode is not None:
            self._decode(q_nope, q_pe, kv_cache, meta.decode, out)
        for s in meta.seqs:
            slots, mask = s.view(self.window)
            cached = kv_cache.read(self.layer, slots)[0][:, 0].to(q.dtype)  # [n_kv, d_c + d_rope]
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self.attend_materialized(q_nope[rows], q_pe[rows], cached, mask)
        return self.o_proj(out.reshape(T, self.num_heads * self.d_v))

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: KVCache, batch: DecodeBatch,
                out: torch.Tensor) -> None:
        """Decode rows of q_nope [T, H, d_nope], q_pe [T, H, d_rope] -> out [T, H, d_v]."""
        for rows, slots, mask in batch.groups(self.window):
            cached = kv_cache.read(self.layer, slots)[0][:, :, 0].to(q_nope.dtype)  # [B, L, d_c + d_rope]
            if self.absorb:
                # one query position per sequence: T = 1, mask [B, 1, L]
                out[rows] = self.attend_absorbed(q_nope[rows, None], q_pe[rows, None], cached, mask[:, 0])[:, 0]
            else:
                for b in range(rows.shape[0]):
                    keep = mask[b, 0, 0]  # [L] valid positions (padding at the end)
                    out[rows[b]] = self.attend_materialized(q_nope[rows[b], None], q_pe[rows[b], None],
                                                            cached[b, keep], None)[0]

    # ------------------------------------------------------------ the two forms
    def attend_materialized(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                            mask) -> torch.Tensor:
        """q_nope [T, H, d_nope], q_pe [T, H, d_rope] (rotated), cached [L, d_c + d_rope],
        mask [T, L] bool, None or CAUSAL -> [T, H, d_v], building per-head K and V."""
        L, H = cached.shape[0], self.num_heads
        c_kv, k_pe = cached[:, : self.d_c], cached[:, self.d_c :]
        kv = self.kv_b_proj(c_kv).view(L, H, self.d_nope + self.d_v)
        k = torch.cat((kv[..., : self.d_nope], k_pe[:, None].expand(L, H, self.d_rope)), dim=-1)
        v = kv[..., self.d_nope :]
        q = torch.cat((q_nope, q_pe), dim=-1)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, *, *]
        if mask is CAUSAL:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                        mask) -> torch.Tensor:
        """The same attention with W_UK absorbed into the query and W_UV into the output.

        q_nope [*B, T, H, d_nope], q_pe [*B, T, H, d_rope], cached [*B, L, d_c + d_rope],
        mask broadcastable to [*B, T*H, L] (bool), None or CAUSAL (T == L) -> [*B, T, H, d_v].
        The T x H query rows all attend the one latent "head"."""
        w_uk, w_uv = self.up_weights()
        *batch, T, H, _ = q_nope.shape
        q_lat = torch.einsum("...thn,hnc->...thc", q_nope, w_uk)  # [*B, T, H, d_c]
        q = torch.cat((q_lat, q_pe), dim=-1).reshape(*batch, T * H, self.d_c + self.d_rope)
        if mask is CAUSAL:  # query row t*H + h sits at position t
            L = cached.shape[-2]
            mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril_().repeat_interleave(H, dim=0)
        o_lat = F.scaled_dot_product_attention(q, cached, cached[..., : self.d_c], attn_mask=mask,
                                               scale=self.scale)  # [*B, T*H, d_c]
        return torch.einsum("...thc,hvc->...thv", o_lat.view(*batch, T, H, self.d_c), w_uv)
