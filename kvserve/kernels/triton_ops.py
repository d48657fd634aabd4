"""The per-token glue of a decoder layer on CUDA as Triton kernels, one launch each.

In a decode step of a small model the matmuls are a few dozen kernels; the glue around them
(norms, residual adds, rotary embedding, the K/V write, the gated activation) is several hundred
tiny PyTorch kernels, each with its own launch and its own trip through memory. Each function
here does one piece of glue in one kernel, computing what the PyTorch ops of the model files
compute, with the same roundings to the activation dtype at the same places (so a bf16 step
differs from the PyTorch one only by the order of a norm's sum):

- `rms_norm`: Llama style `w * round(norm(x))`, Gemma style (`offset`) `round(norm(x) * (1 + w))`.
- `residual_norm`: `h = round(residual + x')` with x' = x or a norm of x, then a norm of h.
- `norm_rope`: an optional per-head norm (q/k norms), then the half-rotation rotary embedding,
  into an output tensor or into the KV pool at the step's slots (with V beside it).
- `gated_act`: `round(round(act(gate)) * up)` for SiLU and GELU-tanh.

Under TRITON_INTERPRET=1 they run on the CPU, which is how the tests check them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, like):
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
        return _round(x * r * (1.0 + w), out_like)
    return _round(_round(x * r, out_like) * w, out_like)


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
    h = _round(res + x, h_ptr)
    tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=ok)
    if SECOND:
        w2 = tl.load(w2_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = _normed(h, w2, eps, n_cols, OFFSET, y_ptr)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slots_ptr, v_ptr, v_out_ptr, eps,
                      stride_xt, stride_xh, stride_ct, stride_ot, stride_oh, stride_vt, stride_vh,
                      stride_vot, stride_voh,
                      D: tl.constexpr, HALF_BLOCK: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr,
                      TO_SLOTS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    i = tl.arange(0, HALF_BLOCK)
    ok = i < half
    src = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + i, mask=ok, other=0.0).to(tl.float32)
    if NORM:  # over the whole head: both halves
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        w1 = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + i, mask=ok, other=0.0).to(tl.float32)
        if OFFSET:
            x1 = _round(x1 * r * (1.0 + w1), out_ptr)
            x2 = _round(x2 * r * (1.0 + w2), out_ptr)
        else:
            x1 = _round(_round(x1 * r, out_ptr) * w1, out_ptr)
            x2 = _round(_round(x2 * r, out_ptr) * w2, out_ptr)
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + half + i, mask=ok, other=0.0).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded as the PyTorch ops round them
    y1 = _round(_round(x1 * c1, out_ptr) + _round(-x2 * s1, out_ptr), out_ptr)
    y2 = _round(_round(x2 * c2, out_ptr) + _round(x1 * s2, out_ptr), out_ptr)
    row = t
    if TO_SLOTS:
        row = tl.load(slots_ptr + t).to(tl.int64)
    dst = out_ptr + row * stride_ot + h * stride_oh
    tl.store(dst + i, y1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + half + i, y2.to(out_ptr.dtype.element_ty), mask=ok)
    if TO_SLOTS:  # V of this head, beside its K
        vs = v_ptr + t * stride_vt + h * stride_vh
        vd = v_out_ptr + row * stride_vot + h * stride_voh
        tl.store(vd + i, tl.load(vs + i, mask=ok, other=0.0).to(v_out_ptr.dtype.element_ty), mask=ok)
        tl.store(vd + half + i, tl.load(vs + half + i, mask=ok, other=0.0).to(v_out_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit(do_not_specialize=["n_cols"])
def _gated_act_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, n_cols,
                      GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:
        # PyTorch's formula with an fp32 tanh (from exp(-2|z|): the interpreter has no tanh),
        # so even the far negative tail, where 1 + tanh cancels, rounds as PyTorch's does
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(z))
        tanh = (1.0 - e) / (1.0 + e)
        a = 0.5 * g * (1.0 + tl.where(z < 0, -tanh, tanh))
    else:
        a = g / (1.0 + tl.exp(-g))
    y = _round(_round(a, out_ptr) * u, out_ptr)
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


def norm_rope(x: torch.Tensor, norm: tuple[torch.Tensor, float, bool] | None, cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor | None = None, slots: torch.Tensor | None = None, v: torch.Tensor | None = None,
              v_pool: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, heads, D] (unit stride along D) -> each head normed (norm = (weight, eps, offset), or
    None) and rotated (cos, sin [T, D]). Into a new [T, heads, D] tensor, or with `slots` [T]
    into out = the K pool [slots, heads, D] at slots[t], v [T, heads, D] going to v_pool beside it."""
    T, heads, D = x.shape
    to_slots = slots is not None
    if out is None:
        out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    weight, eps, offset = norm if norm is not None else (x, 0.0, False)
    if not to_slots:
        v = v_pool = x
        slots = cos  # unused
    _norm_rope_kernel[(T, heads)](
        x, weight, cos, sin, out, slots, v, v_pool, eps, x.stride(0), x.stride(1), cos.stride(0),
        out.stride(0), out.stride(1), v.stride(0), v.stride(1), v_pool.stride(0), v_pool.stride(1),
        D=D, HALF_BLOCK=_block(D // 2), NORM=norm is not None, OFFSET=offset, TO_SLOTS=to_slots)
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
