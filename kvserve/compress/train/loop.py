"""A small, resumable training loop for CPU runs: AdamW, warmup + cosine/linear decay, gradient
clipping, a tqdm bar with the running loss, and checkpoints.

Determinism, so that a resumed run equals an uninterrupted one: step s (0-based) trains on the
windows with indices (s * batch_size + j) mod n, j < batch_size (the windows are shuffled once
by their maker, `kvserve.compress.train.data.training_windows`); the learning rate is a function of the
step alone; a checkpoint holds the trained parameters (by name), the AdamW state, the step, the
per-step losses, the torch RNG state and the settings. Resuming from it needs the same settings
(the fields of TrainConfig that change the result), the same trainable parameter names and shapes
and the same windows (a fingerprint is stored); anything else is a ValueError naming what differs.
Checkpoints are written atomically (a temporary file renamed), every `checkpoint_every` steps, at
the end, and when the run is interrupted (Ctrl-C).

The loss: `loss_fn(model, windows [B, L]) -> scalar`. When it also offers `forward_backward`
(kvserve.compress.train.losses.ChunkedLoss: lm_loss, DistillLoss), the loop calls that instead of
`loss_fn(...).backward()`, so the logits of a batch are never materialized at once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from kvserve.loading.cache import replace_atomically

log = logging.getLogger("kvserve.compress.train")

SCHEDULES = ("cosine", "linear", "constant")
# Fields that do not change the trained weights may differ on resume.
_COSMETIC = {"checkpoint_every", "log_every"}


@dataclass
class TrainConfig:
    """Settings of a run; validated on construction (messages name the CLI flags)."""

    steps: int
    batch_size: int = 4
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    seed: int = 0
    checkpoint_every: int = 0  # 0 = only at the end (and on interrupt)
    log_every: int = 10  # 0 = no log lines
    schedule: str = "cosine"  # after warmup: cosine or linear decay to 0, or constant

    def __post_init__(self) -> None:
        ints = {"steps": 1, "batch_size": 1, "warmup_steps": 0, "checkpoint_every": 0, "log_every": 0}
        for name, lo in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"--grad-clip must be >= 0 (0 = off), got {self.grad_clip}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"--warmup-steps ({self.warmup_steps}) must be <= --steps ({self.steps})")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of 0-based step `step`: linear warmup to lr, then the decay."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = self.steps - self.warmup_steps
        frac = (step - self.warmup_steps) / span if span > 0 else 0.0  # 0 at the first decay step
        if self.schedule == "linear":
            return self.lr * (1.0 - frac)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * frac))


@dataclass
class TrainReport:
    """steps: the step count reached (cfg.steps when the run finished); tokens / seconds: those of
    this call; losses: the loss of every step 1..steps (earlier ones read from the checkpoint);
    resumed_from: the step the run resumed from (0 = fresh)."""

    steps: int
    tokens: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def trainable_parameters(model: nn.Module, *, train_embeddings: bool = True) -> list[nn.Parameter]:
    """Every floating parameter of `model`; without train_embeddings, less the token embedding and
    the LM head (tied or not): on a 262144-word vocabulary they are most of the parameters, and
    their gradient and AdamW state dominate the time and memory of a CPU step."""
    skip: set[int] = set()
    if not train_embeddings:
        for name in ("embed_tokens", "lm_head"):
            mod = getattr(model, name, None)
            if isinstance(mod, nn.Module):
                skip.update(id(p) for p in mod.parameters())
    return [p for p in model.parameters() if p.is_floating_point() and id(p) not in skip]


def _fingerprint(windows: torch.Tensor) -> str:
    return f"{tuple(windows.shape)}:" + hashlib.sha1(windows.contiguous().numpy().tobytes()).hexdigest()


def _param_names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"params: {len(missing)} of the given parameters are not parameters of the model")
    out = [names[id(p)] for p in params]
    if len(set(out)) != len(out):
        raise ValueError("params: a parameter is listed twice")
    return out


def _settings(cfg: TrainConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _COSMETIC}


def _save(path: Path, state: dict) -> None:
    """A completed step's state, whole or not at all (a stop mid-write leaves the previous one)."""
    replace_atomically(path, lambda tmp: torch.save(state, tmp))


def _resume(path: Path, cfg: TrainConfig, names: list[str], params: list[nn.Parameter], fingerprint: str,
            opt: torch.optim.Optimizer) -> tuple[int, list[float]]:
    """Load a checkpoint into params / opt after checking it belongs to this run -> (step, losses)."""
    try:  # tensors, numbers, strings and lists only: a checkpoint cannot run code when loaded
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path}: cannot be read ({e.__class__.__name__}: {str(e)[:200]}); delete it "
                         "to start over") from None
    saved = state.get("config", {})
    for k, v in _settings(cfg).items():
        if saved.get(k) != v:
            raise ValueError(f"checkpoint {path}: config field {k!r} differs (checkpoint {saved.get(k)!r}, "
                             f"now {v!r}); resume with the same settings or start a new output folder")
    if state["names"] != names:
        raise ValueError(f"checkpoint {path}: the trainable parameters differ "
                         f"({len(state['names'])} in the checkpoint, {len(names)} now)")
    if state["windows"] != fingerprint:
        raise ValueError(f"checkpoint {path}: the training windows differ (text file, seqlen or seed changed)")
    with torch.no_grad():
        for name, p in zip(names, params):
            t = state["params"][name]
            if t.shape != p.shape:
                raise ValueError(f"checkpoint {path}: parameter {name!r} has shape {tuple(t.shape)}, "
                                 f"the model {tuple(p.shape)}")
            p.copy_(t)
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"]), list(state["losses"])


