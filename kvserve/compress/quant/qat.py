"""Quantization-aware training (QAT) with a straight-through estimator (STE).

`prepare_qat(model, spec)` swaps the block linears for `FakeQuantLinear`: each keeps its fp32
weight as a trainable shadow W and multiplies by the RTN grid of W as it is now,

    W_hat = s * (clamp(round(W / s) + z) - z)        (s, z: min-max of W at the spec's granularity)
    forward uses W + (W_hat - W).detach()             value W_hat, gradient d/dW = identity (STE)

so a short fine-tune moves the shadow weights to where their rounded values do well. Two ways to
fine-tune, on WikiText-2 valid windows:

* `qat_blockwise` (default; EfficientQAT's Block-AP recipe without learned scales): block by
  block, in order, each block trained to reproduce the float block's output (MSE) on the inputs
  the already-quantized earlier blocks produce (the Calibrator pipeline GPTQ uses), then packed.
  No LM head in the loop, so a CPU affords many tokens: one block's forward + backward is ~2%
  of a full-model step, whose 262144-word head dominates.
* `qat` (end to end): the whole model through kvserve.compress.train.loop.train with logit distillation
  from the float model (or plain CE); the textbook form, affordable on a GPU (on this 2-core
  CPU one step of 4 x 256 tokens takes about a minute). The grid is recomputed from W every step, as in
the RTN it will be converted with, so nothing else is learned. `convert_qat(model)` then rounds
every shadow weight once more with the same function and packs it into a QuantLinear (the same
kernels and saved format as post-training quantization): the converted model multiplies by
exactly the W_hat the last training step saw.

Only the block linears are trained (embedding, norms, LM head frozen) so the result compares
one-for-one with the PTQ rows that quantize the same layers.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from kvserve.compress.quant.apply import (
    LayerReport,
    QuantizeReport,
    linear_layers,
)
from kvserve.compress.quant.calibrate import Calibrator, run_block, run_windows
from kvserve.compress.train import DistillLoss, lm_loss, train
from kvserve.model.base import run_layer
from kvserve.weights.linear import QuantLinear
from kvserve.weights.rtn import compute_qparams, dequantize, quantize, quantize_rtn
from kvserve.weights.spec import QuantSpec


class FakeQuantLinear(nn.Module):
    """A linear layer trained through its own RTN grid (see the module docstring).

    weight [out, in] float32 (the shadow, trainable), bias [out] or None (frozen)."""

    def __init__(self, linear: nn.Linear, spec: QuantSpec):
        super().__init__()
        self.spec = spec
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().float().clone(), requires_grad=True)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def quantized_value(self) -> torch.Tensor:
        """W_hat [out, in] float32: the RTN grid of the current shadow weight (no gradient)."""
        with torch.no_grad():
            scale, zero = compute_qparams(self.weight, self.spec)
            return dequantize(quantize(self.weight, scale, zero, self.spec), scale, zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w_q = w + (self.quantized_value() - w).detach()  # straight-through estimator
        return F.linear(x, w_q.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.label()}"


def qat_spec(bits: int = 4, group_size: int = 128, sym: bool = False, granularity: str = "group",
             kernel: str = "auto", act_dtype: torch.dtype = torch.bfloat16) -> QuantSpec:
    """The grid QAT trains against, with scales rounded as the packed kernel will store them."""
    return QuantSpec(bits=bits, sym=sym, granularity=granularity, group_size=group_size,
                     scale_dtype=torch.float32 if kernel == "dequant" else act_dtype)


def prepare_qat(model: nn.Module, spec: QuantSpec, skip: tuple[str, ...] = ()) -> list[nn.Parameter]:
    """Swap every block linear of a CausalLM for a FakeQuantLinear in place -> the shadow weights
    (the parameters to train). `skip`: substrings of layer names left as they are."""
    if not hasattr(model, "layers"):
        raise ValueError(f"{type(model).__name__} has no `layers` (transformer blocks) to prepare")
    params = []
    for i, block in enumerate(model.layers):
        for name, lin in linear_layers(block):
            if any(s in f"layers.{i}.{name}" for s in skip):
                continue
            fq = FakeQuantLinear(lin, spec)
            block.set_submodule(name, fq)
            params.append(fq.weight)
    if not params:
        raise ValueError("prepare_qat: no linear layer to train (everything skipped?)")
    return params


def convert_qat(model: nn.Module, *, act_dtype: torch.dtype = torch.bfloat16, kernel: str = "auto") -> QuantizeReport:
    """Replace every FakeQuantLinear by a packed QuantLinear on its final grid, in place."""
    spec = None
    report = None
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            for name, mod in list(block.named_modules()):
                if not isinstance(mod, FakeQuantLinear):
                    continue
                spec = mod.spec
                report = report or QuantizeReport("qat", spec)
                w = mod.weight.detach().float()
                q = QuantLinear.from_quantized(quantize_rtn(w, spec), mod.bias, act_dtype=act_dtype, kernel=kernel)
                mse = float((q.dequantized_weight() - mod.quantized_value()).pow(2).mean())
                report.layers.append(LayerReport(f"layers.{i}.{name}", (mod.out_features, mod.in_features), q.kernel,
                                                 w.numel() * 4, q.weight_nbytes, mse))
                block.set_submodule(name, q)
    if report is None:
        raise ValueError("convert_qat: the model has no FakeQuantLinear layers (call prepare_qat first)")
    report.seconds = time.perf_counter() - t0
    return report


def qat_blockwise(model: nn.Module, windows: torch.Tensor, spec: QuantSpec, *, epochs: int = 2, lr: float = 1e-4,
                  batch_size: int = 4, act_dtype: torch.dtype = torch.bfloat16,
                  kernel: str = "auto", progress: bool = True) -> tuple[QuantizeReport, dict]:
    """Block-wise QAT in place (see the module docstring) -> (QuantizeReport, training record).

    windows [n, L]: token windows (kvserve.compress.quant.calibrate.load_calibration). Each block: its
    inputs X [n * L, hidden] (through the already-packed earlier blocks), targets Y = the float
    block on X; `epochs` passes of Adam over the windows in batches of `batch_size`, loss
    mean((block_q(X) - Y)^2), straight-through gradients into the shadow weights; then packed.
    The record holds each block's output MSE with plain RTN (before training) and after."""
    if epochs < 1:
        raise ValueError(f"--qat-epochs must be >= 1, got {epochs}")
    if not (lr > 0):
        raise ValueError(f"--qat-lr must be > 0, got {lr}")
    if batch_size < 1:
        raise ValueError(f"--qat-batch-size must be >= 1, got {batch_size}")
    calibrator = Calibrator(model, windows, collect=())
    seqlen, n = calibrator.seqlen, int(windows.shape[0])
    record = {"blocks": [], "epochs": epochs, "lr": lr, "batch_size": batch_size, "tokens": n * seqlen}
    t0 = time.perf_counter()
    report = QuantizeReport("qat", spec)
    g = torch.Generator().manual_seed(0)

    for i in tqdm(range(len(model.layers)), desc=f"qat {spec.label()}", unit="block", disable=not progress):
        x = calibrator.inputs(i)
        block = model.layers[i]
        with torch.no_grad():
            y = run_block(model, block, x, seqlen, batch_size)
        params = prepare_qat(block_holder(model, i), spec)
        opt = torch.optim.Adam(params, lr=lr)
        mse_before = _block_mse(model, block, x, y, seqlen, batch_size)
        for _ in range(epochs):
            for a in torch.randperm(n, generator=g).split(batch_size):
                rows = (a[:, None] * seqlen + torch.arange(seqlen)).reshape(-1)
                opt.zero_grad(set_to_none=True)
                out = run_windows(lambda h, meta: run_layer(block, h, None, None, meta), model, x[rows], seqlen,
                                  len(a))
                torch.nn.functional.mse_loss(out, y[rows]).backward()
                opt.step()
        mse_after = _block_mse(model, block, x, y, seqlen, batch_size)
        for p in params:
            p.requires_grad_(False)
        sub = convert_qat(block_holder(model, i), act_dtype=act_dtype, kernel=kernel)
        for layer in sub.layers:
            layer.name = f"layers.{i}.{layer.name.split('.', 2)[2]}"
        report.layers.extend(sub.layers)
        record["blocks"].append({"block": i, "mse_rtn": mse_before, "mse_qat": mse_after})
        del x, y
    report.seconds = time.perf_counter() - t0
    record["seconds"] = report.seconds
    return report, record


