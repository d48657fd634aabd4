"""`quantize_model`: replace the linear layers of a model's transformer blocks by QuantLinear,
one block at a time.

Methods are `LayerQuantizer` factories registered in `METHODS` (spec, **method_options ->
quantizer): RTN, GPTQ (kvserve/quant/gptq.py), AWQ (kvserve/quant/awq.py). A calibrated method
sets `needs_calibration` and receives a `LayerStats` per layer from `stats_fn(block_index,
layer_name)`; given calibration windows, the default `stats_fn` is a `Calibrator`
(kvserve/quant/calibrate.py), the sequential pipeline: block i is run on the outputs of the
already-quantized blocks before it, its linears' input statistics are collected, it is quantized,
and the next block follows. A method with a `prepare_block(model, i, calibrator)` hook (AWQ)
transforms block i in floating point first (scales folded, weights clipped).

By default the token embedding and the LM head stay in floating point (`lm_head=True` adds the
head: for a tied model the embedding table is kept for the lookup and the head matmul runs on a
quantized copy).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from kvserve.model.base import stored_weight_bytes as model_weight_bytes  # noqa: F401  (the quant API name)
from kvserve.quant.awq import AWQQuantizer
from kvserve.quant.calibrate import Calibrator
from kvserve.quant.embedding import QuantEmbedding
from kvserve.quant.gptq import GPTQQuantizer
from kvserve.quant.linear import QuantLinear
from kvserve.quant.rtn import RTNQuantizer
from kvserve.quant.spec import LayerQuantizer, LayerStats, QuantSpec

log = logging.getLogger(__name__)

METHODS: dict[str, Callable[..., LayerQuantizer]] = {"rtn": RTNQuantizer, "gptq": GPTQQuantizer,
                                                     "awq": AWQQuantizer}
StatsFn = Callable[[int, str], LayerStats | None]  # (block index, linear name in the block) -> stats


@dataclass
class LayerReport:
    name: str  # e.g. "layers.3.mlp.down_proj"
    shape: tuple[int, int]  # [out, in]
    kernel: str
    bytes_before: int
    bytes_after: int
    mse: float  # mean squared weight error of the stored grid vs the original


@dataclass
class QuantizeReport:
    method: str
    spec: QuantSpec
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.layers)

    def kernels(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.layers:
            out[r.kernel] = out.get(r.kernel, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"method": self.method, "spec": self.spec.to_dict(), "label": self.spec.label(),
                "num_layers": len(self.layers), "kernels": self.kernels(), "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "seconds": self.seconds}


def linear_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The nn.Linear submodules of `module` in definition order (q, k, v, o, gate, up, down)."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def make_quantizer(method: str, spec: QuantSpec, **options) -> LayerQuantizer:
    """options: the method's own settings (GPTQ: percdamp, blocksize, act_order, static_groups;
    AWQ: n_grid, search_windows, clip_rows, clip)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(sorted(METHODS))}, got {method!r}")
    try:
        return METHODS[method](spec, **options)
    except TypeError as e:
        raise ValueError(f"method {method!r}: bad options {sorted(options)} ({e})") from None


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantizer: LayerQuantizer,
                    stats: LayerStats | None = None, act_dtype: torch.dtype = torch.bfloat16,
                    kernel: str = "auto") -> tuple[QuantLinear, float]:
    """weight [out, in] -> (QuantLinear, mean squared error of its dequantized weight)."""
    w = weight.detach().float().contiguous()
    qw = quantizer.quantize_layer(w, stats)
    layer = QuantLinear.from_quantized(qw, bias, act_dtype=act_dtype, kernel=kernel)
    mse = float((layer.dequantized_weight() - w).pow(2).mean())
    return layer, mse


