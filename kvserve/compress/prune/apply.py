"""`prune_model`: zero weights of the linear layers of a model's transformer blocks, in place,
one block at a time (magnitude, Wanda or SparseGPT; unstructured or N:M).

Sequential pipeline (as `quantize_model`, through kvserve.compress.quant.calibrate.Calibrator): block i
is calibrated on the outputs of the already-pruned blocks before it; its linears' input
statistics are collected in one pass (Wanda: the squared input-channel norms; SparseGPT: the
Hessian 2 X^T X / n), all of its linears are pruned, then block i + 1 follows. Magnitude needs
no calibration. The token embedding and the LM head are never pruned.

Comparison groups (the papers' choices): magnitude ranks a whole layer (unstructured) or each
group of m inputs of a row (N:M); Wanda ranks within each output row (or each group of m);
SparseGPT selects per block of `blocksize` columns (or group of m) with OBS error compensation.

Iterative pruning: with steps = S > 1 the model is pruned S times, at step s to sparsity
`sparsity * s / S` (each pass recalibrates through the current model; weights already at zero
have the lowest scores, so they stay pruned), and `heal_fn(model, s)` is called after every step
but the last. Healing (e.g. distillation from the dense model) is a hook: kvserve ships no
trainer for it here, so without `heal_fn` the steps only re-select masks on recalibrated inputs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from tqdm import tqdm

from kvserve.compress.prune.masks import (
    check_sparsity,
    magnitude_scores,
    parse_pattern,
    select_mask,
    wanda_scores,
)
from kvserve.compress.prune.sparsegpt import sparsegpt_prune
from kvserve.compress.quant.apply import linear_layers
from kvserve.compress.quant.calibrate import Calibrator, run_block

log = logging.getLogger(__name__)

METHODS = ("magnitude", "wanda", "sparsegpt")
HealFn = Callable[[nn.Module, int], None]


@dataclass
class LayerPruneReport:
    name: str  # e.g. "layers.3.mlp.down_proj"
    shape: tuple[int, int]  # [out, in]
    sparsity: float  # achieved fraction of zeros
    rel_output_error: float | None  # ||(W - W') X||^2 / ||W X||^2 on the calibration inputs (via H)


@dataclass
class PruneReport:
    method: str
    sparsity: float | None
    pattern: tuple[int, int] | None
    steps: int = 1
    layers: list[LayerPruneReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def achieved_sparsity(self) -> float:
        """Zeros over all pruned layers' weights (of the last step)."""
        total = sum(r.shape[0] * r.shape[1] for r in self.layers)
        return sum(r.sparsity * r.shape[0] * r.shape[1] for r in self.layers) / max(total, 1)

    def label(self) -> str:
        return f"{self.pattern[0]}:{self.pattern[1]}" if self.pattern else f"{self.sparsity:.0%}"

    def to_dict(self) -> dict:
        return {"method": self.method, "sparsity": self.sparsity,
                "pattern": None if self.pattern is None else f"{self.pattern[0]}:{self.pattern[1]}",
                "steps": self.steps, "num_layers": len(self.layers), "achieved_sparsity": self.achieved_sparsity,
                "seconds": self.seconds}


