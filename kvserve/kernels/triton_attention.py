"""Paged attention on CUDA as Triton kernels: K/V read in place through the block tables.

Two kernels, the GPU counterparts of paged_attention.c and prefill_attention.c:

- `paged_decode`: one query token per sequence. Each program takes one (sequence, KV head,
  part) and walks a contiguous part of that sequence's attended positions [start, len), scoring
  the G query heads that share the KV head against every K row (GQA/MQA without repeated K/V).
  The parts' (max, sum, weighted V) are merged (flash-decoding) by the last of them to finish,
  which an atomic counter tells, so batch-1 decode spreads one context over many SMs in one
  launch; with one part (a batch that fills the SMs alone) the program writes the output itself.
  The number of parts is fixed per call and each program derives its range from `lens` in
  memory: a CUDA graph captured once replays for any context length.
- `paged_prefill`: one sequence's chunk of queries against its context, read through its slots
  (`SeqAttention.ctx_slots`), under the causal and sliding-window predicates.

Arithmetic is fp32 (dot products in IEEE fp32, no TF32), whatever the pool's dtype; bf16 pools
are read as bf16 and widened in registers. Under TRITON_INTERPRET=1 the same kernels run on the
CPU (numpy), which is how the tests hold them to the reference attention without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

# Positions per inner tile of decode (a part covers a whole number of tiles) at head_dim <= 64.
BLOCK_N = 64
# Query rows per prefill program.
BLOCK_M = 32
# Decode parts per (sequence, KV head) aim for this many programs per SM.
PROGRAMS_PER_SM = 2
MAX_PARTS = 32
# Partials (parts x head_dim, fp32) the last part of a decode context loads at once.
MERGE_ELEMENTS = 8192


@triton.jit
def _softmax_step(s, v, acc, m, l):
    """One tile of online softmax: scores s [M, N] (-inf where masked), values v [N, D] fp32,
    into the running weighted sum acc [M, D], max m [M] and sum l [M]."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A row that has seen nothing yet keeps m = -inf: shift by 0 there, not by -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _merge_parts(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, b, stride_ob, stride_oh, first_head, parts,
                 H: tl.constexpr, G: tl.constexpr, G0: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
                 MAX_PARTS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The outputs of sequence b's heads first_head + G0 .. + G0 + HEADS - 1 (those of its KV
    head's G) from their parts' partials, every load issued at once (one trip to L2, not one a
    head). The loads skip L1 (.cg): the partials were written by other SMs during this launch."""
    g = G0 + tl.arange(0, HEADS)
    h = first_head + g
    p = tl.arange(0, MAX_PARTS)
    d = tl.arange(0, BLOCK_D)
    ok = (g < G)[:, None] & (p < parts)[None, :]  # [HEADS, MAX_PARTS]
    row = (b * H + h)[:, None] * parts + p[None, :]
    m = tl.load(part_m_ptr + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_l_ptr + row, mask=ok, other=0.0, cache_modifier=".cg")
    acc = tl.load(part_out_ptr + row[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & (d < D)[None, None, :],
                  other=0.0, cache_modifier=".cg")
    m_all = tl.max(m, axis=1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # (a padding head: no part at all)
    w = tl.where(l > 0, tl.exp(m - m_all[:, None]), 0.0)  # empty parts weigh nothing
    total = tl.sum(l * w, axis=1)
    out = tl.sum(acc * w[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]  # [HEADS, BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None] & (d < D)[None, :])


# One compile for every part count and every eager step's tables: a view of [groups, B, width]
# at any offset, which Triton would otherwise specialise on (a width of 1 or a multiple of 16, a
# 16-byte-aligned address). Those pointers are read a scalar at a time: nothing to vectorise.
@triton.jit(do_not_specialize=["parts", "stride_tb"],
            do_not_specialize_on_alignment=["tables_ptr", "starts_ptr", "lens_ptr"])
def _decode_part_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, lens_ptr,
    part_out_ptr, part_m_ptr, part_l_ptr, arrived_ptr, out_ptr,
    scale,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh, parts,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KVH: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ONE_PART: tl.constexpr, MAX_PARTS: tl.constexpr, MERGE_HEADS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    start = tl.load(starts_ptr + b)
    length = tl.load(lens_ptr + b)
    # This part's positions: a contiguous run of whole tiles of [start, length).
    span = length - start
    per_part = tl.cdiv(tl.cdiv(span, parts), BLOCK_N) * BLOCK_N
    lo = start + part * per_part
    hi = tl.minimum(lo + per_part, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    g_ok = g < G
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + n
        ok = pos < hi
        block = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc, m, l = _softmax_step(s, v.to(tl.float32), acc, m, l)
    gd_ok = g_ok[:, None] & d_ok[None, :]
    if ONE_PART:  # the whole range was this program's: normalise and write the output itself
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gd_ok)
    else:
        # Partials [B, H, parts, (D)]; an empty part leaves m = -inf, l = 0.
        row = (b * H + heads) * parts + part
        tl.store(part_m_ptr + row, m, mask=g_ok)
        tl.store(part_l_ptr + row, l, mask=g_ok)
        tl.store(part_out_ptr + row[:, None] * D + d[None, :], acc, mask=gd_ok)
        # The last of the (sequence, KV head)'s parts to finish merges them (no second kernel).
        # Every thread's stores precede the barrier; the counter's release (one thread) then
        # publishes them all, and its acquire orders the last program's loads after the others'
        # stores. That program sets the counter back to 0 for the next launch.
        tl.debug_barrier()
        counter = arrived_ptr + b * KVH + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == parts - 1:
            for g0 in tl.static_range(0, G, MERGE_HEADS):
                _merge_parts(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, b, stride_ob, stride_oh, kvh * G, parts,
                             H=H, G=G, G0=g0, D=D, HEADS=MERGE_HEADS, MAX_PARTS=MAX_PARTS, BLOCK_D=BLOCK_D)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


# One compile for every chunk: its length and offsets, and its slots (a slice at any offset).
@triton.jit(do_not_specialize=["T", "first_kv", "first_q", "window"], do_not_specialize_on_alignment=["slots_ptr"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, out_ptr,
    T, first_kv, first_q, window, scale,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_ot, stride_oh,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    t = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < T
    d_ok = d < D
    q = tl.load(q_ptr + t[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_pos = first_q + t
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys this block of queries can see: [lo, hi) (causal end; window start when windowed).
    # (No runtime `if` reassigning a scalar: an argument equal to 1 is specialised to a constant.)
    q_first = first_q + mb * BLOCK_M
    hi = tl.minimum(q_first + BLOCK_M, first_q + T)
    windowed = window > 0
    lo = tl.maximum(first_kv, tl.where(windowed, q_first - window + 1, first_kv))
    lo = lo - (lo - first_kv) % BLOCK_N  # tiles aligned to the slots array
    n = tl.arange(0, BLOCK_N)
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + n
        ok = pos < hi
        slot = tl.load(slots_ptr + (pos - first_kv), mask=ok, other=0)
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
        see = (pos[None, :] <= q_pos[:, None]) & ok[None, :]
        see = see & ((pos[None, :] > q_pos[:, None] - window) | (window <= 0))
        s = tl.where(see, s, float("-inf"))
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc, m, l = _softmax_step(s, v.to(tl.float32), acc, m, l)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class Tiles:
    """Launch configuration of a kernel for one head width: positions per inner tile, warps,
    software-pipelining stages."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(head_dim: int) -> Tiles:
    """Head width 64 keeps the tiles measured on the H200 (4 warps, K/V loads pipelined over 2
    stages: ptxas spills 200 bytes a thread). At 128 and 256 those tiles spilled 6-9 KB a thread
    (sm_90, `ptxas -v`); 8 warps without pipelining spill nothing."""
    if head_dim <= 64:
        return Tiles(BLOCK_N, num_warps=4, num_stages=2)
    return Tiles(64 if head_dim <= 128 else 32, num_warps=8, num_stages=1)


