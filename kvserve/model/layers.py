"""Building blocks shared by the model families: norms, rotary embedding, gated MLP."""
from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import add_rms_norm as add_rms_norm_kernel
from kvserve.kernels import gated_act_rows, gelu_tanh_mul, norm_rows, residual_norm_rows, silu_mul
from kvserve.kernels import rms_norm as rms_norm_kernel
from kvserve.model.config import RopeConfig


class PackedMatmul(Protocol):
    """A fast path's copy of one or more weights stacked by rows (kvserve/accel/panels.py packs
    them for the CPU decode-step kernel): x [..., K] -> [..., sum of rows], or None where it does
    not apply (then the model's own Linears compute)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None: ...


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32.

    Llama style: `w * norm(x).to(dtype)`. Gemma style (`offset=True`): the stored weight is a
    delta around 1 and the product happens in fp32 before the cast: `(norm(x) * (1 + w)).to(dtype)`.
    Both orders are kept because they round differently in bf16 and HF does each one this way.
    """

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim), requires_grad=False)
        self._gain: tuple[tuple, torch.Tensor] | None = None  # Gemma's fp32 (1 + w), see `_offset_gain`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 rows go through one C call (kvserve/kernels/rms_norm.c): a decode step runs ~110
        # norms of one token, where torch's per-op overhead is the cost, and at prefill sizes
        # F.rms_norm was slower still ([512, 640]: 979 vs 43 us). Other dtypes and autograd take
        # F.rms_norm (bitwise equal to x * rsqrt(mean(x^2) + eps) [* w]).
        dtype, shape = x.dtype, (x.shape[-1],)
        if x.is_cuda:  # one Triton kernel, the same roundings (kernels/triton_ops.py)
            y = norm_rows(x, self.weight, self.eps, self.offset)
            if y is not None:
                return y
        if dtype == torch.float32 and not torch.is_grad_enabled():
            y = rms_norm_kernel(x, self._offset_gain() if self.offset else self.weight, self.eps)
            if y is not None:
                return y
        if self.offset:
            return F.rms_norm(x.float(), shape, self._offset_gain(), self.eps).to(dtype)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(dtype)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, then: RMSNorm | None = None):
        """h = residual + self(x), the sandwich norm's residual add, and with `then` the pair
        (h, then(h)); fp32 rows in one C call (the same numbers as the separate steps), CUDA rows
        in one Triton kernel."""
        if x.is_cuda and (then is None or (then.eps == self.eps and then.offset == self.offset)):
            y = residual_norm_rows(x, residual, self.eps, self.offset, self.weight,
                                   None if then is None else then.weight)
            if y is not None:
                return y
        if x.dtype == torch.float32 and not torch.is_grad_enabled() and residual.dtype == torch.float32:
            gain = self.kernel_gain()
            gain2 = None if then is None else then.kernel_gain()
            if gain is not None and (then is None or (gain2 is not None and then.eps == self.eps)):
                y = add_rms_norm_kernel(x, gain, residual, self.eps, gain2)
                if y is not None:
                    return y
        h = residual + self(x)
        return h if then is None else (h, then(h))

    def add_and_norm(self, residual: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm residual step: h = residual + x (x itself where residual is None), and
        self(h); CUDA rows in one kernel."""
        if residual is None:
            return x, self(x)
        if x.is_cuda:
            y = residual_norm_rows(x, residual, self.eps, self.offset, None, self.weight)
            if y is not None:
                return y
        h = residual + x
        return h, self(h)

    def kernel_gain(self) -> torch.Tensor | None:
        """The fp32 gain [dim] the C kernels multiply by ((1 + w) for Gemma), None if not fp32 CPU."""
        gain = self._offset_gain() if self.offset else self.weight
        return gain if gain.dtype == torch.float32 and gain.is_cpu and gain.is_contiguous() else None

    def _offset_gain(self) -> torch.Tensor:
        """1 + w in fp32, cached while the weight is unchanged and no gradient flows to it."""
        w = self.weight
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # (a traced graph folds it in)
            return 1.0 + w.float()
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._gain is None or self._gain[0] != key:
            self._gain = (key, 1.0 + w.float())
        return self._gain[1]


def rope_inv_freq(cfg: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with HF's llama3 / linear scaling rules;
    computed on the CPU whatever the default device (the same table everywhere, and no meta-device
    ops while a loader builds an empty model)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (cfg.theta ** exponents)
    scaling = cfg.scaling_dict
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # a GGUF's rope_freqs: each frequency's divisor, given
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors: {factors.numel()} values for head_dim {head_dim} "
                             f"(needs {inv_freq.numel()})")
        return inv_freq / factors
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, freq_factors)")


class RotaryEmbedding(nn.Module):
    """Half-rotation (GPT-NeoX / HF) rotary embedding.

    `cos_sin(positions)` gives cos and sin [T, head_dim]; they are computed per step from the
    positions (cheap at T x head_dim/2) so that arbitrary positions, as StreamingLLM needs, work.
    """

    def __init__(self, cfg: RopeConfig, head_dim: int):
        super().__init__()
        inv_freq = rope_inv_freq(cfg, head_dim)
        # Both halves' frequencies [rotary_dim]: positions times this is cat(freqs, freqs) in one op
        # (one kernel a step on CUDA where the cast, product and cat were three).
        self.register_buffer("inv_freq_twice", torch.cat((inv_freq, inv_freq)), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        emb = positions[:, None] * self.inv_freq_twice  # fp32(position) * f, each product rounded once
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, rotary_dim]: the first rotary_dim dims of each head
    are rotated, the rest (partial rotary, rotary_dim < head_dim) pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama, GELU-tanh for Gemma."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        # fp32 CPU rows of gelu_tanh(gate) * up and silu(gate) * up take one C call (kernels/gelu.c)
        # on every path, the decode-step kernel included, so all of them compute the same numbers.
        self.gelu_tanh = act in ("gelu_pytorch_tanh", "gelu_tanh")
        self.silu = self.act is F.silu
        # gate and up as one low-bit matmul (kvserve/accel/fused_quant.py; gate/up_proj are then dropped).
        self.gate_up_proj: nn.Module | None = None
        # gate and up packed as one matrix for decode steps (set by kvserve/accel/panels.py), the
        # Linears kept for prefill.
        self.gate_up_panels: PackedMatmul | None = None
        # act(gate) * up and the down projection as one kernel for small CUDA batches
        # (kvserve/accel/cuda_gemv.py): (gate, up) -> the MLP's output, or None.
        self.down_gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = None
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
        elif self.gate_up_panels is not None:
            gate_up = self.gate_up_panels.matmul(x)  # None for prefill-sized inputs
        if gate_up is not None:
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.down_gated is not None:
            y = self.down_gated(gate, up)
            if y is not None:
                return y
        return self.down_proj(self.activate(gate, up))

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up."""
        if gate.is_cuda and (self.gelu_tanh or self.silu):
            y = gated_act_rows(gate, up, self.gelu_tanh)
            if y is not None:
                return y
        if (self.gelu_tanh or self.silu) and gate.dtype == torch.float32 and not torch.is_grad_enabled():
            y = (gelu_tanh_mul if self.gelu_tanh else silu_mul)(gate, up)
            if y is not None:
                return y
        return self.act(gate) * up
