"""Attention over a paged KV pool.

The linear layers see one flat batch of tokens; attention is per sequence (Orca's selective
batching). Each step writes its new K/V into the pool at `slot_mapping`, then every sequence
attends over the slots its block table names. On CPU that is a gather plus
`scaled_dot_product_attention` with a mask built from position predicates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import (
    norm_rope_write,
    norm_rope_write_rows,
    paged_decode_attention,
    prefill_attention,
)
from kvserve.kernels.host_memory import empty_huge
from kvserve.model.config import ModelConfig
from kvserve.model.layers import PackedMatmul, RMSNorm, apply_rope
from kvserve.model.state_cache import RecurrentMetadata

# KV-cache storage formats besides the model's dtype: codes plus one fp32 scale per (token, KV
# head), absmax / qmax, so attention dequantizes on read (the max a code may take).
KV_QUANT = {"int8": (torch.int8, 127.0), "fp8": (torch.uint8, 448.0)}  # fp8 e4m3 bytes held as uint8
# Float pools of a stated width for any compute dtype: rows rounded to nearest on write (as .to()
# rounds) and widened exactly on read. 16 bits: half an fp32 pool's bytes (llama.cpp's default
# cache is fp16); fp32: the exact pool where "auto" would pick 16 bits. vLLM's spellings too.
KV_FLOAT = {"fp16": torch.float16, "bf16": torch.bfloat16, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "fp32": torch.float32, "float32": torch.float32}
KV_CACHE_DTYPES = ("auto", *KV_FLOAT, *KV_QUANT)


def kv_storage_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """What a pool of format `kv_dtype` holds for a model computing in `dtype`: codes for the
    quantized formats, the stated float type, or the compute dtype itself ("auto")."""
    if kv_dtype in KV_QUANT:
        return KV_QUANT[kv_dtype][0]
    return KV_FLOAT.get(kv_dtype, dtype)


class KVCache:
    """The KV pool: storage tensors K and V of shape [num_slots, num_kv_heads, head_dim].

    A slot is one token position in one block (page): slot = block_id * block_size + offset.
    `layer_groups` splits the layers into KV layer groups of equal size (default: one group of
    every layer). Each group has its own block table per sequence, and pages are drawn from one
    pool by all groups, so the j-th layer of EVERY group shares storage tensor j: a page belongs
    to one group at a time, and its slots in tensor j hold that group's j-th layer. With one
    group this is one tensor per layer.

    `kv_source` (cross-layer KV sharing, ModelConfig.kv_source): only the layers that compute
    K/V have storage; a layer reusing another's is an alias of its source (`layer`, `read`).
    `kv_layers` (default: every layer) names the layers with K/V at all: a hybrid model's Mamba
    layers keep a recurrent state instead (kvserve/model/mamba.py: StateCache).

    `v_head_dim` (default head_dim) sets V's width apart: MLA (kvserve/model/mla.py) keeps its
    latent and RoPE key in K and passes 0, a V of no width.

    `kv_dtype` "int8" / "fp8" (e4m3) store codes with a per-(token, head) fp32 scale
    (`k_scale`, `v_scale` [num_slots, KVH, 1]): `write` quantizes, `read` dequantizes to the
    compute dtype. "fp16" / "bf16" / "fp32" store that type (`write` rounds, `read` converts to the
    compute dtype); "auto" stores `dtype` itself (then `read` is a plain gather).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layer_groups: Sequence[Sequence[int]] | None = None,
        kv_dtype: str = "auto",
        v_head_dim: int | None = None,
        kv_source: Sequence[int] | None = None,
        kv_layers: Sequence[int] | None = None,
    ):
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_dtype!r}")
        # Cross-layer KV sharing: only layers i with kv_source[i] == i store K/V; the others alias them.
        source = list(range(num_layers)) if kv_source is None else list(kv_source)[:num_layers]
        stored = [i for i, s in enumerate(source) if s == i]
        if kv_layers is not None:  # a hybrid model's Mamba layers store no K/V (ModelConfig.kv_layers)
            stored = [i for i in stored if i in set(kv_layers)]
        groups = [stored] if layer_groups is None else [list(g) for g in layer_groups]
        size = len(groups[0])
        if any(len(g) != size for g in groups) or sorted(i for g in groups for i in g) != stored:
            raise ValueError(f"layer groups {groups} must be of equal size and cover the layers {stored} once")
        shape = (num_slots, num_kv_heads, head_dim)
        v_shape = (num_slots, num_kv_heads, head_dim if v_head_dim is None else v_head_dim)
        self.dtype = dtype  # what attention computes in (and `read` returns)
        self.kv_dtype = kv_dtype
        self.quantized = kv_dtype in KV_QUANT
        store, self._qmax = kv_storage_dtype(kv_dtype, dtype), KV_QUANT[kv_dtype][1] if self.quantized else 0.0
        # Each decode step reads its pages from memory: 2 MB pages (advised before the zero fill).
        self.k = [empty_huge(*shape, dtype=store, device=device).zero_() for _ in range(size)]
        self.v = [empty_huge(*v_shape, dtype=store, device=device).zero_() for _ in range(size)]
        scale_shape = (num_slots, num_kv_heads, 1)
        n_scales = size if self.quantized else 0
        self.k_scale = [torch.zeros(scale_shape, dtype=torch.float32, device=device) for _ in range(n_scales)]
        self.v_scale = [torch.zeros(scale_shape, dtype=torch.float32, device=device) for _ in range(n_scales)]
        self.num_slots = num_slots
        self.num_groups = len(groups)
        # layer -> (storage index j, group g)
        self._where = {layer: (j, g) for g, group in enumerate(groups) for j, layer in enumerate(group)}
        self._where.update({i: self._where[s] for i, s in enumerate(source) if s != i})

    @staticmethod
    def bytes_per_token_head(head_dim: int, dtype: torch.dtype, kv_dtype: str = "auto",
                             v_head_dim: int | None = None) -> int:
        """Bytes of K plus V for one token of one KV head of one layer (scales included)."""
        width = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        scales = 2 * 4 if kv_dtype in KV_QUANT else 0
        return width * kv_storage_dtype(kv_dtype, dtype).itemsize + scales

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K pool, V pool [num_slots, KVH, D] of a layer (storage: codes when quantized), and
        its layer group."""
        j, g = self._where[layer]
        return self.k[j], self.v[j], g

    def group_of(self, layer: int) -> int:
        """The KV layer group a layer's pages belong to."""
        return self._where[layer][1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, KVH, D] at `slots` [T] of a layer (quantizing when the pool does)."""
        j, _ = self._where[layer]
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.quantized:
                x = x.float()
                scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) / self._qmax  # [T, KVH, 1]
                codes = x / scale
                if self.kv_dtype == "int8":
                    codes = codes.round_().to(torch.int8)
                else:  # fp8 bytes kept as uint8: CPU index_copy / index_select lack float8 kernels
                    codes = codes.to(torch.float8_e4m3fn).view(torch.uint8)
                pool[j].index_copy_(0, slots, codes)
                scales[j].index_copy_(0, slots, scale)
            else:
                pool[j].index_copy_(0, slots, x.to(pool[j].dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at `slots` (any shape S) of a layer -> [*S, KVH, D] each, in the compute dtype."""
        j, _ = self._where[layer]
        flat = slots.reshape(-1)
        out = []
        for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = pool[j].index_select(0, flat)
            if self.quantized:
                x = x.view(torch.float8_e4m3fn) if self.kv_dtype == "fp8" else x
                x = x.float() * scales[j].index_select(0, flat)
            out.append(x.to(self.dtype).view(*slots.shape, *x.shape[1:]))
        return out[0], out[1]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write support: duplicate the K/V of `src` slots into `dst` slots in every
        storage tensor (a page id is unique across groups, so this copies its group's layers)."""
        for t in self.k + self.v + self.k_scale + self.v_scale:
            t[dst] = t[src]


CAUSAL = "causal"  # a mask value: queries and keys are the same positions, so SDPA's is_causal


@dataclass
class SeqAttention:
    """One sequence's share of a step.

    Its queries are rows [q_start, q_start + q_len) of the flat batch, the last q_len positions
    of its context; after this step's write the context is `ctx_slots` (slot of each logical
    position 0..ctx_len-1, ctx_len = tokens computed before + q_len).
    """

    q_start: int
    q_len: int
    ctx_slots: torch.Tensor  # [ctx_len] int64 (released positions of a sliding group: any slot, never read)
    # Masks by window. They depend on positions only, so the runner hands the SAME dict to this
    # sequence's SeqAttention of every KV layer group: built once per step per window size.
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def ctx_len(self) -> int:
        return int(self.ctx_slots.shape[0])

    def first_kv(self, window: int | None) -> int:
        """First position a layer with this window reads."""
        return 0 if window is None else max(0, self.ctx_len - self.q_len - window + 1)

    def view(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Slots to read and the boolean mask [q_len, n_kv] (None = attend to all, CAUSAL =
        lower-triangular with q_len == n_kv) for a layer."""
        if window not in self._masks:
            self._masks[window] = self._build(window)
        return self.ctx_slots[self.first_kv(window):], self._masks[window]

    def _build(self, window: int | None) -> torch.Tensor | str | None:
        first_q = self.ctx_len - self.q_len  # position of the first query token
        start = self.first_kv(window)
        if self.q_len == 1:
            return None  # a single query at the end sees exactly [start, ctx_len)
        if first_q == 0 and (window is None or self.ctx_len <= window):
            return CAUSAL  # a whole prompt inside the window: plain causal attention
        device = self.ctx_slots.device
        kv_pos = torch.arange(start, self.ctx_len, device=device)
        q_pos = torch.arange(first_q, self.ctx_len, device=device)[:, None]
        mask = kv_pos[None, :] <= q_pos
        if window is not None:
            mask &= kv_pos[None, :] > q_pos - window
        return mask


@dataclass
class DecodeBatch:
    """The step's decode sequences (one query each), described by their block tables.

    Sequence i's query is row `rows[i]` of the flat batch; it attends positions
    [start_i, lens[i]) of its context, where start_i = max(0, lens[i] - window) on a sliding
    window layer. The C kernel reads K/V in place through `block_tables`; the torch fallback
    (`groups`) gathers them into padded tensors, a few sequences of similar length at a time.
    """

    rows: torch.Tensor  # [B] int64
    # [B, max_blocks] int32, padded with 0; a sliding group's released entries are -1 (NULL_BLOCK),
    # always before starts[b]: the kernel never reads them, the fallback clamps them.
    block_tables: torch.Tensor
    lens: torch.Tensor  # [B] int32: context length after this step's token
    block_size: int
    max_len: int | None  # max(lens); None in a CUDA graph's batch, whose lengths change at each replay
    _starts: dict = field(default_factory=dict, repr=False)
    _groups: dict = field(default_factory=dict, repr=False)

    GROUP = 16  # sequences per attention call on the fallback path

    def starts(self, window: int | None) -> torch.Tensor:
        """First attended position per sequence [B] int32 (shared by all layers of a window)."""
        if window not in self._starts:
            self._starts[window] = (torch.zeros_like(self.lens) if window is None
                                    else (self.lens - window).clamp_(min=0))
        return self._starts[window]

    def groups(self, window: int | None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Fallback views: (rows [b], slots [b, L], key mask [b, 1, 1, L]) per group of GROUP
        sequences sorted by length, so padding inside a group stays small."""
        if window not in self._groups:
            starts, order = self.starts(window), torch.argsort(self.lens)
            views = []
            for idx in order.split(self.GROUP):
                lens, first = self.lens[idx].long(), starts[idx].long()
                pos = torch.arange(int((lens - first).max()), device=lens.device)[None, :] + first[:, None]
                valid = pos < lens[:, None]
                pos = torch.where(valid, pos, 0)
                # Padding positions read entry 0, which a sliding group may have released (-1).
                table = self.block_tables[idx].long().clamp_(min=0)
                slots = table.gather(1, pos // self.block_size) * self.block_size + pos % self.block_size
                views.append((self.rows[idx], slots, valid[:, None, None, :]))
            self._groups[window] = views
        return self._groups[window]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward step (built by the model runner)."""

    slot_mapping: torch.Tensor  # [T] int64: where this step's K/V go in the pool
    seqs: list[SeqAttention]  # sequences feeding several tokens (prefill chunks): one call each
    decode: DecodeBatch | None = None  # single-token sequences
    # Extension point (e.g. StreamingLLM evaluation, kvserve/model/streaming.py): when set, every
    # layer hands it (layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) after the projections and
    # q/k norms but BEFORE RoPE, and uses its [T, H, D] result; the pool and positions are then
    # the callable's business (the KV pool is neither read nor written).
    custom: Callable[["Attention", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Several KV layer groups (KVCache.layer_groups): the metadata of group g (its slots, context
    # slots, decode block tables) is groups[g], and this object's own fields repeat group 0's.
    # Empty: this object serves every layer.
    groups: list["AttentionMetadata"] = field(default_factory=list)
    # Cross-layer KV sharing with `custom`: a source layer's pre-RoPE (k, v) of this forward pass,
    # by layer, for the layers that reuse them (the paged path reads them from the pool instead).
    shared_kv: dict = field(default_factory=dict)
    # A hybrid model's recurrent layers: each sequence's state slot (kvserve/model/state_cache.py).
    recurrent: RecurrentMetadata | None = None

    def for_group(self, group: int) -> "AttentionMetadata":
        return self.groups[group] if self.groups else self


@dataclass
class KeptRows:
    """The rows a forward pass's last layer carries past its K/V write: the rows whose logits
    are needed. The other rows' K/V must be in the pool for later steps, but their outputs of the
    last layer (attention, o_proj, MLP) feed nothing, so a prompt chunk pays that layer for one row.

    `meta` describes attention for the kept rows alone (row i of it is rows[i] of the step),
    sharing the pool and the context slots of the step's own metadata."""

    rows: torch.Tensor  # [N] int64, increasing indices into the step's T rows
    meta: AttentionMetadata


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads (MHA, GQA and MQA alike)."""

    def __init__(self, cfg: ModelConfig, layer: int, gemma_norm: bool):
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attn_scale
        self.window = cfg.window(layer)
        # Cross-layer KV sharing: a reusing layer reads the K/V its source layer (earlier in the
        # same forward pass) wrote, and has no K/V projections of its own.
        self.kv_source = cfg.kv_source[layer] if cfg.kv_source is not None else layer
        self.computes_kv = self.kv_source == layer
        self.shares_kv = cfg.kv_source is not None and any(
            s == layer and i != layer for i, s in enumerate(cfg.kv_source))
        # RoPE on part of each head (Bamba): the fused C / Triton prologues rotate whole heads.
        self.partial_rotary = cfg.rotary_dim < cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias) if self.computes_kv else None
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias) if self.computes_kv else None
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        # q, k and v as one low-bit matmul (kvserve/accel/fused_quant.py, set by the engine's --weights
        # path, which then drops q/k/v_proj): one kernel call instead of three per decode step.
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = (q_size, kv_size, kv_size)
        # The fp32 path's counterpart: q/k/v packed as one panel matrix for decode steps
        # (set by kvserve/accel/panels.py), the Linears kept for prefill.
        self.qkv_panels: PackedMatmul | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=gemma_norm)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=gemma_norm) if self.computes_kv else None
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: KeptRows | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; with `keep`, K/V of all T rows are written and the
        output is that of the kept rows only, [N, hidden]."""
        if meta is None:  # CausalLM.step_graph (EngineConfig.compile): the op reads the step context
            return self._traced_forward(x, cos_sin)
        T = x.shape[0]
        q, k, v = self._project(x)
        if meta.custom is None and not self.partial_rotary:
            group = kv_cache.group_of(self.kv_source)
            rotated = self._fused_prologue(q, k, v, cos_sin, kv_cache, meta.for_group(group))
            if rotated is not None:
                return self._attend_kept(rotated, kv_cache, meta, group, keep, x.shape[1])
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.computes_kv:
            if self.k_norm is not None:
                k = self.k_norm(k)
            if self.shares_kv and meta.custom is not None:
                meta.shared_kv[self.layer] = (k, v)  # pre-RoPE, for the custom hook of the reusing layers
        if meta.custom is not None:  # a caller-owned cache and rotation (see AttentionMetadata)
            if not self.computes_kv:
                k, v = meta.shared_kv[self.kv_source]
            out = self.o_proj(meta.custom(self, q, k, v).reshape(T, self.num_heads * self.head_dim))
            return out if keep is None else out.index_select(0, keep.rows)
        cos, sin = cos_sin
        q = apply_rope(q, cos, sin)

        group = kv_cache.group_of(self.kv_source)
        if self.computes_kv:  # a reusing layer reads its source's pages, written earlier in this pass
            kv_cache.write(self.layer, meta.for_group(group).slot_mapping, apply_rope(k, cos, sin), v)
        return self._attend_kept(q, kv_cache, meta, group, keep, x.shape[1])

    def _traced_forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """forward inside `CausalLM.step_graph`, what dynamo traces (every row, no custom hook):
        projections, q/k norms and RoPE as torch ops, then the step's K/V write and attention as
        one opaque op. Run eagerly (dynamo fell back) it computes the same."""
        q, k, v = self._project(x)
        cos, sin = cos_sin
        q = apply_rope(self.q_norm(q) if self.q_norm is not None else q, cos, sin)
        if k is not None:
            k = apply_rope(self.k_norm(k) if self.k_norm is not None else k, cos, sin)
        return self.o_proj(torch.ops.kvserve.step_attention(q, k, v, self.layer))

    def attend_written(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: KVCache,
                       meta: AttentionMetadata) -> torch.Tensor:
        """Eager half of `_traced_forward`: write rotated k and v [T, KVH, D] (None: a layer
        reusing its source's K/V) at the step's slots, attend with q [T, H, D] -> [T, H * D]."""
        group_meta = meta.for_group(kv_cache.group_of(self.kv_source))
        if self.computes_kv:
            kv_cache.write(self.layer, group_meta.slot_mapping, k, v)
        return self._attention(q, kv_cache, group_meta)

    def with_residual(self, x: torch.Tensor, h: torch.Tensor, cos_sin, kv_cache: KVCache, meta: AttentionMetadata,
                      keep: KeptRows | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's attention step: (attention of x, the residual rows of h it adds to),
        both [T, hidden], or with `keep` the kept rows' [N, hidden]."""
        a = self(x, cos_sin, kv_cache, meta, keep=keep)
        return a, (h if keep is None else h.index_select(0, keep.rows))

    def _attend_kept(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, group: int,
                     keep: KeptRows | None, hidden: int) -> torch.Tensor:
        """Rotated q [T, H, D] (K/V written) -> [T, hidden], or with `keep` the kept rows' [N, hidden]."""
        if keep is None:
            return self._attend_all(q, kv_cache, meta.for_group(group))
        if keep.rows.numel() == 0:
            return q.new_empty((0, hidden))
        return self._attend_all(q.index_select(0, keep.rows), kv_cache, keep.meta.for_group(group))

    def _fused_prologue(self, q, k, v, cos_sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor | None:
        """q/k norms, RoPE and the K/V write as one C call (kvserve/kernels/rope_cache.c) for fp32
        steps; returns the rotated q [T, H, D], or None (the torch ops run). Bitwise the torch
        path."""
        if kv_cache.quantized or torch.is_grad_enabled():
            return None
        if q.is_cuda:
            return self._fused_prologue_cuda(q, k, v, cos_sin, kv_cache, meta)
        # (k, v and k_norm are None for a layer reusing another layer's K/V.)
        q_gain = None if self.q_norm is None else self.q_norm.kernel_gain()
        k_gain = None if self.k_norm is None else self.k_norm.kernel_gain()
        if (self.q_norm is not None and q_gain is None) or (self.k_norm is not None and (
                k_gain is None or self.k_norm.eps != self.q_norm.eps)):
            return None
        k_pool, v_pool, _ = kv_cache.layer(self.layer) if self.computes_kv else (None, None, None)
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        cos, sin = cos_sin
        return norm_rope_write(q, k, v, q_gain, k_gain, eps, cos, sin, meta.slot_mapping, k_pool, v_pool)

    def _fused_prologue_cuda(self, q, k, v, cos_sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor | None:
        """The same prologue on CUDA: one Triton launch for q and k (kernels/triton_ops.py), the
        PyTorch ops' roundings."""
        k_pool, v_pool, _ = kv_cache.layer(self.layer) if self.computes_kv else (None, None, None)
        q_norm = None if self.q_norm is None else (self.q_norm.weight, self.q_norm.eps, self.q_norm.offset)
        k_norm = None if self.k_norm is None else (self.k_norm.weight, self.k_norm.eps, self.k_norm.offset)
        cos, sin = cos_sin
        return norm_rope_write_rows(q, k, v, q_norm, k_norm, cos, sin, meta.slot_mapping, k_pool, v_pool)

    def _attend_all(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Rotated q [T, H, D] against the pool (this step's K/V already written) -> o_proj'd
        output [T, hidden]."""
        return self.o_proj(self._attention(q, kv_cache, meta))

    def _attention(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Rotated q [T, H, D] against the pool (this step's K/V already written) -> [T, H * D]."""
        T = q.shape[0]
        # No multi-token sequences: the runner made every row a decode row, in input order, so q
        # goes to the kernel as it is, without a gather and scatter of rows.
        if meta.decode is not None and not meta.seqs and meta.decode.rows.shape[0] == T:
            out = self._decode_kernel(q, kv_cache, meta.decode)
            if out is not None:
                return out.reshape(T, self.num_heads * self.head_dim)
        out = torch.empty_like(q)
        if meta.decode is not None:
            self._decode(q, kv_cache, meta.decode, out)
        for s in meta.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            if self._prefill_kernel(q[rows], kv_cache, s, out[rows]):
                continue
            slots, mask = s.view(self.window)
            ks, vs = kv_cache.read(self.kv_source, slots)
            ks, vs = ks.transpose(0, 1).to(q.dtype), vs.transpose(0, 1).to(q.dtype)  # [KVH, n_kv, D]
            out[rows] = self._attend(q[rows], ks, vs, mask)
        return out.reshape(T, self.num_heads * self.head_dim)

    def _prefill_kernel(self, q: torch.Tensor, kv_cache: KVCache, s: SeqAttention, out: torch.Tensor) -> bool:
        """One sequence's queries q [q_len, H, D] through the C kernel, which reads its K/V from
        the pool's slots itself (no gathered tensors, masked blocks skipped), into out [q_len, H,
        D]; False where it does not apply (a quantized pool, no kernel, another dtype or device)
        and SDPA runs."""
        if kv_cache.quantized or q.requires_grad:
            return False
        k_pool, v_pool, _ = kv_cache.layer(self.kv_source)
        first_kv = s.first_kv(self.window)
        got = prefill_attention(q, k_pool, v_pool, s.ctx_slots[first_kv:], first_kv, s.ctx_len - s.q_len,
                                self.window, self.scale, out=out)
        return got is not None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D] (None for a layer reusing another's K/V)."""
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = None
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        elif self.qkv_panels is not None:
            qkv = self.qkv_panels.matmul(x)  # None for prefill-sized inputs
        if qkv is not None:
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            return q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
        q = self.q_proj(x).view(T, H, D)
        if not self.computes_kv:
            return q, None, None
        return q, self.k_proj(x).view(T, KVH, D), self.v_proj(x).view(T, KVH, D)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """q [T, H, D], k/v [KVH, L, D], mask [T, L], None or CAUSAL -> [T, H, D].

        The G = H / KVH query heads that share a K/V head become G x T query rows of that head
        (mask tiled G times), so GQA/MQA never materializes repeated K/V.
        """
        T, G = q.shape[0], self.num_heads // self.num_kv_heads
        if mask is CAUSAL:  # the fused kernel skips the masked half, no mask tensor
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True,
                                               scale=self.scale, enable_gqa=G > 1)[0]
            return o.transpose(0, 1)
        qg = q.view(T, self.num_kv_heads, G, self.head_dim).permute(1, 2, 0, 3).reshape(self.num_kv_heads, G * T, -1)
        if mask is not None and G > 1:
            mask = mask.repeat(G, 1)
        # 4-D inputs let torch pick its fused CPU (flash) kernel instead of the bmm/softmax path.
        o = F.scaled_dot_product_attention(qg[None], k[None], v[None], attn_mask=mask, scale=self.scale)[0]
        return o.view(self.num_kv_heads, G, T, self.head_dim).permute(2, 0, 1, 3).reshape(T, self.num_heads, -1)

    def _decode_kernel(self, q: torch.Tensor, kv_cache: KVCache, batch: DecodeBatch) -> torch.Tensor | None:
        """The C kernel on q [B, H, D], one row per sequence of the batch in order -> [B, H, D];
        None where it does not apply (a quantized pool, no kernel, another dtype or device)."""
        if kv_cache.quantized:
            return None
        k_pool, v_pool, _ = kv_cache.layer(self.kv_source)
        return paged_decode_attention(q, k_pool, v_pool, batch.block_tables, batch.starts(self.window), batch.lens,
                                      batch.block_size, self.scale, batch.max_len)

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, batch: DecodeBatch, out: torch.Tensor) -> None:
        """Attention for the decode rows of q [T, H, D], written into out [T, H, D]."""
        o = self._decode_kernel(q[batch.rows], kv_cache, batch)  # reads the pool in place
        if o is not None:
            out[batch.rows] = o
            return
        G = self.num_heads // self.num_kv_heads
        for rows, slots, mask in batch.groups(self.window):
            B, L = slots.shape
            k, v = kv_cache.read(self.kv_source, slots)  # [B, L, KVH, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            # GQA heads as query rows of their K/V head: no repeated K/V.
            qg = q[rows].view(B, self.num_kv_heads, G, self.head_dim)
            o = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.scale)
            out[rows] = o.reshape(B, self.num_heads, self.head_dim)
