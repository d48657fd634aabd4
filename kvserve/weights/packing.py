"""Bit packing of 4-bit codes.

Two layouts of the same codes [N, K] (values 0..15, N = output rows, K = inputs):

* plain (`pack_int4` / `unpack_int4`): two codes per byte along K, the even column in the low
  nibble: byte[n, j] = codes[n, 2j] | codes[n, 2j + 1] << 4. Portable; what a saved folder holds.
* PyTorch's CPU int4 kernel layout (`to_cpu_int4_layout` / `from_cpu_int4_layout`), the output of
  `torch.ops.aten._convert_weight_to_int4pack_for_cpu` (torch 2.13) and the input of
  `_weight_int4pack_mm_for_cpu`: still [N, K/2] uint8, but the rows are tiled in blocks of B
  output rows (a last block of N % B rows, a multiple of 16), B depending on the instruction set
  PyTorch dispatches to: 64 with AVX-512, 32 with AVX2 (`cpu_int4_block_n` asks the op). Inside a
  B-row block the bytes run k-major, B/2 per input column k, and byte j of column k holds rows j
  (low nibble) and j + B/2 (high nibble). Inside the short last block of r rows, byte j of column
  k holds rows 2j and 2j + 1. The layout was read off the op and is checked against it bitwise in
  tests/test_quant_rtn.py, so a torch upgrade that changes it fails loudly; QuantLinear packs
  through the op itself and uses the functions here to read codes back. The layout is this
  machine's: a saved folder holds the plain one.
"""
from __future__ import annotations

from functools import lru_cache

import torch

CPU_INT4_ROW_MULTIPLE = 16  # the op rejects N % 16 != 0


@lru_cache(maxsize=None)
def cpu_int4_block_n() -> int:
    """Output rows per tile of the CPU int4 layout on this machine, read off the op (packing
    one code at row 0, column 1: it lands at byte B/2); 64 when this torch has no such op."""
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None:
        return 64
    codes = torch.zeros(64, 2, dtype=torch.int32)
    codes[0, 1] = 1
    return 2 * int(torch.nonzero(op(codes, 2).reshape(-1))[0])


def _check_codes(codes: torch.Tensor, who: str) -> None:
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"{who}: codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() < 1 or codes.shape[-1] % 2:
        raise ValueError(f"{who}: the last dimension (inputs) must be even to pack two codes per byte, "
                         f"got shape {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(f"{who}: codes must lie in [0, 15], got [{int(codes.min())}, {int(codes.max())}]")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] integer in [0, 15] (K even) -> uint8 [..., K/2], low nibble = even column."""
    _check_codes(codes, "pack_int4")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes [..., K] int32 (inverse of pack_int4)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: packed must be uint8, got {packed.dtype}")
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(torch.int32)


def check_cpu_int4_shape(n: int, k: int) -> None:
    """Raise ValueError unless [n, k] codes fit the CPU int4 layout."""
    if n % CPU_INT4_ROW_MULTIPLE:
        raise ValueError(f"CPU int4 layout: out_features must be a multiple of {CPU_INT4_ROW_MULTIPLE}, got {n}")
    if k % 2:
        raise ValueError(f"CPU int4 layout: in_features must be even, got {k}")


def to_cpu_int4_layout(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> uint8 [N, K/2] in the CPU kernel's tiled layout (pure torch;
    equal to `_convert_weight_to_int4pack_for_cpu(codes.int(), 2)`)."""
    _check_codes(codes, "to_cpu_int4_layout")
    if codes.dim() != 2:
        raise ValueError(f"to_cpu_int4_layout: codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
    n, k = codes.shape
    check_cpu_int4_shape(n, k)
    c = codes.to(torch.uint8)
    bn = cpu_int4_block_n()
    full = n - n % bn
    parts = []
    if full:
        blk = c[:full].reshape(full // bn, 2, bn // 2, k)  # row = b*bn + half*bn/2 + j
        parts.append((blk[:, 0] | (blk[:, 1] << 4)).transpose(1, 2).reshape(-1))  # [b, k, j]
    if n > full:
        tail = c[full:].reshape((n - full) // 2, 2, k)  # row = full + 2j + half
        parts.append((tail[:, 0] | (tail[:, 1] << 4)).t().reshape(-1))  # [k, j]
    return torch.cat(parts).reshape(n, k // 2)


def from_cpu_int4_layout(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the CPU kernel layout -> codes [N, K] int32 (inverse of to_cpu_int4_layout)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"from_cpu_int4_layout: expected 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    check_cpu_int4_shape(n, k)
    flat = packed.reshape(-1)
    bn = cpu_int4_block_n()
    full = n - n % bn
    rows = []
    if full:
        b = flat[: full * k // 2].reshape(full // bn, k, bn // 2).transpose(1, 2)  # [b, j, k]
        rows.append(torch.stack([b & 0x0F, b >> 4], dim=1).reshape(full, k))  # row b*bn + half*bn/2 + j
    if n > full:
        t = flat[full * k // 2:].reshape(k, (n - full) // 2).t()  # [j, k]
        rows.append(torch.stack([t & 0x0F, t >> 4], dim=1).reshape(n - full, k))  # row 2j + half
    return torch.cat(rows).to(torch.int32)


def cpu_int4_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Codes of some rows of a CPU-int4-layout weight: packed uint8 [N, K/2], rows [T] int64 ->
    codes [T, K] int32, equal to from_cpu_int4_layout(packed)[rows] without unpacking the rest
    (an embedding lookup from a quantized LM head reads T rows of a 262144-row table)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    bn = cpu_int4_block_n()
    hb = bn // 2
    full = n - n % bn
    r = rows.to(torch.int64)
    in_tail = r >= full
    rt = r - full
    # A bn-row block is [k, bn/2] bytes: byte j of column k holds rows j and j + bn/2 of the block.
    base = torch.where(in_tail, full * k // 2 + rt // 2, (r // bn) * hb * k + r % hb)
    stride = torch.where(in_tail, torch.full_like(r, max((n - full) // 2, 1)), torch.full_like(r, hb))
    shift = torch.where(in_tail, rt % 2, (r % bn) // hb) * 4
    idx = base[:, None] + torch.arange(k, dtype=torch.int64)[None, :] * stride[:, None]  # [T, K]
    return ((flat[idx].to(torch.int32) >> shift[:, None].to(torch.int32)) & 0x0F)


def cpu_int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> the CPU kernel's packed weight, through the torch op when this
    torch has it (the authority on its own layout), else the pure-torch equivalent."""
    _check_codes(codes, "cpu_int4_pack")
    check_cpu_int4_shape(*codes.shape)
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None:
        return to_cpu_int4_layout(codes)
    return op(codes.to(torch.int32).contiguous(), 2)