def quantize_model(
    model: nn.Module,
    method: str = "rtn",
    *,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = False,
    granularity: str = "group",
    act_dtype: torch.dtype | None = None,
    kernel: str = "auto",
    skip: Sequence[str] = (),
    lm_head: bool = False,
    embedding: bool = False,
    stats_fn: StatsFn | None = None,
    calibration: torch.Tensor | None = None,
    method_options: dict | None = None,
    progress: bool = True,
) -> QuantizeReport:
    """Quantize every nn.Linear inside `model.layers` (a CausalLM's blocks), in place.

    bits 2..8; granularity "tensor" | "channel" | "group" (with group_size); sym: symmetric
    grid. act_dtype: activations of the int4/int8 kernels (default bfloat16, the fast CPU path;
    see kvserve/quant/linear.py). skip: substrings of layer names ("layers.0.", "down_proj")
    left in floating point. lm_head: quantize the LM head too (RTN for a calibrated method, whose
    calibration does not reach the head). embedding: the token-embedding lookup reads low-bit
    codes too (kvserve/quant/embedding.py): a tied model's lookup shares the quantized head's
    codes (needs lm_head=True) and the float table is freed; an untied one gets its own RTN copy.
    calibration: token windows [n, L] (kvserve.quant.calibrate.load_calibration) for a calibrated
    method when no stats_fn is given. method_options: see `make_quantizer`.
    Peak extra memory is one layer's float copy: each block is replaced before the next.
    """
    act = act_dtype or torch.bfloat16
    tied = getattr(model, "lm_head", None) is None
    if embedding and tied and not lm_head:
        raise ValueError("--quant-embedding (embedding=True) on a tied model needs --quant-lm-head (lm_head=True): "
                         "the table is the LM head, quantized once for both")
    # Scales rounded to the dtype the int4/int8 kernels store them in (see QuantSpec.scale_dtype).
    spec = QuantSpec(bits=bits, sym=sym, granularity=granularity, group_size=group_size,
                     scale_dtype=torch.float32 if kernel == "dequant" else act)
    quantizer = make_quantizer(method, spec, **(method_options or {}))
    prepare = getattr(quantizer, "prepare_block", None)
    calibrator = None
    if (quantizer.needs_calibration and stats_fn is None) or prepare is not None:
        if isinstance(stats_fn, Calibrator):
            calibrator = stats_fn
        elif calibration is not None:
            limit = getattr(quantizer, "calibration_windows", None)  # a method that reads only the first ones
            calibration = calibration if limit is None else calibration[:limit]
            calibrator = Calibrator(model, calibration, collect=("hessian",) if quantizer.needs_calibration else ())
        else:
            raise ValueError(f"method {method!r} needs calibration data (calibration windows or stats_fn)")
        if stats_fn is None and quantizer.needs_calibration:
            stats_fn = calibrator
    if not hasattr(model, "layers"):
        raise ValueError(f"{type(model).__name__} has no `layers` (transformer blocks) to quantize")
    report = QuantizeReport(method, spec)
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, block in enumerate(tqdm(model.layers, desc=f"quantize {method} {spec.label()}", unit="block",
                                       disable=not progress)):
            if prepare is not None:
                prepare(model, i, calibrator)
            for name, lin in linear_layers(block):
                full = f"layers.{i}.{name}"
                if any(s in full for s in skip):
                    continue
                stats = stats_fn(i, name) if stats_fn is not None and quantizer.needs_calibration else None
                q, mse = quantize_linear(lin.weight, lin.bias, quantizer, stats, act, kernel)
                report.layers.append(LayerReport(full, (lin.out_features, lin.in_features), q.kernel,
                                                 _tensor_bytes(lin.weight) + _tensor_bytes(lin.bias),
                                                 q.weight_nbytes, mse))
                _set_submodule(block, name, q)
        if lm_head:
            head_w = model.lm_head_weight
            bias = getattr(model.lm_head, "bias", None)
            # The head is not calibrated: a calibrated method's head gets the plain RTN grid.
            head_q = RTNQuantizer(spec) if quantizer.needs_calibration else quantizer
            q, mse = quantize_linear(head_w, bias, head_q, None, act, kernel)
            report.layers.append(LayerReport("lm_head", tuple(head_w.shape), q.kernel,
                                             0 if tied else _tensor_bytes(head_w), q.weight_nbytes, mse))
            model.lm_head = q  # CausalLM.compute_logits calls the head module when there is one
        if embedding:
            report.layers.append(_quantize_embedding(model, tied, spec, quantizer, act, kernel))
    report.seconds = time.perf_counter() - t0
    log.info("quantized %d layers (%s) with %s %s in %.1f s: %.1f MB -> %.1f MB", len(report.layers),
             ", ".join(f"{k}: {v}" for k, v in report.kernels().items()), method, spec.label(), report.seconds,
             report.bytes_before / 1e6, report.bytes_after / 1e6)
    return report


def _quantize_embedding(model: nn.Module, tied: bool, spec: QuantSpec, quantizer: LayerQuantizer,
                        act: torch.dtype, kernel: str) -> LayerReport:
    """Replace model.embed_tokens by a QuantEmbedding (shared with the quantized head when tied)."""
    emb = model.embed_tokens
    if isinstance(emb, QuantEmbedding):
        raise ValueError("the embedding is already quantized")
    w = emb.weight
    if tied:
        table = model.lm_head
        model.embed_tokens = QuantEmbedding(table, w.dtype, tied=True)
        return LayerReport("embed_tokens", tuple(w.shape), table.kernel, _tensor_bytes(w), 0, 0.0)
    q_rtn = RTNQuantizer(spec) if quantizer.needs_calibration else quantizer
    table, mse = quantize_linear(w, None, q_rtn, None, act, kernel)
    model.embed_tokens = QuantEmbedding(table, w.dtype, tied=False)
    return LayerReport("embed_tokens", tuple(w.shape), table.kernel, _tensor_bytes(w), table.weight_nbytes, mse)
