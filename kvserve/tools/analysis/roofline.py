"""Roofline arithmetic for transformer inference: the lecture's numbers as code (no torch here).

Units everywhere: FLOPs and FLOP/s, bytes and bytes/s, seconds, tokens.

A step runs `batch` sequences, each with `new_tokens` (T) query tokens attending to `context`
(S) cached tokens: prefill is T = S = prompt length, decode is T = 1 at context S. Every matmul
`[M, K] x [K, N]` costs 2MKN FLOPs and moves (MK + KN + MN) elements; attention per sequence
moves Q, K, V and the output once. An operation's time is the roofline
max(FLOPs / peak, bytes / bandwidth); a step's time is the sum over operations. Memory is the
weights plus the KV cache of every sequence at length S (activations are ignored), plus for
a hybrid model the recurrent state of its Mamba layers, which is the same at every length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    """An accelerator (or this machine): peak dense FLOP/s, memory bandwidth (bytes/s) and
    memory capacity (bytes)."""

    name: str
    flops: float
    bandwidth: float
    memory: float

    @property
    def intensity(self) -> float:
        """FLOP/byte above which an operation is compute-bound (peak / bandwidth)."""
        return self.flops / self.bandwidth


@dataclass(frozen=True)
class ModelShape:
    """The shapes that set a decoder-only transformer's cost.

    MLA (`kv_latent` = d_c set): each token caches a latent of d_c plus a shared RoPE key of
    `rope_dim` (d_rope) per layer; `head_dim` is then the non-RoPE query/key and the value head
    size (DeepSeek's qk_nope_head_dim = v_head_dim), so a query/key head is head_dim + rope_dim
    wide. Attention is costed in the absorbed form (K/V never materialized). MoE (`experts` > 0):
    every layer after the first `dense_layers` has `experts` routed experts of
    `expert_intermediate` (each token uses `experts_per_token`) plus `shared_experts`.
    Sliding-window layers (`sliding_layers` of them) cache at most `sliding_window` tokens.
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True  # gate, up and down projections (SwiGLU/GeGLU); False: up and down
    weight_bytes: float = 2.0  # bytes per weight and per activation element (2 = bf16)
    kv_bytes: float = 2.0  # bytes per cached K/V (or latent) element
    kv_latent: int | None = None  # MLA d_c
    q_latent: int | None = None  # MLA query compression rank (DeepSeek-V2/V3; None in V2-Lite)
    rope_dim: int = 0  # MLA d_rope
    sliding_window: int | None = None
    sliding_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0
    norms_per_layer: int = 2  # RMSNorm vectors of `hidden` per layer (Gemma 3: 4)
    qk_norm: bool = False  # a head_dim norm on queries and on keys
    # Cross-layer KV sharing (CLA): runs of kv_share layers of one attention type (full or
    # sliding) use the first one's K/V, so ceil(n / kv_share) of each type's n layers cache K/V and
    # project K/V (kvserve convert --share-kv-every). Every layer still reads a cache in attention.
    kv_share: int = 1
    # Hybrid models (Bamba): `mamba_layers` of the layers have a Mamba2 mixer instead of attention
    # (and keep their MLP): mamba_heads heads of mamba_head_dim, B and C in mamba_groups groups of
    # mamba_state, a causal conv of mamba_conv taps over x, B and C. Per sequence such a layer
    # keeps a conv state (mamba_conv - 1 inputs of every conv channel, at weight_bytes each) and an
    # SSM state [heads, head_dim, state] at `state_bytes` (fp32 in kvserve): flat in the length.
    mamba_layers: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 1
    mamba_state: int = 0
    mamba_conv: int = 4
    state_bytes: float = 4.0

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"{self.name}: {f} must be >= 1, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.weight_bytes <= 0 or self.kv_bytes <= 0:
            raise ValueError(f"{self.name}: bytes per element must be > 0")
        if not 0 <= self.sliding_layers <= self.layers or (self.sliding_layers and not self.sliding_window):
            raise ValueError(f"{self.name}: sliding_layers needs 0..layers layers and a sliding_window")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(f"{self.name}: experts_per_token must be in 1..experts")
        if self.kv_share < 1 or (self.kv_share > 1 and self.mla):
            raise ValueError(f"{self.name}: kv_share must be >= 1 (and 1 for MLA), got {self.kv_share}")
        if self.mamba_layers:
            if not 0 < self.mamba_layers <= self.layers - self.sliding_layers or self.mla:
                raise ValueError(f"{self.name}: mamba_layers must be in 1..layers - sliding_layers (and no MLA)")
            if min(self.mamba_heads, self.mamba_head_dim, self.mamba_state, self.mamba_conv, self.mamba_groups) < 1:
                raise ValueError(f"{self.name}: Mamba layers need mamba_heads, mamba_head_dim, mamba_state, "
                                 f"mamba_conv and mamba_groups >= 1")

    @property
    def mla(self) -> bool:
        return self.kv_latent is not None

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def attention_layers(self) -> int:
        """Layers with attention (all but the Mamba layers of a hybrid)."""
        return self.layers - self.mamba_layers

    @property
    def kv_layers(self) -> int:
        """Layers that cache (and project) K/V: every attention layer unless kv_share > 1."""
        return sum(_shared(self, n) for n in (self.attention_layers - self.sliding_layers, self.sliding_layers))

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x, then B and C."""
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state


def _shared(m: ModelShape, n: int) -> int:
    """Of n layers of one attention type, those that keep K/V under cross-layer sharing."""
    return -(-n // m.kv_share)


# --- sizes -------------------------------------------------------------------------------------


def attention_params(m: ModelShape) -> int:
    """Weights of one layer's attention projections."""
    d, n, h = m.hidden, m.heads, m.head_dim
    if m.mla:  # q (or q_a, q_b), kv_a (latent + RoPE key), kv_b (latent -> K_nope and V), o
        q_out = n * (h + m.rope_dim)
        q = (d + q_out) * m.q_latent if m.q_latent else d * q_out
        return q + d * (m.kv_latent + m.rope_dim) + m.kv_latent * 2 * n * h + n * h * d
    return d * n * h + 2 * d * m.kv_heads * h + n * h * d


def _expert_params(m: ModelShape) -> int:
    return m.mlp_matrices * m.hidden * m.expert_intermediate


def mamba_params(m: ModelShape) -> int:
    """Weights of one Mamba2 mixer: in_proj (gate, conv input, dt), the depthwise conv and its
    bias, dt_bias / A_log / D per head, the gated norm, out_proj."""
    d, inner, conv, h = m.hidden, m.mamba_inner, m.mamba_conv_dim, m.mamba_heads
    return d * (inner + conv + h) + conv * (m.mamba_conv + 1) + 3 * h + inner + inner * d


def num_params(m: ModelShape, active: bool = False) -> int:
    """All parameters (norms included); with `active`, only the experts one token uses."""
    dense_mlp = m.mlp_matrices * m.hidden * m.intermediate
    used = (m.experts_per_token if active else m.experts) + m.shared_experts
    moe_mlp = used * _expert_params(m) + m.experts * m.hidden  # experts + router
    norms = (m.norms_per_layer * m.hidden + (2 * m.head_dim if m.qk_norm else 0) + (m.kv_latent or 0)
             + (m.q_latent or 0))
    per_layer = attention_params(m) + norms
    embeddings = m.vocab * m.hidden * (1 if m.tied_embeddings else 2)
    # a layer reusing another's K/V has no k/v projections (nor a key norm)
    no_kv = (m.attention_layers - m.kv_layers) * (2 * m.hidden * m.kv_heads * m.head_dim
                                                  + (m.head_dim if m.qk_norm else 0))
    mixers = m.mamba_layers * (mamba_params(m) + norms) if m.mamba_layers else 0
    return (m.attention_layers * per_layer - no_kv + mixers + (m.layers - m.moe_layers) * dense_mlp
            + m.moe_layers * moe_mlp + embeddings + m.hidden)


def weight_memory(m: ModelShape) -> float:
    """Bytes of all weights."""
    return num_params(m) * m.weight_bytes


def kv_elements_per_token_layer(m: ModelShape) -> int:
    """Cached elements per token per layer: 2·K·H (K and V), or d_c + d_rope for MLA."""
    return m.kv_latent + m.rope_dim if m.mla else 2 * m.kv_heads * m.head_dim


def kv_bytes_per_token(m: ModelShape) -> float:
    """KV bytes one token adds in every layer that caches K/V (sliding windows not counted)."""
    return kv_elements_per_token_layer(m) * m.kv_layers * m.kv_bytes


def _layer_contexts(m: ModelShape, context: int) -> list[tuple[int, int]]:
    """(number of layers, tokens cached) groups: full-attention layers keep all `context`
    tokens, sliding layers at most the window."""
    groups = [(m.attention_layers - m.sliding_layers, context)]
    if m.sliding_layers:
        groups.append((m.sliding_layers, min(context, m.sliding_window)))
    return [(n, s) for n, s in groups if n]


def kv_bytes_per_sequence(m: ModelShape, seq_len: int) -> float:
    """KV bytes of one sequence of `seq_len` tokens (2 · bytes · S · K · H · L without MLA or
    sliding windows)."""
    per = kv_elements_per_token_layer(m) * m.kv_bytes
    return sum(_shared(m, n) * s * per for n, s in _layer_contexts(m, seq_len))


def state_bytes_per_sequence(m: ModelShape) -> float:
    """Recurrent state of one sequence over the Mamba layers (0 without): conv state
    (mamba_conv - 1) x conv channels at weight_bytes plus the SSM state heads x head_dim x state
    at state_bytes, per layer, whatever the sequence's length."""
    if not m.mamba_layers:
        return 0.0
    conv = m.mamba_conv_dim * (m.mamba_conv - 1) * m.weight_bytes
    ssm = m.mamba_heads * m.mamba_head_dim * m.mamba_state * m.state_bytes
    return m.mamba_layers * (conv + ssm)


def cache_bytes_per_sequence(m: ModelShape, seq_len: int) -> float:
    """What one sequence holds besides the weights: its KV cache and its recurrent state."""
    return kv_bytes_per_sequence(m, seq_len) + state_bytes_per_sequence(m)


def memory(m: ModelShape, batch: int, seq_len: int) -> float:
    """Bytes to serve `batch` sequences of `seq_len` tokens: weights + KV cache (+ recurrent state)."""
    return weight_memory(m) + batch * cache_bytes_per_sequence(m, seq_len)


def max_batch(m: ModelShape, hw: Hardware, seq_len: int) -> int:
    """Largest batch whose memory fits in `hw` (0 when the weights alone do not fit)."""
    free = hw.memory - weight_memory(m)
    return max(0, math.floor(free / cache_bytes_per_sequence(m, seq_len))) if free >= 0 else 0


# --- operations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpCost:
    """One operation summed over all layers: FLOPs and bytes moved."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP/byte."""
        return self.flops / self.bytes

    def time(self, hw: Hardware) -> float:
        """Roofline time in seconds: the slower of compute and memory traffic."""
        return max(self.flops / hw.flops, self.bytes / hw.bandwidth)

    def bound(self, hw: Hardware) -> str:
        return "compute" if self.intensity >= hw.intensity else "memory"

    def __add__(self, other: "OpCost") -> "OpCost":
        return OpCost(self.name, self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, k: float) -> "OpCost":
        return OpCost(self.name, self.flops * k, self.bytes * k)


def matmul(name: str, m: float, k: float, n: float, elem_bytes: float) -> OpCost:
    """`[m, k] x [k, n]`: 2mkn FLOPs, (mk + kn + mn) elements moved. With bf16 the intensity is
    mkn / (mk + kn + mn), about m when m << k, n."""
    return OpCost(name, 2 * m * k * n, elem_bytes * (m * k + k * n + m * n))


def attention_core(m: ModelShape, batch: int, new_tokens: int, context: int) -> OpCost:
    """Scores and weighted values over the cache, every layer. Per sequence and layer:
    4·N·H·T·S FLOPs; Q and output (T·N·H each) plus cached K and V (S·K·H each) moved. With MHA
    in bf16 the intensity is S·T/(S+T): the batch cancels (it is batched, not contracted).
    MLA (absorbed): scores over d_c + d_rope, values over d_c, one latent shared by all heads."""
    b, n, t = batch, m.heads, new_tokens
    total = OpCost("attention", 0.0, 0.0)
    for layers, s in _layer_contexts(m, context):
        if m.mla:
            flops = 2 * n * t * s * (2 * m.kv_latent + m.rope_dim)
            act = t * n * (2 * m.kv_latent + m.rope_dim)  # absorbed queries in, latent outputs out
        else:
            flops = 4 * n * m.head_dim * t * s
            act = 2 * t * n * m.head_dim
        cache = s * kv_elements_per_token_layer(m)
        total = total + OpCost("attention", flops, act * m.weight_bytes + cache * m.kv_bytes) * (b * layers)
    return total


def _moe_mlp(m: ModelShape, tokens: int) -> OpCost:
    """One MoE layer for `tokens` tokens: each expert is read once if any token picks it
    (expected count with uniform routing), every token computes its experts_per_token + shared."""
    e, k = m.experts, m.experts_per_token
    touched = e * (1 - (1 - k / e) ** tokens) + m.shared_experts
    mats, d, f, w = m.mlp_matrices, m.hidden, m.expert_intermediate, m.weight_bytes
    used = k + m.shared_experts
    flops = 2 * tokens * used * mats * d * f + 2 * tokens * d * e
    moved = w * (touched * mats * d * f + d * e + tokens * used * mats * (d + f) + tokens * d)
    return OpCost("mlp", flops, moved)


def step_costs(m: ModelShape, batch: int, new_tokens: int, context: int) -> list[OpCost]:
    """Per-operation cost of one forward step (all layers) for `batch` sequences of
    `new_tokens` new tokens each at `context` cached tokens. The LM head runs on the last
    token of each sequence only."""
    tokens, w = batch * new_tokens, m.weight_bytes
    d, n, h = m.hidden, m.heads, m.head_dim
    if m.mla:
        q_out = n * (h + m.rope_dim)
        q_first = m.q_latent or q_out  # q_a then q_b, or q directly
        qkv = (matmul("qkv_proj", tokens, d, q_first + m.kv_latent + m.rope_dim, w)
               + matmul("qkv_proj", tokens, m.kv_latent, 2 * n * h, w))  # kv_b, absorbed
        if m.q_latent:
            qkv = qkv + matmul("qkv_proj", tokens, m.q_latent, q_out, w)
    else:
        qkv = matmul("qkv_proj", tokens, d, (n + 2 * m.kv_heads) * h, w) * m.kv_layers
        if m.kv_layers < m.attention_layers:  # layers reusing K/V project queries only
            qkv = qkv + matmul("qkv_proj", tokens, d, n * h, w) * (m.attention_layers - m.kv_layers)
    dense_mlp = matmul("mlp", tokens, d, m.intermediate, w) * m.mlp_matrices
    mlp = dense_mlp * (m.layers - m.moe_layers)
    if m.moe_layers:
        mlp = mlp + _moe_mlp(m, tokens) * m.moe_layers
    ops = [
        qkv if not m.mla else qkv * m.layers,
        attention_core(m, batch, new_tokens, context),
        matmul("out_proj", tokens, n * h, d, w) * m.attention_layers,
        mlp,
        matmul("lm_head", batch, d, m.vocab, w),
    ]
    return ops + (mamba_costs(m, batch, new_tokens) if m.mamba_layers else [])


def mamba_costs(m: ModelShape, batch: int, new_tokens: int) -> list[OpCost]:
    """The Mamba layers of one step: their projections (in_proj, out_proj) and the scan. The scan
    in its recurrent form costs ~6·heads·head_dim·state FLOPs per token (decay, input, readout)
    and reads and writes each sequence's state once per step, whatever the context length."""
    tokens, w = batch * new_tokens, m.weight_bytes
    d, inner, conv = m.hidden, m.mamba_inner, m.mamba_conv_dim
    proj = matmul("mamba_proj", tokens, d, inner + conv + m.mamba_heads, w) + matmul("mamba_proj", tokens, inner, d, w)
    flops = 6 * tokens * m.mamba_heads * m.mamba_head_dim * m.mamba_state
    moved = 2 * batch * state_bytes_per_sequence(m) / m.mamba_layers + tokens * (conv + 2 * inner) * w
    return [proj * m.mamba_layers, OpCost("ssm_scan", flops, moved) * m.mamba_layers]


def step_time(ops: list[OpCost], hw: Hardware) -> float:
    """Seconds for one step: each operation at its own roofline."""
    return sum(op.time(hw) for op in ops)


def prefill_costs(m: ModelShape, batch: int, prompt_len: int) -> list[OpCost]:
    return step_costs(m, batch, prompt_len, prompt_len)


def decode_costs(m: ModelShape, batch: int, context: int) -> list[OpCost]:
    return step_costs(m, batch, 1, context)


# --- batch sweep -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    """Decode at context `seq_len` for `batch` sequences: memory (bytes), whether it fits, one
    step's latency (s, = time per output token) and throughput (output tokens/s)."""

    batch: int
    memory: float
    fits: bool
    step_time: float
    throughput: float
    bound: str  # "memory" or "compute": which side of the roofline dominates the step


def batch_point(m: ModelShape, hw: Hardware, batch: int, seq_len: int) -> SweepPoint:
    ops = decode_costs(m, batch, seq_len)
    t = step_time(ops, hw)
    compute = sum(op.flops for op in ops) / hw.flops
    traffic = sum(op.bytes for op in ops) / hw.bandwidth
    mem = memory(m, batch, seq_len)
    return SweepPoint(batch, mem, mem <= hw.memory, t, batch / t, "compute" if compute >= traffic else "memory")


def default_batches(m: ModelShape, hw: Hardware, seq_len: int, cap: int = 1 << 16) -> list[int]:
    """Powers of two from 1 up to the first batch that does not fit (at least 256)."""
    out, b = [], 1
    while b <= cap:
        out.append(b)
        if b >= 256 and memory(m, b, seq_len) > hw.memory:
            break
        b *= 2
    return out


def batch_sweep(m: ModelShape, hw: Hardware, seq_len: int, batches: list[int]) -> list[SweepPoint]:
    return [batch_point(m, hw, b, seq_len) for b in batches]


# --- KV variants -------------------------------------------------------------------------------


def attention_kind(m: ModelShape) -> str:
    """MHA, GQA (K=...), MQA or MLA (d_c=...)."""
    if m.mla:
        return f"MLA (d_c={m.kv_latent})"
    if m.kv_heads == m.heads:
        return f"MHA (K={m.heads})"
    return "MQA (K=1)" if m.kv_heads == 1 else f"GQA (K={m.kv_heads})"


def kv_variants(m: ModelShape) -> list[tuple[str, ModelShape]]:
    """The model as given (labelled "..., as configured") next to MHA, GQA (8 KV heads), MQA,
    MLA (d_c = 4·H, d_rope = H/2 as in DeepSeek-V2), K/V shared by pairs of layers (CLA) and 8-
    and 4-bit KV caches, no duplicates."""
    plain = replace(m, kv_latent=None, rope_dim=0) if m.mla else m
    cands = [(f"{attention_kind(m)}, as configured", m), (f"MHA (K={m.heads})", replace(plain, kv_heads=m.heads))]
    if m.heads % 8 == 0 and m.heads > 8:
        cands.append(("GQA (K=8)", replace(plain, kv_heads=8)))
    cands.append(("MQA (K=1)", replace(plain, kv_heads=1)))
    if not m.mla and not m.mamba_layers:  # (MLA attention beside Mamba layers: not a shape kvserve serves)
        cands.append((f"MLA (d_c={4 * m.head_dim})",
                      replace(m, kv_heads=m.heads, kv_latent=4 * m.head_dim, rope_dim=m.head_dim // 2)))
    if not m.mla and m.kv_share == 1:
        cands.append((f"{attention_kind(m)}, K/V shared by 2 layers (CLA)", replace(m, kv_share=2)))
    for bits in (8, 4):
        if bits / 8 < m.kv_bytes:
            cands.append((f"{attention_kind(m)}, {bits}-bit KV", replace(m, kv_bytes=bits / 8)))
    out, seen = [], set()
    for label, shape in cands:
        key = replace(shape, name="")
        if key not in seen:
            seen.add(key)
            out.append((label, shape))
    return out
