"""The CUDA attention kernels (kvserve/kernels/triton_attention.py), run by Triton's interpreter
on the CPU, against attention computed the plain way (gather, masked softmax, fp64) on random
paged inputs: ragged lengths, sliding windows, block tables with released (-1) entries and
scattered pages, MHA / GQA / MQA, fp32 and bf16 pools. Where CUDA is available (the GPU check's
machine) the same tests run the compiled kernels on the GPU."""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before the import below

from kvserve.kernels import triton_attention as ta  # noqa: E402


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
              window: int | None, scale: float) -> torch.Tensor:
    """q [T, H, D] at q_pos [T]; k, v [n, KVH, D] at kv_pos [n] -> [T, H, D] in fp64."""
    H, KVH = q.shape[1], k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(H // KVH, 1), v.double().repeat_interleave(H // KVH, 1)
    s = torch.einsum("thd,nhd->htn", q, k) * scale
    see = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        see &= kv_pos[None, :] > q_pos[:, None] - window
    p = torch.softmax(s.masked_fill(~see, float("-inf")), dim=-1)
    return torch.einsum("htn,nhd->thd", p, v)


def paged_batch(gen: torch.Generator, lens: list[int], window: int | None, block_size: int, num_blocks: int):
    """Block tables over scattered pages for sequences of `lens` tokens; blocks wholly before a
    sequence's window start are released (-1), as a sliding layer group leaves them."""
    width = max(-(-n // block_size) for n in lens) + 2  # trailing padding the kernel never reads
    pages = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    starts = torch.tensor([0 if window is None else max(0, n - window) for n in lens], dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // block_size)
        tables[b, :need] = pages[used:used + need].to(torch.int32)
        used += need
        tables[b, : int(starts[b]) // block_size] = -1
    assert used <= num_blocks
    return tables, starts, torch.tensor(lens, dtype=torch.int32)


DECODE_CASES = [  # (heads, kv heads, head_dim, block size, lens, window, pool dtype)
    (4, 4, 32, 16, [1, 17, 70, 200], None, torch.float32),  # MHA, ragged
    (8, 2, 64, 16, [5, 129, 33], None, torch.float32),  # GQA
    (4, 1, 256, 16, [300, 3], 64, torch.float32),  # MQA, Gemma's head_dim, a window with released blocks
    (6, 2, 40, 8, [90, 41, 7, 250], 50, torch.float32),  # head_dim not a power of two, small blocks
    (4, 1, 64, 16, [130, 64, 1], None, torch.bfloat16),  # a bf16 pool and query
    (8, 2, 128, 16, [100, 7], None, torch.bfloat16),  # Llama-8B / Qwen3's head_dim (its own tiles)
]


@pytest.mark.parametrize("H,KVH,D,bs,lens,window,dtype", DECODE_CASES)
def test_paged_decode_matches_reference(H, KVH, D, bs, lens, window, dtype):
    gen = torch.Generator().manual_seed(len(lens) * 1000 + D)
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    tables, starts, lens_t = paged_batch(gen, lens, window, bs, num_blocks)
    k_pool = torch.randn(num_blocks * bs, KVH, D, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks * bs, KVH, D, generator=gen).to(dtype)
    q = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    scale = D ** -0.5
    out = ta.paged_decode(*on_device(q, k_pool, v_pool, tables, starts, lens_t), bs, scale, max_len=max(lens)).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    for b, n in enumerate(lens):
        pos = torch.arange(int(starts[b]), n)
        slots = tables[b].long()[pos // bs] * bs + pos % bs
        want = reference(q[b:b + 1], k_pool[slots], v_pool[slots], torch.tensor([n - 1]), pos, window, scale)[0]
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        torch.testing.assert_close(out[b].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 32])
def test_paged_decode_any_number_of_parts(parts):
    """A CUDA graph fixes the grid (parts) while the lengths change: every part count, more parts
    than a short context has tiles included, gives the same attention."""
    gen = torch.Generator().manual_seed(parts)
    lens = [1, 65, 300]
    tables, starts, lens_t = paged_batch(gen, lens, None, 16, 40)
    k_pool, v_pool = torch.randn(640, 2, 32, generator=gen), torch.randn(640, 2, 32, generator=gen)
    q = torch.randn(3, 4, 32, generator=gen)
    inputs = on_device(q, k_pool, v_pool, tables, starts, lens_t)
    got = ta.paged_decode(*inputs, 16, 0.2, parts=parts)
    want = ta.paged_decode(*inputs, 16, 0.2, parts=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_decode_parts_leave_their_counters_at_zero():
    """The last part of a (sequence, KV head) to arrive merges and zeroes its counter: a replayed
    graph's next launch counts from 0 again, and a buffer outgrown stays alive for the graphs
    captured with it."""
    gen = torch.Generator().manual_seed(7)
    lens = [40, 3, 200, 129]
    tables, starts, lens_t = paged_batch(gen, lens, None, 16, 40)
    k_pool, v_pool = torch.randn(640, 2, 32, generator=gen), torch.randn(640, 2, 32, generator=gen)
    q = torch.randn(4, 4, 32, generator=gen)
    inputs = on_device(q, k_pool, v_pool, tables, starts, lens_t)
    first = ta.paged_decode(*inputs, 16, 0.2, parts=4)
    counters = ta.arrival_counters(first.device, 0)
    assert counters.count_nonzero() == 0
    torch.testing.assert_close(ta.paged_decode(*inputs, 16, 0.2, parts=4), first, atol=0, rtol=0)
    grown = ta.arrival_counters(first.device, counters.numel() + 1)
    assert grown.numel() > counters.numel() and ta._arrived[first.device][-2] is counters


PREFILL_CASES = [  # (heads, kv heads, head_dim, first_kv, first_q, T, window)
    (4, 4, 32, 0, 0, 37, None),  # a whole prompt
    (8, 2, 64, 0, 50, 45, None),  # a later chunk of a prompt (queries after cached positions)
    (4, 1, 256, 0, 0, 70, 16),  # MQA, Gemma's head_dim, a window shorter than the prompt
    (6, 2, 40, 23, 60, 33, 30),  # a window whose start released the first positions (first_kv > 0)
    (4, 2, 64, 0, 0, 1, None),  # a single query
    (4, 2, 128, 0, 10, 40, None),  # head_dim 128 (its own tiles), a chunk after cached positions
]


@pytest.mark.parametrize("H,KVH,D,first_kv,first_q,T,window", PREFILL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_matches_reference(H, KVH, D, first_kv, first_q, T, window, dtype):
    gen = torch.Generator().manual_seed(H * 100 + T)
    ctx = first_q + T
    pool = ctx + 64
    slots = torch.randperm(pool, generator=gen)[: ctx - first_kv]  # scattered slots, any order
    k_pool = torch.randn(pool, KVH, D, generator=gen).to(dtype)
    v_pool = torch.randn(pool, KVH, D, generator=gen).to(dtype)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    out = torch.full((T + 3, H, D), float("nan"), dtype=dtype, device=DEVICE)[1:T + 1]  # a view with an offset
    got = ta.paged_prefill(*on_device(q, k_pool, v_pool, slots), first_kv, first_q, window, D ** -0.5, out=out)
    assert got.data_ptr() == out.data_ptr()
    got = got.cpu()
    want = reference(q, k_pool[slots], v_pool[slots], torch.arange(first_q, ctx), torch.arange(first_kv, ctx),
                     window, D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