def prefill_tiles(head_dim: int) -> Tiles:
    """As `decode_tiles`: at 128 and 256 the 32-query tiles spilled 14-20 KB a thread with 4
    warps and 2 stages; 8 warps, one stage and narrower key tiles spill nothing."""
    if head_dim <= 64:
        return Tiles(64, num_warps=4, num_stages=2)
    return Tiles(32 if head_dim <= 128 else 16, num_warps=8, num_stages=1)


def merge_heads(G: int, block_d: int) -> int:
    """Heads the last part merges at once: all G where their partials fit 8192 fp32 elements (64
    registers a thread at 4 warps), else fewer (a power of two)."""
    return max(1, min(_pow2(G), MERGE_ELEMENTS // (MAX_PARTS * block_d)))


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter on the CPU: any small number of programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_parts(batch: int, kv_heads: int, max_len: int | None, device: torch.device) -> int:
    """Parts per (sequence, KV head): enough programs to fill the SMs, never more than a context of
    max_len positions has tiles (max_len None: a graph's unknown lengths)."""
    sms = _num_sms(device)
    parts = -(-PROGRAMS_PER_SM * sms // (batch * kv_heads))
    if max_len is not None:
        parts = min(parts, -(-max_len // BLOCK_N))  # (64 positions a part at least)
    return min(MAX_PARTS, _pow2(parts))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 starts: torch.Tensor, lens: torch.Tensor, block_size: int, scale: float,
                 max_len: int | None = None, parts: int | None = None) -> torch.Tensor:
    """q [B, H, D]; k_pool, v_pool [slots, KVH, D]; tables [B, max_blocks] int32; starts, lens [B]
    int32 (sequence b attends positions [starts[b], lens[b])) -> [B, H, D] in q's dtype.

    `parts` (default: from the batch and max_len) fixes the grid; nothing else depends on the
    lengths' values, so the call can be captured in a CUDA graph."""
    B, H, D = q.shape
    kvh = k_pool.shape[1]
    G = H // kvh
    if parts is None:
        parts = decode_parts(B, kvh, max_len, q.device)
    if not 1 <= parts <= MAX_PARTS:
        raise ValueError(f"parts must be in [1, {MAX_PARTS}], got {parts}")
    out = torch.empty_like(q)
    if B == 0:
        return out
    one_part = parts == 1  # (a large batch fills the SMs alone: no partials, no merge)
    rows = 0 if one_part else B * H * parts
    part_out = torch.empty(rows, D, dtype=torch.float32, device=q.device)
    part_m = torch.empty(rows, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    arrived = part_m if one_part else arrival_counters(q.device, B * kvh)
    block_d = _pow2(D, 16)
    tiles = decode_tiles(D)
    _decode_part_kernel[(B, kvh, parts)](
        q, k_pool, v_pool, tables, starts, lens, part_out, part_m, part_l, arrived, out, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        tables.stride(0), out.stride(0), out.stride(1), parts, H=H, G=G, D=D, KVH=kvh, BLOCK_G=_pow2(G, 16),
        BLOCK_D=block_d, BLOCK_N=tiles.block_n, BLOCK_SIZE=block_size, ONE_PART=one_part, MAX_PARTS=MAX_PARTS,
        MERGE_HEADS=merge_heads(G, block_d),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


# Per device, every counter buffer made so far, the newest last: a captured graph keeps the
# address it was captured with, so a buffer outgrown is kept, never freed.
_arrived: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros that outlive the call: the parts of a (sequence, KV head) count
    their arrivals there, and the last sets its counter back to 0. One buffer per device, shared
    by every launch: launches on one stream run one after another. It grows outside CUDA graph
    capture only (a graph's warm-up runs its shapes first)."""
    bufs = _arrived.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"paged_decode needs {n} arrival counters during CUDA graph capture; "
                               "run the captured shapes once before capturing")
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def paged_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                  first_kv: int, first_q: int, window: int | None, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's queries q [T, H, D] (query t at position first_q + t) against the pool
    through slots [n] int64 (slots[j] holds position first_kv + j); query position x attends p in
    [first_kv, x], and p > x - window with a window. out: [T, H, D] to write into (any strides
    with unit stride on D). -> [T, H, D]."""
    T, H, D = q.shape
    G = H // k_pool.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if T == 0:
        return out
    tiles = prefill_tiles(D)
    # One tile height for every chunk (a short one's masked rows cost little: the K/V tiles are
    # read either way): a second height would be a second compile, in the middle of a run the first
    # time a chunk of 16 queries or fewer comes.
    _prefill_kernel[(triton.cdiv(T, BLOCK_M), H)](
        q, k_pool, v_pool, slots, out, T, first_kv, first_q, window or 0, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_D=_pow2(D, 16),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
