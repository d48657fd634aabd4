"""Matrix-vector products of a decode step on CUDA as Triton kernels: y = x @ W^T (+ b) for a
few rows of x, and the down projection with the gated activation as its prologue.

At batch 1 a decoder layer's matmuls are matrix-vector products that stream the weight once.
cuBLAS reads the big ones near the bandwidth bound, but a Llama-1B step's small ones (q/k/v, o;
8-13 MB) ran at 40-60% of it on an H200, and the activation between the MLP's two matmuls is a
kernel of its own. Here each program streams BLOCK_N whole weight rows in BLOCK_K-wide tiles
(fp32 products summed elementwise, reduced once at the end) for up to BLOCK_M rows of x at
once, so the weight is read once for the rows. `gated_gemv` computes act(gate) * up (kernels/triton_ops.gated, the same
roundings as the separate kernel) for each tile of x as it loads it: the activation's kernel
and its trip through memory go.

Which tiles stream fastest depends on the GPU and the matrix: the engine times these configs
against cuBLAS on the model's own weights, inside CUDA graphs, and keeps the fastest per weight
shape (kvserve/accel/cuda_gemv.py). Each output row is computed alone, in one order: a row's
result does not depend on the other rows of its bucket (one row, or two to four).

Under TRITON_INTERPRET=1 they run on the CPU, which is how the tests check them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_ops import gated, round_as

MAX_ROWS = 4  # rows of x a launch takes: decode batches of 1-4 (larger batches are matmuls)


@dataclass(frozen=True)
class GemvConfig:
    """One tiling: BLOCK_N weight rows a program, BLOCK_K columns a tile (for one row of x; four
    rows take a quarter of the columns, so a tile's products fit the same registers)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"n{self.block_n}-k{self.block_k}-w{self.num_warps}"


# 16-32 KB of bf16 weight a tile: enough bytes in flight a program to stream near the bound.
CONFIGS = (GemvConfig(8, 1024), GemvConfig(16, 512), GemvConfig(16, 1024, 8), GemvConfig(4, 2048),
           GemvConfig(32, 256))


@triton.jit
def _gemv_kernel(x_ptr, u_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_um, stride_wn, stride_wk, stride_om,
                 ACT: tl.constexpr, GELU_TANH: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, m): out[m-block, n-block] = x[m-block] @ w[n-block]^T (+ b); with ACT, x is
    gated(x, u) tile by tile."""
    # Every tile is 3-D, [BLOCK_M, BLOCK_N, BLOCK_K], the weight's broadcast over the rows of x
    # and x's over the weight rows, so products accumulate elementwise in one register layout
    # and reduce once after the loop (no layout change or cross-thread sum inside it).
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n3 = rows_n[None, :, None]
    m3 = rows_m[:, None, None]
    n_ok = n3 < N
    m_ok = m3 < M
    w_rows = w_ptr + n3.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k3 = (k0 + tl.arange(0, BLOCK_K))[None, None, :]
        k_ok = k3 < K
        w = tl.load(w_rows + k3 * stride_wk, mask=n_ok & k_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + m3 * stride_xm + k3, mask=m_ok & k_ok, other=0.0).to(tl.float32)
        if ACT:  # (masked columns: gated(0, 0) = 0)
            u = tl.load(u_ptr + m3 * stride_um + k3, mask=m_ok & k_ok, other=0.0).to(tl.float32)
            x = gated(x, u, GELU_TANH, out_ptr)
        acc += x * w
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_n, mask=rows_n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows_m[:, None] * stride_om + rows_n[None, :]  # (rounded to nearest-even, interpreted too)
    tl.store(out, round_as(y, out_ptr).to(out_ptr.dtype.element_ty), mask=(rows_m[:, None] < M) & (rows_n[None, :] < N))


def _launch(x: torch.Tensor, u: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
            config: GemvConfig, gelu_tanh: bool) -> torch.Tensor:
    """x (and u) [M, K] with unit stride along K, weight [N, K] (unit stride along K on CUDA, where
    Triton specializes a stride of 1; the CPU's fp32 weights are column-major) -> [M, N]."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m = 1 if M == 1 else MAX_ROWS
    block_k = max(32, min(config.block_k // block_m, triton.next_power_of_2(K)))
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(M, block_m))
    _gemv_kernel[grid](x, u if u is not None else x, weight, bias if bias is not None else weight, out, M, N, K,
                       x.stride(0), (u if u is not None else x).stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                       ACT=u is not None, GELU_TANH=gelu_tanh, HAS_BIAS=bias is not None, BLOCK_M=block_m,
                       BLOCK_N=config.block_n, BLOCK_K=block_k, num_warps=config.num_warps,
                       num_stages=config.num_stages)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype."""
    y = _launch(_rows(x), None, weight, bias, config, False)
    return y.view(*x.shape[:-1], weight.shape[0])


def gated_gemv(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               gelu_tanh: bool, config: GemvConfig) -> torch.Tensor:
    """(act(gate) * up) @ weight^T (+ bias) for gate, up [..., K] of one shape (views with unit
    stride along K, e.g. the halves of the fused gate/up output) -> [..., N]; act is GELU-tanh or
    SiLU, rounded as the separate activation kernel rounds it."""
    y = _launch(_rows(gate), _rows(up), weight, bias, config, gelu_tanh)
    return y.view(*gate.shape[:-1], weight.shape[0])
