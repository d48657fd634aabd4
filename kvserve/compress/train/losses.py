"""Training losses over windows of token ids, computed a chunk of rows at a time.

Every position of a window [B, L] predicts the next token of its window: the B * (L - 1) rows
hidden[:, :-1] are scored against windows[:, 1:] (the perplexity harness's convention, BOS
position included). Losses are means over those rows.

Why chunks: a vocabulary of 262144 (Gemma 3) makes the logits of a whole batch huge (B = 4,
L = 512: 2 GiB of fp32 per copy, and a loss holds several copies). So the final hidden states are
computed once for the batch and the logits + loss are formed `chunk_rows` rows at a time. Two
ways to get gradients through that, both exact:

* `loss(model, windows)` returns a scalar with its autograd graph; each chunk runs under
  activation checkpointing (`torch.utils.checkpoint`), so only the chunk's hidden rows are kept
  and its logits are recomputed during backward. Handy anywhere a tensor loss is wanted; it costs
  one extra LM-head matmul per row.
* `loss.forward_backward(model, windows)` does the backward pass itself and returns the detached
  loss: the hidden states are detached into a leaf `h`; each chunk's loss is formed and
  backpropagated at once (its gradient accumulates in h.grad and in the head's weights, and its
  logits are freed); finally the body's graph is backpropagated with `hidden.backward(h.grad)`.
  No recomputation; peak memory = one chunk of logits. `kvserve.compress.train.loop.train` uses this when
  the loss offers it (the `ChunkedLoss` protocol), `loss(...).backward()` otherwise.

Gemma's final logit softcapping is part of `model.compute_logits`, so it is in both losses.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kvserve.tools.eval.windows import window_hidden

DEFAULT_CHUNK_ROWS = 128  # 128 x 262144 fp32 logits = 128 MiB per copy


@runtime_checkable
class ChunkedLoss(Protocol):
    """A loss `train` can run without materializing the logits of a whole batch."""

    def __call__(self, model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
        """windows [B, L] int64 -> scalar loss with its graph."""

    def forward_backward(self, model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
        """Backpropagate the loss of windows [B, L] into the parameters' .grad -> detached scalar."""


def _check_windows(windows: torch.Tensor) -> None:
    if windows.dim() != 2 or windows.dtype != torch.long:
        raise ValueError(f"windows must be [B, L] int64, got {tuple(windows.shape)} {windows.dtype}")
    if windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must hold at least one window of >= 2 tokens, got {tuple(windows.shape)}")