def _input_sq_norms(calibrator: Calibrator, i: int, names: Sequence[str]) -> dict[str, tuple[torch.Tensor, int]]:
    """Run block i on its calibration inputs -> {linear name: (sum_t x_tj^2 [in], tokens)}.
    Wanda needs only these (not the full Hessian), which keeps its calibration cheap."""
    block = calibrator.model.layers[i]
    h = calibrator.inputs(i)
    acc: dict[str, list] = {}
    hooks = []

    def hook(name):
        def fn(mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            s = x.pow(2).sum(0)
            if name in acc:
                acc[name][0] += s
                acc[name][1] += x.shape[0]
            else:
                acc[name] = [s, x.shape[0]]
        return fn

    for name, mod in block.named_modules():
        if isinstance(mod, nn.Linear) and name in names:
            hooks.append(mod.register_forward_pre_hook(hook(name)))
    try:
        with torch.no_grad():
            run_block(calibrator.model, block, h, calibrator.seqlen, calibrator.batch_size)
    finally:
        for hk in hooks:
            hk.remove()
    return {k: (v[0], v[1]) for k, v in acc.items()}


def _output_error(w: torch.Tensor, new: torch.Tensor, hessian: torch.Tensor | None) -> float | None:
    """tr(dW H dW^T) / tr(W H W^T): the relative squared output error on the calibration inputs."""
    if hessian is None:
        return None
    h = hessian.float()
    dw = w - new
    num = float(((dw @ h) * dw).sum())
    den = float(((w @ h) * w).sum())
    return num / den if den > 0 else None


def prune_linear(weight: torch.Tensor, method: str, *, sparsity: float | None = None,
                 pattern: tuple[int, int] | None = None, hessian: torch.Tensor | None = None,
                 input_norms: torch.Tensor | None = None, per: str | None = None, percdamp: float = 0.01,
                 blocksize: int = 128, name: str = "layer") -> torch.Tensor:
    """weight [out, in] -> pruned weight [out, in] float32 (exact zeros where pruned).

    magnitude: no statistics; wanda: input_norms ||X_j||_2 [in]; sparsegpt: hessian [in, in].
    per: comparison group of an unstructured mask ("row" / "layer"; default layer for magnitude,
    row for Wanda).
    """
    w = weight.detach().float()
    if method == "sparsegpt":
        if hessian is None:
            raise ValueError(f"SparseGPT needs the input Hessian of {name} (calibration statistics)")
        new, _ = sparsegpt_prune(w, hessian, sparsity=sparsity, pattern=pattern, percdamp=percdamp,
                                 blocksize=blocksize, name=name)
        return new
    if method == "magnitude":
        scores, default_per = magnitude_scores(w), "layer"
    elif method == "wanda":
        if input_norms is None:
            raise ValueError(f"Wanda needs the input norms of {name} (calibration statistics)")
        scores, default_per = wanda_scores(w, input_norms), "row"
    else:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    keep = select_mask(scores, sparsity, pattern, per or default_per)
    return w * keep


def _prune_pass(model: nn.Module, method: str, sparsity: float | None, pattern: tuple[int, int] | None,
                calibration: torch.Tensor | None, skip: Sequence[str], progress: bool, per: str | None,
                percdamp: float, blocksize: int, desc: str) -> list[LayerPruneReport]:
    calibrator = None
    if method != "magnitude":
        if calibration is None:
            raise ValueError(f"method {method!r} needs calibration data (calibration windows [n, L])")
        calibrator = Calibrator(model, calibration, collect=("hessian",))
    reports: list[LayerPruneReport] = []
    with torch.no_grad():
        for i, block in enumerate(tqdm(model.layers, desc=desc, unit="block", disable=not progress)):
            layers = [(n, lin) for n, lin in linear_layers(block) if not any(s in f"layers.{i}.{n}" for s in skip)]
            if not layers:
                continue
            names = [n for n, _ in layers]
            hessians: dict = {}
            norms: dict = {}
            if method == "sparsegpt":
                hessians = {n: st.hessian for n, st in calibrator.capture(i, names, ("hessian",)).items()}
            elif method == "wanda":
                norms = {n: s.sqrt() for n, (s, _) in _input_sq_norms(calibrator, i, names).items()}
            for name, lin in layers:
                full = f"layers.{i}.{name}"
                w = lin.weight.detach().float()
                new = prune_linear(w, method, sparsity=sparsity, pattern=pattern, hessian=hessians.get(name),
                                   input_norms=norms.get(name), per=per, percdamp=percdamp, blocksize=blocksize,
                                   name=full)
                err = _output_error(w, new, hessians.get(name))
                # In place (keeps the memory layout) through detach(), which shares the version counter:
                # a packed copy of the weight (accel/panels.py) sees the change.
                lin.weight.detach().copy_(new.to(lin.weight.dtype))
                reports.append(LayerPruneReport(full, (lin.out_features, lin.in_features),
                                                float((lin.weight == 0).sum()) / lin.weight.numel(), err))
    return reports


def prune_model(model: nn.Module, method: str = "magnitude", sparsity: float | None = None,
                pattern: str | tuple[int, int] | None = None, calibration: torch.Tensor | None = None,
                skip: Sequence[str] = (), progress: bool = True, heal_fn: HealFn | None = None, steps: int = 1,
                *, per: str | None = None, percdamp: float = 0.01, blocksize: int = 128) -> PruneReport:
    """Prune every nn.Linear inside `model.layers` (a CausalLM's blocks), in place -> PruneReport.

    sparsity: unstructured fraction in [0, 1) (e.g. 0.5), or pattern: "2:4" / "4:8" (N:M).
    calibration: token windows [n, L] (kvserve.compress.quant.calibrate.load_calibration), needed by
    wanda / sparsegpt. skip: substrings of layer names left dense ("layers.0.", "down_proj").
    steps / heal_fn: iterative pruning (module docstring); unstructured only.
    per: override the unstructured comparison group of magnitude / Wanda ("row" | "layer").
    percdamp, blocksize: SparseGPT dampening (fraction of mean diag H) and column block.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    nm = parse_pattern(pattern) if pattern is not None else None
    if nm is None:
        if sparsity is None:
            raise ValueError("give --sparsity (e.g. 0.5) or --pattern (e.g. 2:4)")
        sparsity = check_sparsity(sparsity)
    elif sparsity is not None:
        raise ValueError("give either --sparsity or --pattern, not both")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"--steps must be an integer >= 1, got {steps}")
    if steps > 1 and nm is not None:
        raise ValueError("iterative pruning (--steps > 1) needs an unstructured --sparsity, not an N:M pattern")
    if per not in (None, "row", "layer"):
        raise ValueError(f"per must be 'row' or 'layer', got {per!r}")
    if not hasattr(model, "layers"):
        raise ValueError(f"{type(model).__name__} has no `layers` (transformer blocks) to prune")
    report = PruneReport(method, sparsity, nm, steps)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        target = None if nm is not None else sparsity * s / steps
        label = f"{nm[0]}:{nm[1]}" if nm else f"{target:.0%}"
        desc = f"prune {method} {label}" + (f" step {s}/{steps}" if steps > 1 else "")
        report.layers = _prune_pass(model, method, target, nm, calibration, skip, progress, per, percdamp,
                                    blocksize, desc)
        if s < steps and heal_fn is not None:
            heal_fn(model, s)
    report.seconds = time.perf_counter() - t0
    log.info("pruned %d layers with %s %s in %.1f s: sparsity %.3f", len(report.layers), method, report.label(),
             report.seconds, report.achieved_sparsity)
    return report
