"""Replacing a model's linear layers by QuantLinear, one transformer block at a time.

`quantize_blocks` walks `model.layers` with a `LayerQuantizer` (kvserve/weights/spec.py): each
linear is quantized and replaced before the next, so the peak extra memory is one layer's float
copy. `rtn_quantize_model` is the engine's load-time path (EngineConfig.weights int8 / int4, a
self-speculative draft): round-to-nearest needs no calibration. The calibrated methods (GPTQ,
AWQ) and their pipeline are the compression toolbox's (kvserve/compress/quant/apply.py), which
walks the blocks through this same function.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from kvserve.weights.embedding import QuantEmbedding
from kvserve.weights.linear import QuantLinear
from kvserve.weights.rtn import RTNQuantizer
from kvserve.weights.spec import LayerQuantizer, LayerStats, QuantSpec

log = logging.getLogger(__name__)

StatsFn = Callable[[int, str], LayerStats | None]  # (block index, linear name in the block) -> stats
PrepareFn = Callable[[nn.Module, int], None]  # (model, block index): transform block i before it is quantized


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


def weight_read(module: nn.Module) -> set[str]:
    """Names of the linears inside `module` that a layer reads as a matrix rather than calls (a
    module's `weight_read`, e.g. MLA's kv_b_proj): they stay float."""
    return {f"{n}.{leaf}" if n else leaf for n, m in module.named_modules() for leaf in getattr(m, "weight_read", ())}


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantizer: LayerQuantizer,
                    stats: LayerStats | None = None, act_dtype: torch.dtype = torch.bfloat16,
                    kernel: str = "auto") -> tuple[QuantLinear, float]:
    """weight [out, in] -> (QuantLinear, mean squared error of its dequantized weight)."""
    w = weight.detach().float().contiguous()
    qw = quantizer.quantize_layer(w, stats)
    layer = QuantLinear.from_quantized(qw, bias, act_dtype=act_dtype, kernel=kernel)
    del qw  # its int32 codes: the size of w again
    return layer, _weight_mse(layer, w)


_MSE_ROWS_BYTES = 1 << 24  # fp32 bytes of dequantized rows compared at once


def _weight_mse(layer: QuantLinear, w: torch.Tensor) -> float:
    """Mean squared error of layer's dequantized weight against w [N, K], a chunk of rows at a
    time (a whole LM head's fp32 temporaries are hundreds of MB at load time)."""
    n, k = w.shape
    step = max(1, _MSE_ROWS_BYTES // (4 * max(1, k)))
    total = 0.0
    for a in range(0, n, step):
        rows = torch.arange(a, min(n, a + step))
        total += float((layer.dequantized_rows(rows) - w[a:a + step]).double().pow(2).sum())
    return total / max(1, w.numel())


def quantize_blocks(model: nn.Module, quantizer: LayerQuantizer, spec: QuantSpec, method: str, *,
                    act_dtype: torch.dtype = torch.bfloat16, kernel: str = "auto", skip: Sequence[str] = (),
                    lm_head: bool = False, embedding: bool = False, stats_fn: StatsFn | None = None,
                    prepare: PrepareFn | None = None, progress: bool = True) -> QuantizeReport:
    """Quantize every nn.Linear inside `model.layers` with `quantizer`, in place (see
    kvserve/compress/quant/apply.py `quantize_model` for the options); `prepare(model, i)` runs
    before block i is quantized, `stats_fn(i, name)` gives a calibrated method its statistics."""
    act = act_dtype
    tied = getattr(model, "lm_head", None) is None
    if embedding and tied and not lm_head:
        raise ValueError("--quant-embedding (embedding=True) on a tied model needs --quant-lm-head (lm_head=True): "
                         "the table is the LM head, quantized once for both")
    if not hasattr(model, "layers"):
        raise ValueError(f"{type(model).__name__} has no `layers` (transformer blocks) to quantize")
    report = QuantizeReport(method, spec)
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, block in enumerate(tqdm(model.layers, desc=f"quantize {method} {spec.label()}", unit="block",
                                       disable=not progress)):
            if prepare is not None:
                prepare(model, i)
            read = weight_read(block)
            for name, lin in linear_layers(block):
                full = f"layers.{i}.{name}"
                if any(s in full for s in skip) or name in read:
                    continue
                stats = stats_fn(i, name) if stats_fn is not None and quantizer.needs_calibration else None
                q, mse = quantize_linear(lin.weight, lin.bias, quantizer, stats, act, kernel)
                report.layers.append(LayerReport(full, (lin.out_features, lin.in_features), q.kernel,
                                                 _tensor_bytes(lin.weight) + _tensor_bytes(lin.bias),
                                                 q.weight_nbytes, mse))
                block.set_submodule(name, q)
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


def rtn_quantize_model(model: nn.Module, bits: int, group_size: int = 128, *, granularity: str = "group",
                       sym: bool = False, lm_head: bool = False, embedding: bool = False,
                       progress: bool = True, prepare: PrepareFn | None = None) -> QuantizeReport:
    """Round-to-nearest quantization of every block linear (and the head / embedding when asked),
    in place, onto the bfloat16-activation int kernels. `prepare(model, i)` runs before block i
    is quantized (a streaming load places the block's float weights there)."""
    spec = QuantSpec(bits=bits, sym=sym, granularity=granularity, group_size=group_size, scale_dtype=torch.bfloat16)
    return quantize_blocks(model, RTNQuantizer(spec), spec, "rtn", lm_head=lm_head, embedding=embedding,
                           progress=progress, prepare=prepare)


ENGINE_KINDS = ("int8", "int4")
ENGINE_INT4_GROUPS = (128, 64, 32)  # the largest that divides every layer's inputs is taken


def engine_rtn_settings(kind: str, in_features: set[int], source: object) -> tuple[int, int]:
    """(bits, group size) of EngineConfig.weights `kind` for layers of these input widths
    (ValueError naming `source` when no int4 group size divides them all)."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"weights must be one of {ENGINE_KINDS} to quantize, got {kind!r}")
    if kind == "int8":
        return 8, 128
    fits = [g for g in ENGINE_INT4_GROUPS if all(w % g == 0 for w in in_features)]
    if not fits:
        raise ValueError(f"weights 'int4': no group size of 128, 64 or 32 divides the layer widths "
                         f"{sorted(in_features)} of {source}")
    return 4, fits[0]


def engine_quantize(model: nn.Module, kind: str, source: object = "the model",
                    prepare: PrepareFn | None = None) -> QuantizeReport:
    """EngineConfig.weights int8 / int4, in place: RTN of every linear, the LM head and the
    embedding; int8 per output channel, symmetric; int4 asymmetric in the largest group of
    ENGINE_INT4_GROUPS dividing every width. `model` may be a skeleton whose blocks `prepare`
    places one at a time (its nn.Linear shapes are read before any is)."""
    widths = {m.in_features for m in model.modules() if isinstance(m, nn.Linear)}
    bits, group = engine_rtn_settings(kind, widths, source)
    return rtn_quantize_model(model, bits, group, granularity="channel" if bits == 8 else "group", sym=bits == 8,
                              lm_head=True, embedding=True, progress=False, prepare=prepare)


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