class _RowLoss:
    """Shared machinery: subclasses give the summed loss of a chunk of rows (`_chunk_sum`) and,
    optionally, per-row side inputs computed without gradients (`_aux`)."""

    def __init__(self, chunk_rows: int = DEFAULT_CHUNK_ROWS):
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.chunk_rows = chunk_rows

    def _aux(self, model: nn.Module, windows: torch.Tensor) -> torch.Tensor | None:
        return None

    def _chunk_sum(self, model: nn.Module, h: torch.Tensor, targets: torch.Tensor,
                   aux: torch.Tensor | None) -> torch.Tensor:
        """h [r, hidden] rows, targets [r] next tokens, aux [r, ...] or None -> summed loss (scalar)."""
        raise NotImplementedError

    @staticmethod
    def _rows(model: nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> scored hidden rows [B * (L - 1), hidden] (with graph when grad is on) and targets [B * (L - 1)]."""
        _check_windows(windows)
        hidden = window_hidden(model, windows)
        return hidden[:, :-1].reshape(-1, hidden.shape[-1]), windows[:, 1:].reshape(-1)

    def _spans(self, n: int):
        return ((a, min(a + self.chunk_rows, n)) for a in range(0, n, self.chunk_rows))

    def __call__(self, model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
        """windows [B, L] -> mean loss per scored token (scalar, with graph when grad is enabled)."""
        rows, targets = self._rows(model, windows)
        aux = self._aux(model, windows)
        n = rows.shape[0]
        grad = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in model.parameters()))
        total = rows.new_zeros(())
        for a, b in self._spans(n):
            part_aux = None if aux is None else aux[a:b]
            if grad:  # keep only the chunk's rows; its logits are recomputed in backward
                part = checkpoint(self._chunk_sum, model, rows[a:b], targets[a:b], part_aux, use_reentrant=False)
            else:
                part = self._chunk_sum(model, rows[a:b], targets[a:b], part_aux)
            total = total + part
        return total / n

    def forward_backward(self, model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
        """Backpropagate the mean loss of windows [B, L] chunk by chunk -> the loss, detached."""
        rows, targets = self._rows(model, windows)
        aux = self._aux(model, windows)
        n = rows.shape[0]
        h = rows.detach().requires_grad_(rows.requires_grad)
        total = torch.zeros((), dtype=torch.float64)
        for a, b in self._spans(n):
            part = self._chunk_sum(model, h[a:b], targets[a:b], None if aux is None else aux[a:b]) / n
            if part.requires_grad:
                part.backward()  # into h.grad and the head's weights; frees this chunk's logits
            total += part.detach().double()
        if rows.requires_grad and h.grad is not None:
            rows.backward(h.grad)  # through the decoder body
        return total.float()


class LMLoss(_RowLoss):
    """Mean next-token cross-entropy of the model's own predictions (nats per token)."""

    def _chunk_sum(self, model, h, targets, aux):
        return F.cross_entropy(model.compute_logits(h), targets, reduction="sum")


class DistillLoss(_RowLoss):
    """Logit distillation (Hinton et al. 2015), mean per scored token:

        (1 - alpha) * CE(student, next token) + alpha * tau^2 * KL(softmax(t / tau) || softmax(s / tau))

    with s, t the student's and teacher's logits (softcapped as the models compute them) and
    tau = temperature; the tau^2 keeps the soft term's gradient scale independent of tau. The
    teacher runs under torch.no_grad: its final hidden states once per batch, its logits a chunk
    at a time beside the student's. Teacher and student must share the vocabulary.
    """

    def __init__(self, teacher: nn.Module, *, temperature: float = 1.0, alpha: float = 0.5,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS):
        super().__init__(chunk_rows)
        if not temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {temperature}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"--alpha must be in [0, 1], got {alpha}")
        self.teacher, self.temperature, self.alpha = teacher, float(temperature), float(alpha)

    def _aux(self, model, windows):
        t_vocab, s_vocab = self.teacher.config.vocab_size, model.config.vocab_size
        if t_vocab != s_vocab:
            raise ValueError(f"--teacher: the teacher's vocabulary ({t_vocab}) differs from the student's ({s_vocab})")
        if self.alpha == 0.0:
            return None  # plain CE: the teacher is not needed
        with torch.no_grad():
            hidden = window_hidden(self.teacher, windows)
        return hidden[:, :-1].reshape(-1, hidden.shape[-1])

    def _chunk_sum(self, model, h, targets, aux):
        s = model.compute_logits(h)
        loss = s.new_zeros(())
        if self.alpha < 1.0:
            loss = loss + (1.0 - self.alpha) * F.cross_entropy(s, targets, reduction="sum")
        if self.alpha > 0.0:
            tau = self.temperature
            with torch.no_grad():
                log_pt = torch.log_softmax(self.teacher.compute_logits(aux) / tau, dim=-1)
            log_ps = torch.log_softmax(s / tau, dim=-1)
            kl = F.kl_div(log_ps, log_pt, log_target=True, reduction="sum")  # sum_rows KL(P_t || P_s)
            loss = loss + self.alpha * tau * tau * kl
        return loss


lm_loss = LMLoss()
"""`lm_loss(model, windows [B, L]) -> scalar`: mean next-token CE; also a `ChunkedLoss`
(`lm_loss.forward_backward`), so `train(model, windows, lm_loss, cfg)` runs chunked."""


def distill_loss(student: nn.Module, teacher: nn.Module, windows: torch.Tensor, *, temperature: float = 1.0,
                 alpha: float = 0.5) -> torch.Tensor:
    """(1 - alpha) * CE(student) + alpha * tau^2 * KL(softmax(teacher / tau) || softmax(student / tau)),
    mean per scored token of windows [B, L] (see DistillLoss; for `train`, pass a DistillLoss)."""
    return DistillLoss(teacher, temperature=temperature, alpha=alpha)(student, windows)
