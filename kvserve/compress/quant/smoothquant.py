"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights, then W8A8.

Smoothing (exact in real arithmetic): for a linear y = X W^T whose input channels j have very
different ranges, pick s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (alpha default 0.5; max|W_j|
over every linear that reads the same input) and compute y = (X / s) (W s)^T: the activation
columns shrink towards one range, the weight columns grow. X / s costs nothing when X is the
output of an RMSNorm: its weight is divided by s (Llama: w' = w / s; Gemma stores the delta
around 1 and applies (1 + w), so w' = (1 + w) / s - 1). Per block:

* q, k, v   read input_layernorm                         -> fold 1/s into that norm
* gate, up  read post_attention_layernorm (Llama) or
            pre_feedforward_layernorm (Gemma 3)          -> fold 1/s into that norm
* down      reads act(gate) * up                         -> fold 1/s into up_proj's rows (exact:
            the product is linear in up's output channel j)
o_proj is not smoothed (its input is attention output; with grouped KV heads the scales of one
value head would have to be shared by its query heads).

`smooth_layer` is the pure math (scales and scaled weights); `smooth_model` applies it to a
CausalLM in place from per-linear activation absmax statistics; `collect_act_absmax` gathers those
with forward hooks over calibration windows.

W8A8 (`W8A8Linear`): int8 weights (per output channel, or per tensor) times int8 activations
quantized on the fly (per token, dynamic; per tensor, dynamic; or per tensor with a static
calibrated scale), int32 accumulation through `torch._int_mm` (kvserve.compress.quant.llm_int8.int8_matmul,
with an exact fallback), y = s_x s_w (q_x q_w^T). The paper's settings: O1 = per-token dynamic
activations with per-tensor weights, O3 = per-tensor static; "naive W8A8" is per-tensor weights and
activations with no smoothing.

`smoothquant_model(model, act_absmax, alpha)` = smooth_model + W8A8 of every block linear;
`w8a8_model` is the same without smoothing (the naive baseline when both granularities are
"tensor").
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from kvserve.compress.quant.llm_int8 import (
    absmax_scale,
    int8_matmul,
    quantize_absmax,
    quantize_rows,
    quantize_tensor,
    replace_block_linears,
)
from kvserve.tools.eval.windows import window_hidden
from kvserve.weights.spec import LayerStats

WEIGHT_GRANULARITIES = ("channel", "tensor")
ACT_GRANULARITIES = ("token", "tensor", "static")
_EPS = 1e-5


# --- smoothing math ----------------------------------------------------------------------------

def smoothing_scales(act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """act_absmax [K] (max |X_j| over calibration tokens), weights [N_i, K] reading that input
    -> s [K] float32, s_j = max|X_j|^alpha / max_i max|W_i[:, j]|^(1 - alpha); channels with no
    activation or no weight get s = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if not weights:
        raise ValueError("smoothing needs at least one weight reading the input")
    a = act_absmax.detach().float()
    k = a.shape[-1]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"weights must be [N, {k}] to match act_absmax [{k}], got {tuple(w.shape)}")
    w_amax = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = a.clamp(min=_EPS).pow(alpha) / w_amax.clamp(min=_EPS).pow(1.0 - alpha)
    s = torch.where((a > 0) & (w_amax > 0), s, torch.ones_like(s))
    return s.clamp(min=_EPS)


def smooth_layer(act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> (s [K], [W_i * s] for each weight): X W^T == (X / s) (W * s)^T."""
    s = smoothing_scales(act_absmax, weights, alpha)
    return s, [w.float() * s[None, :] for w in weights]


def fold_into_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """Make an RMSNorm's output X / s in place (handles the Gemma (1 + w) convention: `offset`)."""
    with torch.no_grad():
        w = norm.weight.float()
        new = (1.0 + w) / s - 1.0 if getattr(norm, "offset", False) else w / s
        norm.weight.copy_(new.to(norm.weight.dtype))


def _scale_columns(lin: nn.Linear, s: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_((lin.weight.float() * s[None, :]).to(lin.weight.dtype))


def _scale_rows(lin: nn.Linear, s: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_((lin.weight.float() / s[:, None]).to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_((lin.bias.float() / s).to(lin.bias.dtype))


def smoothing_groups(block: nn.Module) -> list[tuple[str, list[str]]]:
    """(the module whose output is divided by s, the linears reading it) of one decoder block."""
    mlp_norm = "pre_feedforward_layernorm" if hasattr(block, "pre_feedforward_layernorm") else \
        "post_attention_layernorm"
    return [("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (mlp_norm, ["mlp.gate_proj", "mlp.up_proj"]),
            ("mlp.up_proj", ["mlp.down_proj"])]


def _absmax_of(act_absmax: Mapping[str, torch.Tensor | LayerStats], names: Sequence[str]) -> torch.Tensor | None:
    for n in names:
        v = act_absmax.get(n)
        if isinstance(v, LayerStats):
            v = v.act_absmax
        if v is not None:
            return v
    return None


def smooth_model(model: nn.Module, act_absmax: Mapping[str, torch.Tensor | LayerStats], alpha: float = 0.5,
                 smooth_down: bool = True) -> dict[str, torch.Tensor]:
    """Smooth every block of a CausalLM in place (see the module docstring).

    act_absmax: per-input-channel max |x| of each linear's input, keyed "layers.{i}.{name in the
    block}" (e.g. "layers.3.self_attn.q_proj"; any one of q/k/v, of gate/up is enough), a tensor
    [K] or a LayerStats with act_absmax. A group without statistics is left alone.
    -> the scales applied, keyed by the first linear of each group.
    """
    applied = {}
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            for prev_name, lin_names in smoothing_groups(block):
                if prev_name == "mlp.up_proj" and not smooth_down:
                    continue
                stats = _absmax_of(act_absmax, [f"layers.{i}.{n}" for n in lin_names])
                if stats is None:
                    continue
                lins = [block.get_submodule(n) for n in lin_names]
                prev = block.get_submodule(prev_name)
                if not all(isinstance(m, nn.Linear) for m in lins) or \
                        (prev_name == "mlp.up_proj" and not isinstance(prev, nn.Linear)):
                    raise ValueError(f"layers.{i}: smoothing needs floating nn.Linear layers {lin_names} "
                                     f"(smooth before quantizing)")
                s = smoothing_scales(stats.to(lins[0].weight.device), [m.weight for m in lins], alpha)
                if prev_name == "mlp.up_proj":
                    _scale_rows(prev, s)
                else:
                    fold_into_norm(prev, s)
                for m in lins:
                    _scale_columns(m, s)
                applied[f"layers.{i}.{lin_names[0]}"] = s
    return applied


def collect_act_absmax(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every nn.Linear in model.layers over windows [B, L] of token
    ids (each one forward pass as in kvserve.tools.eval.ppl) -> {"layers.{i}.{name}": [K] float32}."""
    out: dict[str, torch.Tensor] = {}
    hooks = []

    def hook(name):
        def fn(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            out[name] = x if name not in out else torch.maximum(out[name], x)
        return fn

    for i, block in enumerate(model.layers):
        for name, m in block.named_modules():
            if isinstance(m, nn.Linear):
                hooks.append(m.register_forward_pre_hook(hook(f"layers.{i}.{name}")))
    try:
        with torch.no_grad():  # not inference_mode: callers may edit the statistics in place
            for a in range(0, windows.shape[0], batch_size):
                window_hidden(model, windows[a:a + batch_size])
    finally:
        for h in hooks:
            h.remove()
    return out


# --- W8A8 --------------------------------------------------------------------------------------

class W8A8Linear(nn.Module):
    """int8 weights x int8 activations, int32 accumulation (see the module docstring).

    weight_granularity: "channel" (a scale per output row) or "tensor".
    act_granularity: "token" (dynamic, a scale per row of X), "tensor" (dynamic, one scale per
    call) or "static" (one calibrated scale, `act_absmax` / 127, fixed).
    Buffers: qweight int8 [N, K], weight_scale float32 [N] or [1], act_scale float32 [1] (static
    only), bias.
    """

    def __init__(self, in_features: int, out_features: int, weight_granularity: str = "channel",
                 act_granularity: str = "token", bias: bool = False, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        if weight_granularity not in WEIGHT_GRANULARITIES:
            raise ValueError(f"weight_granularity must be one of {', '.join(WEIGHT_GRANULARITIES)}, "
                             f"got {weight_granularity!r}")
        if act_granularity not in ACT_GRANULARITIES:
            raise ValueError(f"act_granularity must be one of {', '.join(ACT_GRANULARITIES)}, got {act_granularity!r}")
        self.in_features, self.out_features = in_features, out_features
        self.weight_granularity, self.act_granularity = weight_granularity, act_granularity
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features if weight_granularity == "channel" else 1))
        self.register_buffer("act_scale", torch.empty(1) if act_granularity == "static" else None)
        self.register_buffer("bias", torch.empty(out_features, dtype=bias_dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_granularity: str = "channel", act_granularity: str = "token",
                    act_absmax: float | torch.Tensor | None = None) -> "W8A8Linear":
        """Quantize a floating linear. act_absmax: the calibrated max |x| of its input (a scalar, or
        [K] per channel, reduced to its max), required for act_granularity="static"."""
        bias = linear.bias
        layer = cls(linear.in_features, linear.out_features, weight_granularity, act_granularity, bias is not None,
                    bias.dtype if bias is not None else torch.float32)
        w = linear.weight.detach().float()
        with torch.no_grad():
            q, s = quantize_rows(w) if weight_granularity == "channel" else quantize_tensor(w)
            layer.qweight = q.contiguous()
            layer.weight_scale = s.reshape(-1).contiguous()
            if act_granularity == "static":
                if act_absmax is None:
                    raise ValueError("act_granularity='static' needs act_absmax (calibration statistics)")
                layer.act_scale = absmax_scale(torch.as_tensor(act_absmax).float().max()).reshape(1)
            if bias is not None:
                layer.bias = bias.detach().clone()
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.weight_scale.reshape(-1, 1)

    @property
    def weight_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weights=per-{self.weight_granularity}, activations={self.act_granularity}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, self.out_features)
        if self.act_granularity == "token":
            qx, sx = quantize_rows(x2)
        elif self.act_granularity == "tensor":
            qx, sx = quantize_tensor(x2)
        else:
            sx = self.act_scale.reshape(1, 1)
            qx = quantize_absmax(x2, sx)
        y = int8_matmul(qx, self.qweight).float() * sx * self.weight_scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)


def w8a8_model(model: nn.Module, weight_granularity: str = "channel", act_granularity: str = "token",
               act_absmax: Mapping[str, torch.Tensor] | None = None, skip: Sequence[str] = (),
               lm_head: bool = False) -> int:
    """Swap a CausalLM's block linears for W8A8Linear in place (no smoothing). act_absmax (keyed as
    in smooth_model) is needed for act_granularity="static". -> number of layers replaced."""
    if act_granularity == "static" and act_absmax is None:
        raise ValueError("act_granularity='static' needs act_absmax (calibration statistics)")

    def make(lin, name):
        stats = None if act_absmax is None else _absmax_of(act_absmax, [name])
        if act_granularity == "static" and stats is None:
            raise ValueError(f"no activation statistics for {name} (static activation scales)")
        return W8A8Linear.from_linear(lin, weight_granularity, act_granularity, stats)

    return replace_block_linears(model, make, skip, lm_head)


def smoothquant_model(model: nn.Module, act_absmax: Mapping[str, torch.Tensor | LayerStats], alpha: float = 0.5,
                      weight_granularity: str = "channel", act_granularity: str = "token",
                      smooth_down: bool = True, skip: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """SmoothQuant W8A8 in place: smooth_model with the calibration statistics, then every block
    linear to W8A8Linear. For static activation scales the statistics are divided by the
    smoothing scales of their group first (they describe the input before smoothing).
    -> the smoothing scales applied."""
    scales = smooth_model(model, act_absmax, alpha, smooth_down)
    smoothed_stats: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.layers):
        for _, lin_names in smoothing_groups(block):
            names = [f"layers.{i}.{n}" for n in lin_names]
            a = _absmax_of(act_absmax, names)
            if a is None:
                continue
            s = scales.get(names[0])
            for n in names:
                smoothed_stats[n] = a.float() / s if s is not None else a.float()
    for k, v in act_absmax.items():
        if k not in smoothed_stats:
            v = v.act_absmax if isinstance(v, LayerStats) else v
            if v is not None:
                smoothed_stats[k] = v
    w8a8_model(model, weight_granularity, act_granularity, smoothed_stats, skip)
    return scales


__all__ = ["ACT_GRANULARITIES", "W8A8Linear", "WEIGHT_GRANULARITIES", "collect_act_absmax", "fold_into_norm",
           "smooth_layer", "smooth_model", "smoothing_groups", "smoothing_scales", "smoothquant_model", "w8a8_model"]
