"""`prepare_model`: the one place that applies the fast paths to a loaded model, in place.

Each changes how a weight is stored or called, never what a layer computes: packed fp32 panels
for CPU decode steps and the head's greedy screen, fused low-bit projections on the int kernels,
fused float projections on CUDA. The reference model is what `load_model` returns; the engine
prepares it once (a draft model too).
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from kvserve.accel import panels
from kvserve.accel.cuda_gemv import tune_small_batch_matmuls, use_cublas
from kvserve.accel.fused_linear import fuse_linear_projections
from kvserve.accel.fused_quant import fuse_projections
from kvserve.accel.greedy_head import head_screen, screen_head
from kvserve.weights.linear import use_gemv_kernels

log = logging.getLogger(__name__)


def prepare_model(model: nn.Module, device: str | torch.device, *, pack: bool = True, head_only: bool = False,
                  low_bit: bool = False, fuse_cuda: bool = True, what: str = "model") -> None:
    """`low_bit` (a model just RTN-quantized by the engine): q/k/v and gate/up as one low-bit call
    each, on the int kernels. `pack` (fp32 on the CPU): every Linear and a tied head packed for
    decode steps (`head_only`: the LM head alone, for a compiled forward pass), the packed head
    screened for greedy rows. `fuse_cuda` (float weights on CUDA): q/k/v and gate/up as one
    matmul each, and (with `pack`) each projection's small-batch kernel in CUDA graphs chosen by
    timing (accel/cuda_gemv.py; the records in `model.small_batch_tuning`). `what` names the model in the log."""
    device = torch.device(device)
    if low_bit:
        fuse_projections(model)
        use_gemv_kernels(model)
    if pack and device.type == "cpu" and next(model.parameters()).dtype == torch.float32:
        t = time.perf_counter()
        n = panels.use_panel_kernels(model, head_only=head_only)  # (through the module: tests count the calls)
        screen_head(model)
        if n:
            log.info("%s: %d weight matrices packed for decode steps in %.1f s", what, n, time.perf_counter() - t)
    if fuse_cuda and device.type == "cuda" and not low_bit:
        n = fuse_linear_projections(model)
        log.info("%s: %d projections fused for CUDA (q/k/v, gate/up)", what, n)
        if not pack:  # (a model prepared before by another engine keeps no choice)
            use_cublas(model)
            model.small_batch_tuning = []
        elif not getattr(model, "small_batch_tuning", None):  # engines sharing a model time it once
            _tune_small_batch(model, what)


def _tune_small_batch(model: nn.Module, what: str) -> None:
    """Choose each projection's small-batch kernel by timing (accel/cuda_gemv.py); on any
    failure cuBLAS for every product, the error kept in the records."""
    t = time.perf_counter()
    try:
        model.small_batch_tuning = tune_small_batch_matmuls(model)
    except Exception as exc:  # an optional speed-up: cuBLAS serves every product without it
        use_cublas(model)
        model.small_batch_tuning = [{"error": repr(exc)}]
        log.warning("%s: small-batch matmul kernels not tuned (%r); cuBLAS for every matmul", what, exc)
    else:
        log.info("%s: small-batch matmul kernels chosen in %.1f s", what, time.perf_counter() - t)


def fast_path_nbytes(model: nn.Module) -> int:
    """Bytes the fast paths hold beside the weights: packed fp32 panels (each copy once) and the
    head's greedy screen."""
    packed: dict[int, int] = {}
    for m in model.modules():
        for name in ("panels", "qkv_panels", "gate_up_panels", "head_panels"):
            p = getattr(m, name, None)
            if isinstance(p, panels.Panels):
                packed[p.packed.data_ptr()] = p.packed.numel() * p.packed.element_size()
    screen = head_screen(model)
    return sum(packed.values()) + (0 if screen is None else screen.nbytes)
