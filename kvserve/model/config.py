"""Architecture description shared by every model family.

Loaders (GGUF metadata, HF config.json) translate their own vocabulary into this one
dataclass, so the model code never looks at a file format.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

FULL = "full_attention"
SLIDING = "sliding_attention"
MAMBA = "mamba"  # a Mamba2 mixer (kvserve/model/mamba.py): a recurrent state per sequence, no K/V
ATTENTION_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type.

    `scaling` is None (default RoPE) or a dict as in HF's `rope_scaling`, e.g.
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192} or {"rope_type": "linear", "factor": 8.0}, or
    {"rope_type": "freq_factors", "factors": (f_0, ..., f_{head_dim/2 - 1})}: each inverse frequency
    divided by its factor (a GGUF's rope_freqs tensor, which is how llama.cpp stores Llama 3.1+'s
    llama3 scaling).
    """

    theta: float
    scaling: tuple[tuple[str, float | str | tuple[float, ...]], ...] | None = None

    @property
    def scaling_dict(self) -> dict | None:
        return dict(self.scaling) if self.scaling is not None else None


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (kvserve/model/moe.py) in the layers `layers`; the other
    layers keep a dense MLP of ModelConfig.intermediate_size. Field names are HF's."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # of one routed expert (moe_intermediate_size; Mixtral: intermediate_size)
    layers: tuple[int, ...]  # the layers whose MLP is the MoE block
    scoring: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3's scoring_func)
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy" (DeepSeek-V2), "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # the shared expert(s) as one MLP; 0: none
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert
    router_fp32: bool = False  # router logits from fp32 weights and inputs (DeepSeek)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring {self.scoring!r} is not supported (supported: softmax, sigmoid)")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"MoE topk_method {self.topk_method!r} is not supported "
                             f"(supported: greedy, group_limited_greedy, noaux_tc)")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.topk_method != "greedy":
            if self.n_group <= 0 or self.num_experts % self.n_group:
                raise ValueError(f"MoE n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"MoE topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
            if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
                raise ValueError(f"MoE topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group} "
                                 f"experts hold fewer than top_k ({self.top_k}) experts")
            if self.topk_method == "noaux_tc" and self.num_experts // self.n_group < 2:
                raise ValueError("MoE topk_method 'noaux_tc' scores a group by its best two experts: "
                                 "n_group must leave at least 2 experts per group")

    def params_per_layer(self, hidden: int, active: bool = False) -> int:
        """Router, routed experts (all, or the top_k a token uses) and shared experts."""
        experts = self.top_k if active else self.num_experts
        gate = hidden if self.shared_expert_gate else 0
        return (self.num_experts * hidden + experts * 3 * hidden * self.intermediate_size
                + 3 * hidden * self.shared_intermediate_size + gate)


@dataclass
class ModelConfig:
    family: str  # "gemma3", "llama" (llama, mistral, qwen2, qwen3 share one implementation) or "deepseek"
    model_type: str  # as the source called it, for messages
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: list[str]
    rope: dict[str, RopeConfig]  # keyed by layer type
    attn_scale: float
    sliding_window: int | None = None
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    add_bos_token: bool = True
    chat_template: str | None = None
    # MLA (DeepSeek-V2/V3, kvserve/model/mla.py), set when kv_lora_rank is: the pool caches a
    # latent of kv_lora_rank (d_c) plus one shared RoPE key of qk_rope_head_dim per token and
    # layer. Then num_kv_heads is 1 and head_dim is qk_rope_head_dim (the rotary width).
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # None: a plain q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of halves
    # Cross-layer KV sharing (CLA, kvserve/compress/convert/cla.py): kv_source[i] is the layer whose K/V layer i
    # attends over (i itself when it computes its own). A reusing layer has no k_proj / v_proj and
    # the pool holds no K/V for it. None: every layer computes its own.
    kv_source: tuple[int, ...] | None = None
    # RoPE on the first partial_rotary_factor of each head's dims, the rest passed through (Bamba: 0.5).
    partial_rotary_factor: float = 1.0
    # Mamba2 mixer layers (layer type MAMBA; Bamba, kvserve/model/bamba.py): mamba_n_heads heads of
    # mamba_head_dim channels (intermediate = their product), B and C in mamba_n_groups groups of
    # mamba_d_state, a causal depthwise conv of mamba_d_conv taps over x, B and C.
    mamba_n_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    # Mixture of experts (Mixtral, Qwen2-MoE, DeepSeek-V2/V3): None for a dense model.
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        for t in self.layer_types:
            if t not in (*ATTENTION_TYPES, MAMBA):
                raise ValueError(f"unknown layer type {t!r}")
            if t == MAMBA:
                if min(self.mamba_n_heads, self.mamba_head_dim, self.mamba_d_state, self.mamba_d_conv) < 1:
                    raise ValueError("mamba layers need mamba_n_heads, mamba_head_dim, mamba_d_state and "
                                     "mamba_d_conv >= 1")
                if self.mamba_n_groups < 1 or self.mamba_n_heads % self.mamba_n_groups:
                    raise ValueError(f"mamba_n_heads ({self.mamba_n_heads}) is not a multiple of "
                                     f"mamba_n_groups ({self.mamba_n_groups})")
                continue
            if t not in self.rope:
                raise ValueError(f"no rope parameters for layer type {t!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.kv_source is not None:
            self.kv_source = tuple(int(s) for s in self.kv_source)
            self._check_kv_source()
        if self.moe is not None and not all(0 <= i < self.num_layers for i in self.moe.layers):
            raise ValueError(f"MoE layers {list(self.moe.layers)} outside 0..{self.num_layers - 1}")

    def _check_kv_source(self) -> None:
        src = self.kv_source
        if len(src) != self.num_layers:
            raise ValueError(f"kv_source has {len(src)} entries for {self.num_layers} layers")
        if self.mla:
            raise ValueError("kv_source (cross-layer KV sharing) is not supported for MLA models")
        for i, s in enumerate(src):
            if not 0 <= s <= i or src[s] != s:
                raise ValueError(f"kv_source[{i}] = {s}: a layer reuses an earlier (or its own) layer that "
                                 f"computes its K/V")
            if self.layer_types[s] != self.layer_types[i]:
                raise ValueError(f"kv_source[{i}] = {s}: layer {i} ({self.layer_types[i]}) cannot reuse the K/V "
                                 f"of layer {s} ({self.layer_types[s]}): sharing needs the same attention type")

    def computes_kv(self, layer: int) -> bool:
        """Whether the layer projects its own K/V (False: it reuses kv_source[layer]'s, or it is a
        Mamba layer, which keeps a recurrent state instead)."""
        if self.layer_types[layer] == MAMBA:
            return False
        return self.kv_source is None or self.kv_source[layer] == layer

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers whose K/V the pool stores (every attention layer without cross-layer sharing)."""
        return tuple(i for i in range(self.num_layers) if self.computes_kv(i))

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state (Mamba2 mixers) instead of K/V."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == MAMBA)

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a per-sequence recurrent state (the engine's state pool serves them)."""
        return bool(self.mamba_layers)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_n_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x, then B and C."""
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state

    def state_elements_per_layer(self) -> tuple[int, int]:
        """(conv state, SSM state) elements of one sequence in one Mamba layer: the conv keeps
        the last d_conv - 1 inputs of every channel, the SSM a [heads, head_dim, d_state] state."""
        return (self.mamba_conv_dim * (self.mamba_d_conv - 1),
                self.mamba_n_heads * self.mamba_head_dim * self.mamba_d_state)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(heads, K width, V width) of one token of one layer in the KV pool: MLA stores
        [c_kv | k_pe] as one K "head" and no V."""
        if self.mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    def window(self, layer: int) -> int | None:
        """Tokens a query at this layer may see (itself included), None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def num_params(self) -> int:
        return self.count_params()

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies by: an MoE layer counts its router, top_k routed
        experts and shared experts."""
        return self.count_params(active=True)

    def count_params(self, active: bool = False) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f
        if self.mla:
            h, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            q_params = d * h * qk if self.q_lora_rank is None else self.q_lora_rank * (d + h * qk)
            kv_params = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (
                self.qk_nope_head_dim + self.v_head_dim)
            per_layer = q_params + kv_params + h * self.v_head_dim * d + 3 * d * f
        head = 0 if self.tie_word_embeddings else v * d
        attn_layers = self.num_layers - len(self.mamba_layers)
        reusers = attn_layers - len(self.kv_layers)  # no k_proj / v_proj (CLA)
        total = v * d + head + attn_layers * per_layer - reusers * 2 * d * kv
        if self.mamba_layers:  # in_proj, conv, dt_bias / A_log / D, gated norm, out_proj; and the MLP
            inner, conv, h = self.mamba_intermediate, self.mamba_conv_dim, self.mamba_n_heads
            mixer = d * (inner + conv + h) + conv * (self.mamba_d_conv + 1) + 3 * h + inner + inner * d
            total += len(self.mamba_layers) * (mixer + 3 * d * f)
        if self.moe is not None:  # those layers hold the MoE block instead of a dense MLP
            total += len(self.moe.layers) * (self.moe.params_per_layer(d, active) - 3 * d * f)
        return total

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """K and V for one token in every layer that stores them (no sliding-window savings)."""
        heads, k_dim, v_dim = self.kv_cache_layout
        return len(self.kv_layers) * heads * (k_dim + v_dim) * bytes_per_element

    def state_bytes_per_seq(self, conv_bytes_per_element: int = 4, ssm_bytes_per_element: int = 4) -> int:
        """Recurrent state of one sequence over every Mamba layer: flat in its length."""
        conv, ssm = self.state_elements_per_layer()
        return len(self.mamba_layers) * (conv * conv_bytes_per_element + ssm * ssm_bytes_per_element)


@dataclass(frozen=True)
class LayerGroup:
    """Layers whose K/V share one block table per sequence: one block of the table is one page
    of the KV pool holding `block_size` tokens of every layer here."""

    layers: tuple[int, ...]
    window: int | None  # the sliding window of every layer here; None = keep every block


def kv_layer_groups(cfg: ModelConfig, release_sliding: bool = True) -> list[LayerGroup]:
    """Split the layers into KV layer groups of equal size, full-attention groups first.

    Without `release_sliding`, or with a single attention type, there is one group of every
    layer (a model whose layers all slide keeps window W, so its old blocks can go). Otherwise
    the group size is gcd(#full, #sliding) layers, so pages are the same size in every group and
    one pool serves all (Gemma 3 270M: 3 full + 15 sliding layers -> 1 full and 5 sliding groups
    of 3 layers). Sliding layers are grouped in order. Only layers that store K/V take part (a
    layer reusing another's K/V under cross-layer sharing reads its source's pages).
    """
    everything = cfg.kv_layers
    full = tuple(i for i in everything if cfg.layer_types[i] == FULL)
    sliding = tuple(i for i in everything if cfg.layer_types[i] == SLIDING)
    if not release_sliding or not sliding:
        return [LayerGroup(everything, None)]
    if not full:
        return [LayerGroup(everything, cfg.sliding_window)]
    size = math.gcd(len(full), len(sliding))
    groups = [LayerGroup(full[i:i + size], None) for i in range(0, len(full), size)]
    groups += [LayerGroup(sliding[i:i + size], cfg.sliding_window) for i in range(0, len(sliding), size)]
    return groups
