"""LLM.int8() (Dettmers et al. 2022) and its int8 baselines, with a real int8 x int8 matmul.

`Int8Linear(mode=...)` stores the weight [N, K] as int8 once and multiplies int8 activations by it:

* "absmax":     one absmax scale for the whole activation matrix and one for the whole weight
                (the paper's "int8 absmax" baseline): y = s_x s_w (q_x q_w^T).
* "vectorwise": a scale per row of X (per token, dynamic) and per output channel of W
                (per row of W): y[m, n] = s_x[m] s_w[n] (q_x q_w^T)[m, n].
* "llm.int8":   vector-wise, plus the mixed-precision decomposition: the feature columns j where
                any token of the batch has |x[:, j]| >= threshold (default 6.0) are taken out of
                the int8 product and multiplied in floating point:
                    y = X[:, O] W[:, O]^T  +  s_x s_w (q(X[:, ~O]) q_w[:, ~O]^T).
                The floating part uses the int8 weight columns dequantized (s_w q_w[:, O]), as
                bitsandbytes does, so the weight is held once, in int8; the outlier activations
                themselves are never rounded. The row scales of X are taken after the outlier
                columns are removed, which is the point: one 60.0 in a row no longer crushes its
                other 639 values into a few codes.

Grids are symmetric "restricted range" absmax: s = absmax / 127, q = round(x / s) in [-127, 127].
The int8 matmul accumulates in int32: `torch._int_mm` (present in this torch, 2.13, on CPU; about
4x faster than the fp32 GEMM at 2048 x 640 x 2048 on this machine, one thread). Without it
`int8_matmul` falls back to a float64 matmul of the codes, exact as long as
127^2 K < 2^53 (any K below 5e11), so both paths give identical integers.

`llm_int8_model(model, mode=..., threshold=...)` swaps the transformer-block linears of a CausalLM
(and optionally the LM head) for Int8Linear in place.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

MODES = ("absmax", "vectorwise", "llm.int8")
QMAX = 127
HAS_INT_MM = hasattr(torch, "_int_mm")


def int8_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K], b_t int8 [N, K] -> a @ b_t^T as int32 [M, N], exactly."""
    if HAS_INT_MM and a.device.type == "cpu":
        return torch._int_mm(a.contiguous(), b_t.t())
    if HAS_INT_MM and a.device.type == "cuda" and a.shape[0] > 16 and a.shape[1] % 8 == 0 and b_t.shape[0] % 8 == 0:
        return torch._int_mm(a.contiguous(), b_t.t().contiguous())
    return (a.double() @ b_t.double().t()).to(torch.int32)


def absmax_scale(amax: torch.Tensor) -> torch.Tensor:
    """absmax -> scale absmax / 127 (float32), 1 where absmax is 0 (all codes 0 there)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


def quantize_absmax(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x float, scale broadcastable -> int8 codes round(x / s) clamped to [-127, 127]."""
    return torch.clamp(torch.round(x.float() / scale), -QMAX, QMAX).to(torch.int8)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scale [M, 1]): one absmax scale per row."""
    s = absmax_scale(x.abs().amax(dim=-1, keepdim=True))
    return quantize_absmax(x, s), s


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scale [1, 1]): one absmax scale for the whole tensor."""
    s = absmax_scale(x.abs().amax()).reshape(1, 1)
    return quantize_absmax(x, s), s


class Int8Linear(nn.Module):
    """An int8 x int8 linear layer (see the module docstring for the modes).

    Buffers: qweight int8 [N, K]; weight_scale float32 [N] ("vectorwise", "llm.int8") or [1]
    ("absmax"); bias [N] (float) or None.
    """

    def __init__(self, in_features: int, out_features: int, mode: str = "llm.int8", threshold: float = 6.0,
                 bias: bool = False, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold!r}")
        self.in_features, self.out_features, self.mode, self.threshold = in_features, out_features, mode, threshold
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(1 if mode == "absmax" else out_features))
        self.register_buffer("bias", torch.empty(out_features, dtype=bias_dtype) if bias else None)
        self.last_outlier_columns = 0  # how many feature columns the last forward kept in floating point

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str = "llm.int8", threshold: float = 6.0) -> "Int8Linear":
        w = linear.weight.detach().float()
        bias = linear.bias
        layer = cls(linear.in_features, linear.out_features, mode, threshold, bias is not None,
                    bias.dtype if bias is not None else torch.float32)
        with torch.no_grad():
            q, s = quantize_tensor(w) if mode == "absmax" else quantize_rows(w)
            layer.qweight = q.contiguous()
            layer.weight_scale = s.reshape(-1).contiguous()
            if bias is not None:
                layer.bias = bias.detach().clone()
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] float32: s_w * q_w."""
        return self.qweight.float() * self.weight_scale[:, None]

    @property
    def weight_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        extra = f", threshold={self.threshold}" if self.mode == "llm.int8" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{extra}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        y_fp = None
        if self.mode == "llm.int8":
            outliers = (x2.abs() >= self.threshold).any(dim=0)
            idx = outliers.nonzero().flatten()
            self.last_outlier_columns = int(idx.numel())
            if idx.numel():
                w_cols = self.qweight[:, idx].float() * self.weight_scale[:, None]  # [N, |O|]
                y_fp = x2[:, idx] @ w_cols.t()
                x2 = x2.masked_fill(outliers, 0.0)
        qx, sx = quantize_tensor(x2) if self.mode == "absmax" else quantize_rows(x2)
        acc = int8_matmul(qx, self.qweight)
        y = acc.float() * sx * self.weight_scale[None, :]
        if y_fp is not None:
            y = y + y_fp
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)


def replace_block_linears(model: nn.Module, make, skip: Sequence[str] = (), lm_head: bool = False) -> int:
    """Replace every nn.Linear inside model.layers by make(linear, full_name); lm_head too if asked
    (a tied head gets a module built from the embedding table, the lookup keeps the table).
    -> number of layers replaced."""
    n = 0
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            for name, lin in [(nm, m) for nm, m in block.named_modules() if isinstance(m, nn.Linear)]:
                full = f"layers.{i}.{name}"
                if any(s in full for s in skip):
                    continue
                block.set_submodule(name, make(lin, full))
                n += 1
        if lm_head:
            head = model.lm_head
            if head is None:
                w = model.embed_tokens.weight
                head = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                head.weight = nn.Parameter(w.detach(), requires_grad=False)
            if not isinstance(head, nn.Linear):
                raise ValueError(f"the LM head is a {type(head).__name__}, not a floating nn.Linear")
            model.lm_head = make(head, "lm_head")
            n += 1
    return n


def llm_int8_model(model: nn.Module, mode: str = "llm.int8", threshold: float = 6.0, skip: Sequence[str] = (),
                   lm_head: bool = False) -> int:
    """Swap a CausalLM's block linears (and the LM head with lm_head=True) for Int8Linear in place.
    -> number of layers replaced."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return replace_block_linears(model, lambda lin, _: Int8Linear.from_linear(lin, mode, threshold), skip, lm_head)


def outlier_report(model: nn.Module) -> dict[str, int]:
    """Outlier columns each Int8Linear kept in floating point in its last forward."""
    return {n: m.last_outlier_columns for n, m in model.named_modules() if isinstance(m, Int8Linear)}


__all__ = ["HAS_INT_MM", "Int8Linear", "MODES", "absmax_scale", "int8_matmul", "llm_int8_model", "outlier_report",
           "quantize_absmax", "quantize_rows", "quantize_tensor", "replace_block_linears"]
