"""Healing a pruned model between pruning steps: logit distillation that keeps the zeros.

`distill_heal_fn(teacher, student, opts)` returns the `heal_fn(model, step)` hook of
`prune_model(steps=S, heal_fn=...)` (and what `kvserve prune --steps S --heal-steps N` runs after
every step). Each call trains the student's transformer-block weights for `opts.steps` steps with
kvserve.compress.train's DistillLoss from `teacher` (usually the unpruned model), on the next windows of the
training text (each round sees new ones), and keeps every pruned weight exactly zero: a mask
taken when the round starts multiplies the gradients, so AdamW never moves a zero (its moments of a
masked entry stay 0, and weight decay keeps 0 at 0), and the mask is applied once more at the end.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.compress.train.data import training_windows
from kvserve.compress.train.distill import DistillOptions
from kvserve.compress.train.loop import train, trainable_parameters
from kvserve.compress.train.losses import DistillLoss


def _masks(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """weight -> (weight != 0) for every linear inside the transformer blocks."""
    return {m.weight: m.weight != 0 for m in model.layers.modules() if isinstance(m, nn.Linear)}


def distill_heal_fn(teacher, student, opts: DistillOptions, progress: bool = True):
    """A heal_fn(model, step) distilling `teacher` into `student` (kvserve LoadedModels; the hook's
    `model` is student.model) for opts.steps steps per call, zeros kept (module docstring)."""
    if teacher.model is student.model:
        raise ValueError("healing needs a separate teacher (e.g. the unpruned model loaded again)")
    windows = training_windows(student.tokenizer, opts.seqlen, path=opts.text_file,
                               bos_token_id=student.config.bos_token_id if student.config.add_bos_token else None,
                               max_windows=opts.max_windows, seed=opts.seed)
    loss = DistillLoss(teacher.model, temperature=opts.temperature, alpha=opts.alpha, chunk_rows=opts.chunk_rows)
    cfg = opts.train_config()
    history: list[dict] = []

    def heal(model: nn.Module, step: int) -> None:
        masks = _masks(model)
        flags = {p: p.requires_grad for p in masks}
        for p in masks:  # a hook needs requires_grad; train() sets the flags it trains anyway
            p.requires_grad_(True)
        hooks = [p.register_hook(lambda g, m=m: g * m) for p, m in masks.items()]
        start = (len(history) * cfg.steps * cfg.batch_size) % windows.shape[0]  # new windows each round
        try:
            report = train(model, windows.roll(-start, 0), loss, cfg,
                           params=trainable_parameters(model, train_embeddings=opts.train_embeddings),
                           progress=progress)
        finally:
            for h in hooks:
                h.remove()
            for p, flag in flags.items():
                p.requires_grad_(flag)
        with torch.no_grad():
            for p, m in masks.items():
                p.mul_(m)
        history.append({"after_step": step, "steps": report.steps, "tokens": report.tokens,
                        "seconds": report.seconds, "loss_first": report.losses[0], "loss_last": report.losses[-1]})

    heal.history = history  # per round: steps, tokens, seconds, first / last loss
    return heal
