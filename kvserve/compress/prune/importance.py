"""Activation-based importance for structured pruning (Minitron, Muralidharan et al. 2024).

One forward pass over calibration windows (no KV cache, `kvserve.tools.eval.windows.window_hidden`) with
forward hooks scores every prunable unit of the ORIGINAL model at once:

  heads     [num_layers, num_heads]   each query head's attention output before o_proj:
            || attn_out_head ||_2 per token (one head_dim slice per head)
  neurons   [num_layers, intermediate] each MLP neuron's activation |act(gate) * up|_j
  channels  [hidden]                  |output|_c of every hidden-sized RMSNorm (the norms before
            attention / MLP, Gemma's post-norms and the final norm), summed over the norms
  layers    [num_layers]              1 - cos(block input, block output), mean over tokens

Aggregation (Minitron's best setting): per window, the per-token score is averaged over the
sequence; over windows the L2 norm is taken (sqrt of the sum of squares). Layers are a plain mean
over all tokens.

A second criterion for heads and neurons comes out of the same pass, "contribution"
(head_contribution, neuron_contribution): the norm of what the unit writes into the residual
stream through its output weights, || W_o[:, head] @ attn_out_head ||_2 and
|act(gate) * up|_j * || W_down[:, j] ||_2. It sees a unit whose output weights are zero (it does
nothing, yet Minitron's "activation" criterion scores it by its activation). On Gemma 3 270M the
literal Minitron criterion pruned better (benchmarks/prune_structured.py: 30% of the MLP neurons
removed, WikiText-2 PPL before healing 67 vs 83), so "activation" is the default.
`Importance.select(criterion)` gives the scores a pruning plan ranks by.

Shapes: calibration windows [n, L] int64 (token ids; BOS first for models that use one).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from kvserve.model.base import CausalLM, residual_sum
from kvserve.model.layers import RMSNorm
from kvserve.tools.eval.windows import window_hidden

CRITERIA = ("activation", "contribution")


@dataclass
class Importance:
    """Scores of the original model's units (higher = more important); all fp64 on CPU."""

    heads: torch.Tensor  # [num_layers, num_heads]  ("activation" criterion)
    neurons: torch.Tensor  # [num_layers, intermediate_size]
    channels: torch.Tensor  # [hidden_size]
    layers: torch.Tensor  # [num_layers]
    num_windows: int
    num_tokens: int
    head_contribution: torch.Tensor | None = None  # [num_layers, num_heads] ("contribution")
    neuron_contribution: torch.Tensor | None = None  # [num_layers, intermediate_size]

    def select(self, criterion: str = "activation") -> "Importance":
        """These scores with heads / neurons ranked by `criterion` ("activation" or "contribution")."""
        if criterion not in CRITERIA:
            raise ValueError(f"--importance must be one of {', '.join(CRITERIA)}, got {criterion!r}")
        if criterion == "activation":
            return self
        if self.head_contribution is None or self.neuron_contribution is None:
            raise ValueError("these importance scores carry no contribution scores for heads / neurons")
        return replace(self, heads=self.head_contribution, neurons=self.neuron_contribution)


def _check_windows(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32):
        raise ValueError("calibration: expected token-id windows [n, L] (int64), got "
                         f"{getattr(windows, 'shape', type(windows))}")
    n, length = windows.shape
    if n < 1 or length < 1:
        raise ValueError(f"calibration: empty windows {tuple(windows.shape)}")
    vocab = model.config.vocab_size
    if int(windows.min()) < 0 or int(windows.max()) >= vocab:
        raise ValueError(f"calibration: token ids must lie in [0, {vocab})")
    return windows.long()


def _residual_norms(model: CausalLM) -> list[RMSNorm]:
    """Every RMSNorm over the hidden size (the q/k norms over head_dim are not channel norms)."""
    d = model.config.hidden_size
    return [m for name, m in model.named_modules()
            if isinstance(m, RMSNorm) and m.weight.numel() == d and not name.endswith(("q_norm", "k_norm"))]


