"""The per-token glue of a decoder layer on CUDA as Triton kernels, one launch each.

In a decode step of a small model the matmuls are a few dozen kernels; the glue around them
(norms, residual adds, rotary embedding, the K/V write, the gated activation) is several hundred
tiny PyTorch kernels, each with its own launch and its own trip through memory. Each function
here does one piece of glue in one kernel, computing what the PyTorch ops of the model files
compute, with the same roundings to the activation dtype at the same places (so a bf16 step
differs from the PyTorch one only by the order of a norm's sum):

- `rms_norm`: Llama style `w * round(norm(x))`, Gemma style (`offset`) `round(norm(x) * (1 + w))`.
- `residual_norm`: `h = round(residual + x')` with x' = x or a norm of x, then a norm of h.
- `norm_rope`: an optional per-head norm (q/k norms), then the half-rotation rotary embedding.
- `qk_norm_rope`: the same for q and k in one launch, k into the KV pool at the step's slots
  with V beside it (the attention prologue of a decode step).
- `gated_act`: `round(round(act(gate)) * up)` for SiLU and GELU-tanh.

Under TRITON_INTERPRET=1 they run on the CPU, which is how the tests check them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_as(x, like):
    """x (fp32) rounded to nearest-even in the element type of the pointer `like`, back in fp32,
    as PyTorch rounds each op's result. bf16 by bit arithmetic: Triton's interpreter truncates
    in its fp32 -> bf16 cast, and the compiled kernel computes the same bits this way."""
    if like.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    if like.dtype.element_ty == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _normed(x, w, eps, n_cols, OFFSET: tl.constexpr, out_like):
    """An RMS norm of x [BLOCK] (fp32, zeros past n_cols) with weight w (fp32), rounded like the
    model's RMSNorm: Gemma's (1 + w) product in fp32, Llama's after rounding the normalized x."""
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if OFFSET:
        return round_as(x * r * (1.0 + w), out_like)
    return round_as(round_as(x * r, out_like) * w, out_like)


@triton.jit(do_not_specialize=["n_cols"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps,
                     OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _normed(x, w, eps, n_cols, OFFSET, out_ptr)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_cols"])
def _residual_norm_kernel(x_ptr, res_ptr, w1_ptr, w2_ptr, h_ptr, y_ptr, stride_x, stride_r, stride_h, stride_y,
                          n_cols, eps, NORM_X: tl.constexpr, OFFSET: tl.constexpr, SECOND: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    if NORM_X:
        w1 = tl.load(w1_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = _normed(x, w1, eps, n_cols, OFFSET, h_ptr)
    h = round_as(res + x, h_ptr)
    tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=ok)
    if SECOND:
        w2 = tl.load(w2_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = _normed(h, w2, eps, n_cols, OFFSET, y_ptr)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope_head(src, w_ptr, eps, cos_row, sin_row, dst, D: tl.constexpr, HALF_BLOCK: tl.constexpr,
                    NORM: tl.constexpr, OFFSET: tl.constexpr):
    """One head of D values at `src`: normed (NORM: over the whole head, weight w_ptr) and rotated
    by the half-rotation RoPE with the position's cos / sin rows, stored at `dst`."""
    half: tl.constexpr = D // 2
    i = tl.arange(0, HALF_BLOCK)
    ok = i < half
    x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + i, mask=ok, other=0.0).to(tl.float32)
    if NORM:  # over the whole head: both halves
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        w1 = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + i, mask=ok, other=0.0).to(tl.float32)
        if OFFSET:
            x1 = round_as(x1 * r * (1.0 + w1), dst)
            x2 = round_as(x2 * r * (1.0 + w2), dst)
        else:
            x1 = round_as(round_as(x1 * r, dst) * w1, dst)
            x2 = round_as(round_as(x2 * r, dst) * w2, dst)
    c1 = tl.load(cos_row + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half + i, mask=ok, other=0.0).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded as the PyTorch ops round them
    y1 = round_as(round_as(x1 * c1, dst) + round_as(-x2 * s1, dst), dst)
    y2 = round_as(round_as(x2 * c2, dst) + round_as(x1 * s2, dst), dst)
    tl.store(dst + i, y1.to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + half + i, y2.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _copy_head(src, dst, D: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < D
    tl.store(dst + i, tl.load(src + i, mask=ok, other=0.0).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, eps, stride_xt, stride_xh, stride_ct, stride_ot,
                      stride_oh, D: tl.constexpr, HALF_BLOCK: tl.constexpr, NORM: tl.constexpr,
                      OFFSET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _norm_rope_head(x_ptr + t * stride_xt + h * stride_xh, w_ptr, eps, cos_ptr + t * stride_ct,
                    sin_ptr + t * stride_ct, out_ptr + t * stride_ot + h * stride_oh, D, HALF_BLOCK, NORM, OFFSET)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])  # (a group's slots: a view at any offset)
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr,
                         slots_ptr, eps_q, eps_k, H,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                         stride_ot, stride_oh, stride_ps, stride_ph, stride_vps, stride_vph,
                         D: tl.constexpr, HALF_BLOCK: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                         OFFSET: tl.constexpr):
    """Programs (t, h): h < H a query head, into q_out; else KV head h - H: K normed and rotated
    into the K pool at slots[t], V copied beside it."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos_row = cos_ptr + t * stride_ct
    sin_row = sin_ptr + t * stride_ct
    if h < H:
        _norm_rope_head(q_ptr + t * stride_qt + h * stride_qh, wq_ptr, eps_q, cos_row, sin_row,
                        q_out_ptr + t * stride_ot + h * stride_oh, D, HALF_BLOCK, NORM, OFFSET)
    else:
        kh = h - H
        slot = tl.load(slots_ptr + t).to(tl.int64)
        _norm_rope_head(k_ptr + t * stride_kt + kh * stride_kh, wk_ptr, eps_k, cos_row, sin_row,
                        k_pool_ptr + slot * stride_ps + kh * stride_ph, D, HALF_BLOCK, NORM, OFFSET)
        _copy_head(v_ptr + t * stride_vt + kh * stride_vh, v_pool_ptr + slot * stride_vps + kh * stride_vph, D,
                   BLOCK)


@triton.jit
def gated(g, u, GELU_TANH: tl.constexpr, like):
    """round(round(act(g)) * u) in the element type of the pointer `like` (fp32 in, fp32 out):
    GELU-tanh or SiLU, as the model's PyTorch ops round them. Also the prologue of the down
    projection's matrix-vector kernel (kernels/triton_gemv.py)."""
    if GELU_TANH:
        # PyTorch's formula with an fp32 tanh (from exp(-2|z|): the interpreter has no tanh),
        # so even the far negative tail, where 1 + tanh cancels, rounds as PyTorch's does
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(z))
        tanh = (1.0 - e) / (1.0 + e)
        a = 0.5 * g * (1.0 + tl.where(z < 0, -tanh, tanh))
    else:
        a = g / (1.0 + tl.exp(-g))
    return round_as(round_as(a, like) * u, like)


@triton.jit(do_not_specialize=["n_cols"])
def _gated_act_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, n_cols,
                      GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    y = gated(g, u, GELU_TANH, out_ptr)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, d] with unit stride along d (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., d] -> the same shape and dtype."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), x2.shape[1], eps,
                                         OFFSET=offset, BLOCK=_block(x2.shape[1]))
    return out.view(x.shape)


