"""`quantize_model`: replace the linear layers of a model's transformer blocks by QuantLinear,
one block at a time.

Methods are `LayerQuantizer` factories registered in `METHODS` (spec, **method_options ->
quantizer): RTN, GPTQ (kvserve/compress/quant/gptq.py), AWQ (kvserve/compress/quant/awq.py). A calibrated method
sets `needs_calibration` and receives a `LayerStats` per layer from `stats_fn(block_index,
layer_name)`; given calibration windows, the default `stats_fn` is a `Calibrator`
(kvserve/compress/quant/calibrate.py), the sequential pipeline: block i is run on the outputs of the
already-quantized blocks before it, its linears' input statistics are collected, it is quantized,
and the next block follows. A method with a `prepare_block(model, i, calibrator)` hook (AWQ)
transforms block i in floating point first (scales folded, weights clipped).

By default the token embedding and the LM head stay in floating point (`lm_head=True` adds the
head: for a tied model the embedding table is kept for the lookup and the head matmul runs on a
quantized copy).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from kvserve.compress.quant.awq import AWQQuantizer
from kvserve.compress.quant.calibrate import Calibrator
from kvserve.compress.quant.gptq import GPTQQuantizer
from kvserve.model.base import stored_weight_bytes as model_weight_bytes  # noqa: F401  (the quant API name)
from kvserve.weights.quantize import (  # noqa: F401  (the quant API)
    LayerReport,
    PrepareFn,
    QuantizeReport,
    StatsFn,
    linear_layers,
    quantize_blocks,
    quantize_linear,
)
from kvserve.weights.rtn import RTNQuantizer
from kvserve.weights.spec import LayerQuantizer, QuantSpec

METHODS: dict[str, Callable[..., LayerQuantizer]] = {"rtn": RTNQuantizer, "gptq": GPTQQuantizer,
                                                     "awq": AWQQuantizer}


def make_quantizer(method: str, spec: QuantSpec, **options) -> LayerQuantizer:
    """options: the method's own settings (GPTQ: percdamp, blocksize, act_order, static_groups;
    AWQ: n_grid, search_windows, clip_rows, clip)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(sorted(METHODS))}, got {method!r}")
    try:
        return METHODS[method](spec, **options)
    except TypeError as e:
        raise ValueError(f"method {method!r}: bad options {sorted(options)} ({e})") from None


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
    place_block: PrepareFn | None = None,
) -> QuantizeReport:
    """Quantize every nn.Linear inside `model.layers` (a CausalLM's blocks), in place.

    bits 2..8; granularity "tensor" | "channel" | "group" (with group_size); sym: symmetric
    grid. act_dtype: activations of the int4/int8 kernels (default bfloat16, the fast CPU path;
    see kvserve/weights/linear.py). skip: substrings of layer names ("layers.0.", "down_proj")
    left in floating point. lm_head: quantize the LM head too (RTN for a calibrated method, whose
    calibration does not reach the head). embedding: the token-embedding lookup reads low-bit
    codes too (kvserve/weights/embedding.py): a tied model's lookup shares the quantized head's
    codes (needs lm_head=True) and the float table is freed; an untied one gets its own RTN copy.
    calibration: token windows [n, L] (kvserve.compress.quant.calibrate.load_calibration) for a calibrated
    method when no stats_fn is given. method_options: see `make_quantizer`.
    Peak extra memory is one layer's float copy: each block is replaced before the next.
    place_block(model, i): places block i's float weights first (a streaming load,
    kvserve/loading/streamed.py; RTN only: a calibrated method runs the whole model first).
    """
    if place_block is not None and method != "rtn":
        raise ValueError(f"place_block (a streaming load) needs method 'rtn', got {method!r}")
    act = act_dtype or torch.bfloat16
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
    before = place_block if prepare is None else (lambda m, i: prepare(m, i, calibrator))
    return quantize_blocks(model, quantizer, spec, method, act_dtype=act, kernel=kernel, skip=skip, lm_head=lm_head,
                           embedding=embedding, stats_fn=stats_fn, prepare=before, progress=progress)