def train(model: nn.Module, windows: torch.Tensor, loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
          cfg: TrainConfig, *, params: list[nn.Parameter] | None = None, checkpoint: Path | None = None,
          progress: bool = True) -> TrainReport:
    """Train `params` (default: every floating parameter of `model`) for cfg.steps steps of
    cfg.batch_size windows from windows [n, L] int64, minimizing loss_fn(model, batch [B, L]).

    The parameters get requires_grad for the run (the model's others are switched off) and every
    flag is restored afterwards. With `checkpoint` (a file), the run resumes from it when it exists
    and saves to it (see the module docstring). Returns a TrainReport.
    """
    if windows.dim() != 2 or windows.dtype != torch.long or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n >= 1, L >= 2] int64, got {tuple(windows.shape)} {windows.dtype}")
    params = list(params) if params is not None else [p for p in model.parameters() if p.is_floating_point()]
    if not params:
        raise ValueError("params: nothing to train")
    names = _param_names(model, params)
    fingerprint = _fingerprint(windows)
    checkpoint = Path(checkpoint).expanduser() if checkpoint is not None else None

    flags = {id(p): p.requires_grad for p in model.parameters()}
    train_ids = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in train_ids)
    # foreach=False: the per-tensor update keeps no whole-model temporaries (a lower peak on CPU).
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    chunked = getattr(loss_fn, "forward_backward", None)
    n, seqlen = windows.shape
    start, losses = 0, []
    t0 = time.perf_counter()
    step = 0
    try:
        if checkpoint is not None and checkpoint.is_file():
            start, losses = _resume(checkpoint, cfg, names, params, fingerprint, opt)
            log.info("resumed from %s at step %d/%d", checkpoint, start, cfg.steps)
        else:
            torch.manual_seed(cfg.seed)
        step = start
        with tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=not progress) as bar:
            while step < cfg.steps:
                idx = (torch.arange(cfg.batch_size) + step * cfg.batch_size) % n
                batch = windows[idx]
                lr = cfg.lr_at(step)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.zero_grad(set_to_none=True)
                if chunked is not None:
                    loss = chunked(model, batch)
                else:
                    loss = loss_fn(model, batch)
                    loss.backward()
                value = float(loss.detach())
                if not math.isfinite(value):  # before the update: the weights stay usable
                    raise ValueError(f"the loss is {value} at step {step + 1} (try a lower --lr)")
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                step += 1
                losses.append(value)
                recent = losses[-max(cfg.log_every, 1):]
                running = sum(recent) / len(recent)
                bar.set_postfix(loss=f"{running:.4f}", lr=f"{lr:.2e}")
                bar.update(1)
                if cfg.log_every and step % cfg.log_every == 0:
                    rate = (step - start) * cfg.batch_size * seqlen / (time.perf_counter() - t0)
                    msg = f"step {step}/{cfg.steps} loss {running:.4f} lr {lr:.2e} {rate:.0f} tok/s"
                    tqdm.write(msg) if progress else log.info(msg)
                if checkpoint is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 \
                        and step < cfg.steps:
                    _save(checkpoint, _state(cfg, names, params, opt, step, losses, fingerprint))
        if checkpoint is not None:
            _save(checkpoint, _state(cfg, names, params, opt, step, losses, fingerprint))
    except KeyboardInterrupt:
        if checkpoint is not None and step > start:
            _save(checkpoint, _state(cfg, names, params, opt, step, losses, fingerprint))
            log.info("interrupted at step %d; saved %s (run again to resume)", step, checkpoint)
        raise
    finally:
        for p in model.parameters():
            p.grad = None
            p.requires_grad_(flags[id(p)])
    return TrainReport(steps=step, tokens=(step - start) * cfg.batch_size * seqlen,
                       seconds=time.perf_counter() - t0, losses=losses, resumed_from=start)


def _state(cfg: TrainConfig, names: list[str], params: list[nn.Parameter], opt: torch.optim.Optimizer,
           step: int, losses: list[float], fingerprint: str) -> dict:
    return {"config": _settings(cfg), "names": names,
            "params": {n: p.detach().clone() for n, p in zip(names, params)},
            "optimizer": opt.state_dict(), "step": step, "losses": list(losses), "rng": torch.get_rng_state(),
            "windows": fingerprint}
