"""StreamingLLM attention: attention sinks plus a recent window, positions assigned inside the cache.

A layer's cache holds K/V *before* RoPE. Token-by-token, the StreamingLLM cache after token i has
been appended holds the first `sinks` tokens of the stream and the last `window` tokens (i itself
included); the cached keys are rotated by their rank in the cache (0 .. len-1) and the query by
its own rank, min(i, sinks + window - 1).

RoPE scores depend only on the query-key position difference, so that rule reduces to:

* a window key j is seen at distance i - j (its original distance: ranks inside the window are
  consecutive, like the stream positions they replace);
* a sink key s is seen at distance min(i, sinks + window - 1) - s (compressed once the window
  has moved on; identical to i - s before that).

Both facts hold for every query of a chunk at once, which is what makes chunked evaluation
exact: queries and window keys of one chunk are rotated by their stream positions minus one
shift per chunk (`chunk_shift`, which keeps the rotation angles as small as ranks are), and the
sink keys by their rank against the query rotated by its rank, in a separate score block. Each
token's K/V at a layer then depend only on that token's own view of the stream, exactly as in
token-by-token streaming.

`StreamingAttention` is the `AttentionMetadata.custom` callable (kvserve/model/attention.py):
the model's own layers compute the projections and norms, this module owns cache and rotation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.layers import RotaryEmbedding, apply_rope


@dataclass(frozen=True)
class StreamPolicy:
    """What one layer keeps and how it numbers positions.

    sinks: the first tokens of the stream, kept for good (attention sinks).
    window: the most recent tokens kept, the current one included; None keeps every token
        (full attention, the model's own behaviour).
    in_cache: RoPE positions are ranks inside the cache (StreamingLLM) rather than stream
        positions. Needs a bounded window.
    """

    sinks: int = 0
    window: int | None = None
    in_cache: bool = False

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if (self.sinks or self.in_cache) and self.window is None:
            raise ValueError("sinks and in-cache positions need a bounded window")

    @property
    def capacity(self) -> int | None:
        """Most tokens the cache holds once a token is appended (None: unbounded)."""
        return None if self.window is None else self.sinks + self.window


def chunk_shift(first: int, policy: StreamPolicy) -> int:
    """Subtracted from the stream positions of a chunk's queries and window keys, the chunk's
    first query being at stream position `first`.

    With in-cache positions that first query lands exactly on its rank min(first, capacity - 1);
    later queries of the chunk and every window key keep their true distances (RoPE is
    relative). Without, positions are the stream's own.
    """
    if not policy.in_cache:
        return 0
    return max(0, first - (policy.capacity - 1))


def query_ranks(q_pos: torch.Tensor, policy: StreamPolicy) -> torch.Tensor:
    """q_pos [T] stream positions -> [T] ranks in a StreamingLLM cache: min(i, capacity - 1)."""
    return q_pos.clamp(max=policy.capacity - 1)


class LayerCache:
    """One layer's pre-RoPE K/V: a sink store and a window store with stream positions."""

    def __init__(self, policy: StreamPolicy):
        self.policy = policy
        self.sink_k: torch.Tensor | None = None  # [n_sink, KVH, D]
        self.sink_v: torch.Tensor | None = None
        self.k: torch.Tensor | None = None  # [L, KVH, D]
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None  # [L] int64 stream positions, increasing

    @property
    def num_sinks(self) -> int:
        return 0 if self.sink_k is None else int(self.sink_k.shape[0])

    @property
    def num_tokens(self) -> int:
        return self.num_sinks + (0 if self.k is None else int(self.k.shape[0]))

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.sink_k, self.sink_v, self.k, self.v) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v [T, KVH, D] (pre-RoPE), pos [T]: the chunk's tokens, in stream order."""
        n_sink = max(0, min(self.policy.sinks - int(pos[0]), int(pos.shape[0])))  # chunk tokens that are sinks
        if n_sink:
            self.sink_k = _cat(self.sink_k, k[:n_sink])
            self.sink_v = _cat(self.sink_v, v[:n_sink])
        self.k, self.v = _cat(self.k, k[n_sink:]), _cat(self.v, v[n_sink:])
        self.pos = _cat(self.pos, pos[n_sink:])

    def evict(self, next_pos: int) -> None:
        """Drop window tokens that no query at `next_pos` or later can see: keep the last
        window - 1 (the next token completes the window)."""
        if self.policy.window is None or self.pos is None:
            return
        keep = self.pos > next_pos - self.policy.window
        if not bool(keep.all()):
            first = int(keep.long().argmax()) if bool(keep.any()) else int(keep.shape[0])
            # Views suffice: the next append's torch.cat allocates a fresh, bounded buffer.
            self.k, self.v, self.pos = self.k[first:], self.v[first:], self.pos[first:]


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new.clone() if old is None else torch.cat([old, new])