def residual_norm(x: torch.Tensor, residual: torch.Tensor, eps: float, offset: bool,
                  w1: torch.Tensor | None, w2: torch.Tensor | None):
    """h = residual + (x, or norm(x) with w1), rounded to the dtype; with w2 also norm(h) with w2:
    -> h, or (h, norm(h)). x, residual [..., d] of one shape."""
    x2, r2 = _rows(x), _rows(residual)
    h = torch.empty(x2.shape, dtype=residual.dtype, device=x.device)
    y = torch.empty_like(h) if w2 is not None else h
    if x2.shape[0]:
        _residual_norm_kernel[(x2.shape[0],)](
            x2, r2, w1 if w1 is not None else x2, w2 if w2 is not None else x2, h, y, x2.stride(0), r2.stride(0),
            h.stride(0), y.stride(0), x2.shape[1], eps, NORM_X=w1 is not None, OFFSET=offset,
            SECOND=w2 is not None, BLOCK=_block(x2.shape[1]))
    h = h.view(residual.shape)
    return h if w2 is None else (h, y.view(residual.shape))


def norm_rope(x: torch.Tensor, norm: tuple[torch.Tensor, float, bool] | None, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (unit stride along D) -> [T, heads, D], each head normed (norm = (weight,
    eps, offset), or None) and rotated (cos, sin [T, D])."""
    T, heads, D = x.shape
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    weight, eps, offset = norm if norm is not None else (x, 0.0, False)
    _norm_rope_kernel[(T, heads)](x, weight, cos, sin, out, eps, x.stride(0), x.stride(1), cos.stride(0),
                                  out.stride(0), out.stride(1), D=D, HALF_BLOCK=_block(D // 2),
                                  NORM=norm is not None, OFFSET=offset)
    return out


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm, k_norm, cos: torch.Tensor,
                 sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """An attention prologue in one launch: q [T, H, D] -> normed (q_norm = (weight, eps, offset)
    or None) and rotated [T, H, D]; k [T, KVH, D] likewise (k_norm) into k_pool [slots, KVH, D] at
    slots[t], v [T, KVH, D] into v_pool beside it. Unit stride along D everywhere; q_norm and k_norm
    both given (with one offset style) or both None."""
    T, H, D = q.shape
    KVH = k.shape[1]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    wq, eps_q, offset = q_norm if q_norm is not None else (q, 0.0, False)
    wk, eps_k, _ = k_norm if k_norm is not None else (k, 0.0, False)
    _qk_norm_rope_kernel[(T, H + KVH)](
        q, k, v, wq, wk, cos, sin, out, k_pool, v_pool, slots, eps_q, eps_k, H,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        out.stride(0), out.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        D=D, HALF_BLOCK=_block(D // 2), BLOCK=_block(D), NORM=q_norm is not None, OFFSET=offset)
    return out


def gated_act(gate: torch.Tensor, up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """act(gate) * up for [..., n] of one shape (views with unit stride along n) -> contiguous."""
    g2, u2 = _rows(gate), _rows(up)
    rows, n = g2.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    block = min(1024, _block(n))
    if rows:
        _gated_act_kernel[(rows, triton.cdiv(n, block))](g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n,
                                                         GELU_TANH=gelu_tanh, BLOCK=block)
    return out.view(gate.shape)
