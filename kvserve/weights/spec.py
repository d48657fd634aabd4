"""The types every quantization method shares.

* `QuantSpec`: the integer grid (bits, symmetric or not, granularity, group size), validated
  with errors that name the argument.
* `QuantizedWeight`: one layer's result, in a method-independent canonical form: integer codes,
  scales and zero points such that W ~ scale * (codes - zero) group by group.
* `LayerStats`: what calibration tells a method about a layer's inputs (all optional).
* `LayerQuantizer`: the per-layer interface. RTN implements it now; GPTQ, AWQ, SmoothQuant,
  LLM.int8() and QAT plug in the same way: weight [out, in] (+ stats) -> QuantizedWeight, and
  `QuantLinear.from_quantized` turns any of them into a packed layer with a real kernel.

The affine grid: q = clamp(round(x / s) + z, qmin, qmax), x_hat = s * (q - z).
Symmetric grids use z = 0 and signed codes in [-2^(b-1), 2^(b-1) - 1] with s = absmax / (2^(b-1) - 1)
(the "restricted range" absmax grid: +-absmax are exactly representable, -2^(b-1) is never
produced by rounding). Asymmetric grids use unsigned codes in [0, 2^b - 1] and an integer zero
point, with the range widened to include 0 (the GPTQ repository's RTN baseline).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

GRANULARITIES = ("tensor", "channel", "group")
MIN_BITS, MAX_BITS = 2, 8


@dataclass(frozen=True)
class QuantSpec:
    """An integer grid for a weight matrix [out, in].

    granularity: "tensor" (one scale), "channel" (one per output row) or "group" (one per
    `group_size` consecutive inputs of a row). `group_size` is only read for "group".
    """

    bits: int = 4
    sym: bool = False
    granularity: str = "group"
    group_size: int = 128
    # Scales are rounded to this dtype before codes are chosen, so a kernel that stores them in
    # bf16 multiplies by exactly the scale the codes were rounded against.
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {self.bits!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.granularity == "group" and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}")
        if not isinstance(self.scale_dtype, torch.dtype) or not self.scale_dtype.is_floating_point:
            raise ValueError(f"scale_dtype must be a floating torch dtype, got {self.scale_dtype!r}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.sym else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.sym else (1 << self.bits) - 1

    def num_groups(self, in_features: int) -> int:
        """Scale columns G for a row of `in_features` inputs (1 unless granularity is "group")."""
        if self.granularity != "group":
            return 1
        if in_features % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide in_features {in_features}")
        return in_features // self.group_size

    def label(self) -> str:
        """Short human name, e.g. "int4 asym g128", "int8 sym per-channel"."""
        g = {"tensor": "per-tensor", "channel": "per-channel"}.get(self.granularity, f"g{self.group_size}")
        return f"int{self.bits} {'sym' if self.sym else 'asym'} {g}"

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return {"bits": self.bits, "sym": self.sym, "granularity": self.granularity,
                "group_size": self.group_size if self.granularity == "group" else None,
                "scale_dtype": str(self.scale_dtype).removeprefix("torch.")}


@dataclass
class QuantizedWeight:
    """One quantized matrix in canonical form.

    codes: [out, in] int32 in [spec.qmin, spec.qmax].
    scale: [out, G] float32 (G = spec.num_groups(in); per-tensor repeats one value down the rows).
    zero: [out, G] int32 integer zero points in [0, 2^b - 1], or None for symmetric grids.
    g_idx: [in] int64 group of each input column when it is not `column // group_size` (GPTQ
        act-order without static groups); None otherwise.
    The weight it stands for is scale * (codes - zero), expanded over each group's columns.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """-> [out, in] float32."""
        return dequantize(self.codes, self.scale, self.zero, g_idx=self.g_idx)


@dataclass
class LayerStats:
    """Calibration statistics of one linear layer's inputs; every field is optional so each
    method asks only for what it uses (GPTQ: hessian; AWQ: inputs, act_absmean; SmoothQuant:
    act_absmax; LLM.int8(): act_absmax).

    inputs: [n, in] a sample of input rows. hessian: [in, in] = 2 X^T X / n.
    act_absmax, act_absmean: [in] per input channel over the calibration tokens.
    """

    num_tokens: int = 0
    inputs: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    act_absmax: torch.Tensor | None = None
    act_absmean: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


@runtime_checkable
class LayerQuantizer(Protocol):
    """Turns one weight matrix into a QuantizedWeight.

    `needs_calibration`: quantize_model must feed `stats` (collected layer by layer from
    calibration text through the already-quantized earlier blocks) when True.
    """

    spec: QuantSpec
    needs_calibration: bool

    def quantize_layer(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedWeight:
        """weight [out, in] float -> QuantizedWeight of the same shape."""
        ...


# --- the grid's arithmetic, shared by every method (RTN, GPTQ, AWQ, QAT) and the kernels' fallback

def group_view(x: torch.Tensor, g: int) -> torch.Tensor:
    """x [..., K] -> view [..., g, K // g]."""
    k = x.shape[-1]
    if k % g:
        raise ValueError(f"{g} scale groups do not divide {k} columns")
    return x.reshape(*x.shape[:-1], g, k // g)


def expand_params(p: torch.Tensor, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Per-group params [..., G] -> [..., G, 1] to broadcast over grouped values [..., G, K/G],
    or gathered to [..., K] column by column (g_idx [K])."""
    return p[..., g_idx] if g_idx is not None else p[..., None]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Codes -> values: s * (q - z). codes [..., K], scale/zero [..., G] -> [..., K] float32.

    The integer difference is taken first and then scaled once, so a value produced by this
    function quantizes back to the same code and dequantizes to the same bits.
    """
    q = codes if g_idx is not None else group_view(codes, scale.shape[-1])
    if zero is not None:
        q = q - expand_params(zero, g_idx)
    return (q.float() * expand_params(scale.float(), g_idx)).reshape(codes.shape)


# Where low-bit layer classes live: the runtime formats (QuantLinear, QuantEmbedding) and the
# toolbox's methods with layers of their own (LLM.int8, SmoothQuant's W8A8). Named, not imported:
# the toolbox sits above this layer.
_QUANTIZED_MODULES = ("kvserve.weights.linear", "kvserve.weights.embedding", "kvserve.weights.ggml",
                      "kvserve.compress.quant")


def is_quantized_module(mod: object) -> bool:
    """Whether `mod` is a low-bit layer (a transform for float weights must refuse it)."""
    return type(mod).__module__.startswith(_QUANTIZED_MODULES)