def stream_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache: LayerCache,
    rotary: RotaryEmbedding,
    scale: float,
) -> torch.Tensor:
    """Attention of a chunk's queries over a cache that already holds the chunk's own K/V.

    q [T, H, D] pre-RoPE, q_pos [T] consecutive stream positions -> [T, H, D] (q's dtype).
    """
    return attend_sinks_and_window(q, q_pos, cache.policy, cache.sink_k, cache.sink_v, cache.k, cache.v, cache.pos,
                                   rotary, scale)


def attend_sinks_and_window(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    policy: StreamPolicy,
    sink_k: torch.Tensor | None,
    sink_v: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    rotary: RotaryEmbedding,
    scale: float,
) -> torch.Tensor:
    """StreamingLLM attention of a chunk over explicit pre-RoPE K/V.

    q [T, H, D], q_pos [T] consecutive stream positions; sink_k, sink_v [n_sink, KVH, D] the
    stream's first tokens (None or empty: no sinks); k, v [L, KVH, D] window tokens at stream
    positions k_pos [L] (increasing, every one >= policy.sinks), the chunk's own included.
    -> [T, H, D] in q's dtype. Scores, softmax and the value sum run in fp32. A query at i sees
    the sinks s <= i and the window keys j with i - window < j <= i.
    """
    dtype, f32 = q.dtype, torch.float32
    q = q.float()
    shift = chunk_shift(int(q_pos[0]), policy)
    q_win = _rotate(q, q_pos - shift, rotary)
    k_win = _rotate(k.float(), k_pos - shift, rotary)
    visible = k_pos[None, :] <= q_pos[:, None]  # [T, L]
    if policy.window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - policy.window
    scores = [_grouped_scores(q_win, k_win)]
    masks, values = [visible], [v.float()]
    num_sinks = 0 if sink_k is None else int(sink_k.shape[0])
    if num_sinks:
        sink_pos = torch.arange(num_sinks, device=q.device)  # a sink's rank is its position
        q_sink = _rotate(q, query_ranks(q_pos, policy), rotary)
        k_sink = _rotate(sink_k.float(), sink_pos, rotary)
        scores.insert(0, _grouped_scores(q_sink, k_sink))
        masks.insert(0, sink_pos[None, :] <= q_pos[:, None])
        values.insert(0, sink_v.float())
    s = torch.cat(scores, dim=-1) * scale  # [KVH, G*T, n_keys]
    G = q.shape[1] // k.shape[1]
    mask = torch.cat(masks, dim=-1).repeat(G, 1)  # rows ordered (group, query) like the scores
    s = s.masked_fill(~mask, float("-inf"))
    out = torch.softmax(s, dim=-1, dtype=f32) @ torch.cat(values).transpose(0, 1)  # [KVH, G*T, D]
    T, H, D = q.shape
    return out.view(-1, G, T, D).permute(2, 0, 1, 3).reshape(T, H, D).to(dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """x [T, heads, D] rotated by RoPE at `positions` [T] (fp32)."""
    cos, sin = rotary.cos_sin(positions, x.dtype)
    return apply_rope(x, cos, sin)


def _grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k [L, KVH, D] -> raw scores [KVH, G*T, L] (G = H / KVH query heads per K/V
    head as extra rows, so GQA/MQA never repeats K)."""
    T, H, D = q.shape
    kvh = k.shape[1]
    qg = q.view(T, kvh, H // kvh, D).permute(1, 2, 0, 3).reshape(kvh, -1, D)
    return qg @ k.permute(1, 2, 0)


def layer_policies(cfg: ModelConfig, sinks: int = 0, window: int | None = None) -> list[StreamPolicy]:
    """Per-layer policies for a method.

    window None: the model's own attention (global layers see everything, sliding layers their
    native window, stream positions). Otherwise StreamingLLM with `sinks` + `window` tokens: the
    global layers keep exactly that; a sliding layer keeps its last min(native, sinks + window)
    tokens and no sinks (the same memory budget; it never attends far back natively, so it has no
    sink to lose), positions in its cache.
    """
    if window is None:
        return [StreamPolicy(window=cfg.window(i)) for i in range(cfg.num_layers)]
    out = []
    for i in range(cfg.num_layers):
        native = cfg.window(i)
        if native is None:
            out.append(StreamPolicy(sinks=sinks, window=window, in_cache=True))
        else:
            out.append(StreamPolicy(window=min(native, sinks + window), in_cache=True))
    return out


@dataclass
class CacheSize:
    """Cache occupancy at the peak of one chunk (after its K/V were appended)."""

    position: int  # stream position of the chunk's first token
    max_layer_tokens: int  # the fullest layer
    total_bytes: int  # all layers


class StreamingAttention:
    """The `AttentionMetadata.custom` callable: one `LayerCache` per layer under its policy.

    Call `begin(positions)` before each forward pass over a chunk; the caches are evicted down to
    what the next chunk needs at the end of each layer's call, so a layer never holds more than
    sinks + window - 1 + chunk tokens.
    """

    def __init__(self, rotary: list[RotaryEmbedding], policies: list[StreamPolicy]):
        if len(rotary) != len(policies):
            raise ValueError(f"{len(rotary)} rotary tables for {len(policies)} layer policies")
        self.rotary = rotary
        self.caches = [LayerCache(p) for p in policies]
        self.positions: torch.Tensor | None = None
        self.sizes: list[CacheSize] = []

    @classmethod
    def for_model(cls, model, policies: list[StreamPolicy]) -> "StreamingAttention":
        """model: a CausalLM (its per-layer-type rotary tables are shared, not copied)."""
        return cls([model.rotary[t] for t in model.config.layer_types], policies)

    def begin(self, positions: torch.Tensor) -> None:
        """positions [T]: the next chunk's consecutive stream positions."""
        if self.positions is not None and int(positions[0]) != int(self.positions[-1]) + 1:
            raise ValueError(f"chunk starts at {int(positions[0])}, expected {int(self.positions[-1]) + 1}")
        self.positions = positions
        self.sizes.append(CacheSize(int(positions[0]), 0, 0))

    def __call__(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """layer: the calling `Attention`; q [T, H, D], k, v [T, KVH, D] pre-RoPE -> [T, H, D]."""
        cache = self.caches[layer.layer]
        cache.append(k, v, self.positions)
        size = self.sizes[-1]
        size.max_layer_tokens = max(size.max_layer_tokens, cache.num_tokens)
        size.total_bytes += cache.nbytes
        out = stream_attention(q, self.positions, cache, self.rotary[layer.layer], layer.scale)
        cache.evict(int(self.positions[-1]) + 1)
        return out


class PagedStreamingAttention:
    """The `AttentionMetadata.custom` callable of the engine's StreamingLLM mode
    (`EngineConfig.attention_sinks` / `streaming_window`).

    K/V live in the engine's paged pool, keys BEFORE RoPE (so every step can rotate them by
    their rank in the cache, as `attend_sinks_and_window` does). Per sequence, a layer reads
    its sinks (positions [0, sinks)) and its window (the last `window` positions up to each
    query); the block manager has released the blocks between them, whose table entries only
    ever reach `ctx_slots` as placeholders that are never read here. Decodes come as
    one-token chunks (the runner builds a `SeqAttention` for every sequence in this mode).
    """

    def __init__(self, kv_cache, meta, positions: torch.Tensor, policies: list[StreamPolicy],
                 rotary: list[RotaryEmbedding]):
        """kv_cache: the engine's KVCache; meta: the step's AttentionMetadata (without
        `custom`); positions [T]: stream positions of the step's tokens."""
        self.kv_cache, self.meta, self.positions = kv_cache, meta, positions
        self.policies, self.rotary = policies, rotary

    def __call__(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """layer: the calling `Attention`; q [T, H, D], k, v [T, KVH, D] pre-RoPE -> [T, H, D]."""
        cache = self.kv_cache
        meta = self.meta.for_group(cache.group_of(layer.layer))
        cache.write(layer.layer, meta.slot_mapping, k, v)
        policy, rotary = self.policies[layer.layer], self.rotary[layer.layer]
        out = torch.empty_like(q)
        for s in meta.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            first_q = s.ctx_len - s.q_len
            num_sinks = min(policy.sinks, s.ctx_len)
            lo = max(policy.sinks, first_q - policy.window + 1) if policy.window is not None else policy.sinks
            lo = min(lo, s.ctx_len)
            sink_k, sink_v = cache.read(layer.layer, s.ctx_slots[:num_sinks])
            win_k, win_v = cache.read(layer.layer, s.ctx_slots[lo:])
            out[rows] = attend_sinks_and_window(
                q[rows], self.positions[rows], policy, sink_k, sink_v, win_k, win_v,
                torch.arange(lo, s.ctx_len, device=q.device), rotary, layer.scale,
            ).to(q.dtype)
        return out