class _OneBlock(nn.Module):
    """A view of a model holding just block i as `layers` (prepare_qat / convert_qat walk
    `model.layers`), so one block can be prepared and packed alone."""

    def __init__(self, model: nn.Module, i: int):
        super().__init__()
        self.layers = nn.ModuleList([model.layers[i]])


def block_holder(model: nn.Module, i: int) -> nn.Module:
    return _OneBlock(model, i)


def _block_mse(model, block, x, y, seqlen: int, batch_size: int) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(run_block(model, block, x, seqlen, batch_size), y))


def qat(model: nn.Module, windows: torch.Tensor, spec: QuantSpec, train_cfg, *, teacher: nn.Module | None = None,
        temperature: float = 1.0, skip: tuple[str, ...] = (), checkpoint=None, act_dtype: torch.dtype = torch.bfloat16,
        kernel: str = "auto", progress: bool = True) -> tuple[QuantizeReport, object]:
    """Prepare, fine-tune and convert in place -> (QuantizeReport, kvserve.compress.train.TrainReport).

    windows [n, L]: training token windows (kvserve.compress.train.training_windows). teacher: with a
    float model (the unquantized original), the loss is pure logit distillation tau^2 KL(teacher
    || student), the usual QAT objective (LLM-QAT); without one, next-token cross-entropy.
    train_cfg: kvserve.compress.train.TrainConfig (steps, batch size, lr, ...)."""
    params = prepare_qat(model, spec, skip)
    loss = lm_loss if teacher is None else DistillLoss(teacher, temperature=temperature, alpha=1.0)
    t0 = time.perf_counter()
    trained = train(model, windows, loss, train_cfg, params=params, checkpoint=checkpoint, progress=progress)
    report = convert_qat(model, act_dtype=act_dtype, kernel=kernel)
    report.seconds += time.perf_counter() - t0
    return report, trained