class _Collector:
    """Forward hooks that accumulate the scores of one batch of `b` windows of `l` tokens."""

    def __init__(self, model: CausalLM):
        cfg = model.config
        self.model = model
        self.b = self.l = 0
        f64 = torch.float64
        self.head_contrib = torch.zeros(cfg.num_layers, cfg.num_heads, dtype=f64)
        self.neuron_contrib = torch.zeros(cfg.num_layers, cfg.intermediate_size, dtype=f64)
        self.head_act = torch.zeros_like(self.head_contrib)
        self.neuron_act = torch.zeros_like(self.neuron_contrib)
        self.channels = torch.zeros(cfg.hidden_size, dtype=f64)
        self.layer_sum = torch.zeros(cfg.num_layers, dtype=f64)
        self._batch_channels: torch.Tensor | None = None  # [b, hidden]: summed over the norms of this batch
        self._handles: list = []

    # -- hooks -------------------------------------------------------------------------------
    def _per_window(self, x: torch.Tensor) -> torch.Tensor:
        """x [b*l, ...] per-token scores -> [b, ...] mean over each window's tokens (fp64)."""
        return x.view(self.b, self.l, *x.shape[1:]).double().mean(1)

    def _head_hook(self, i: int, o_proj: nn.Linear):
        cfg = self.model.config
        w = o_proj.weight.float().view(cfg.hidden_size, cfg.num_heads, cfg.head_dim)  # [d, H, D]

        def hook(_mod, args):
            x = args[0].float().view(-1, cfg.num_heads, cfg.head_dim)  # [b*l, H, D]
            contrib = torch.einsum("thk,dhk->thd", x, w)  # [b*l, H, d]: each head's share of o_proj
            self.head_contrib[i] += self._per_window(contrib.norm(dim=-1)).pow(2).sum(0)
            self.head_act[i] += self._per_window(x.norm(dim=-1)).pow(2).sum(0)
        return hook

    def _neuron_hook(self, i: int, down: nn.Linear):
        col_norm = down.weight.float().norm(dim=0).double()  # [I]

        def hook(_mod, args):
            a = self._per_window(args[0].float().abs())  # [b, I]
            self.neuron_contrib[i] += (a * col_norm).pow(2).sum(0)
            self.neuron_act[i] += a.pow(2).sum(0)
        return hook

    def _channel_hook(self, _mod, _args, out):
        s = self._per_window(out.float().abs())  # [b, d]
        self._batch_channels = s if self._batch_channels is None else self._batch_channels + s

    def _layer_hook(self, i: int):
        def hook(_mod, args, out):
            # A layer takes and returns the residual stream as an (x, residual) pair.
            block_in, block_out = residual_sum(args[0], args[1]), residual_sum(*out)
            cos = torch.nn.functional.cosine_similarity(block_in.float(), block_out.float(), dim=-1)  # [b*l]
            self.layer_sum[i] += (1.0 - cos.double()).sum()
        return hook

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "_Collector":
        m = self.model
        for i, layer in enumerate(m.layers):
            o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
            self._handles.append(o_proj.register_forward_pre_hook(self._head_hook(i, o_proj)))
            self._handles.append(down.register_forward_pre_hook(self._neuron_hook(i, down)))
            self._handles.append(layer.register_forward_hook(self._layer_hook(i)))
        for norm in _residual_norms(m):
            self._handles.append(norm.register_forward_hook(self._channel_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def run_batch(self, batch: torch.Tensor) -> None:
        self.b, self.l = batch.shape
        self._batch_channels = None
        window_hidden(self.model, batch)
        if self._batch_channels is not None:
            self.channels += self._batch_channels.pow(2).sum(0)


def compute_importance(model: CausalLM, windows: torch.Tensor, batch_size: int = 4) -> Importance:
    """Score heads, neurons, embedding channels and layers of `model` in one pass over
    windows [n, L] (see the module docstring)."""
    windows = _check_windows(model, windows)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n, length = windows.shape
    with torch.inference_mode(), _Collector(model) as c:
        for a in range(0, n, batch_size):
            c.run_batch(windows[a:a + batch_size])
    return Importance(heads=c.head_act.sqrt(), neurons=c.neuron_act.sqrt(), channels=c.channels.sqrt(),
                      layers=c.layer_sum / (n * length), num_windows=n, num_tokens=n * length,
                      head_contribution=c.head_contrib.sqrt(), neuron_contribution=c.neuron_contrib.sqrt())


def head_importance(model: CausalLM, windows: torch.Tensor, batch_size: int = 4,
                    criterion: str = "activation") -> torch.Tensor:
    """[num_layers, num_heads] (one calibration pass; use `compute_importance` for all kinds)."""
    return compute_importance(model, windows, batch_size).select(criterion).heads


def neuron_importance(model: CausalLM, windows: torch.Tensor, batch_size: int = 4,
                      criterion: str = "activation") -> torch.Tensor:
    """[num_layers, intermediate_size]."""
    return compute_importance(model, windows, batch_size).select(criterion).neurons


def channel_importance(model: CausalLM, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """[hidden_size]."""
    return compute_importance(model, windows, batch_size).channels


def layer_importance(model: CausalLM, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """[num_layers]: mean over tokens of 1 - cos(block input, block output)."""
    return compute_importance(model, windows, batch_size).layers
