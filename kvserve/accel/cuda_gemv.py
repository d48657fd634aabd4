"""Small-batch matmuls on CUDA: Triton matrix-vector kernels where they beat cuBLAS, chosen by timing.

A decode step of 1-4 sequences multiplies each weight by a few rows (kernels/triton_gemv.py).
Which of cuBLAS and the Triton tilings streams a weight fastest depends on the GPU and the
shape, so `tune_small_batch_matmuls` measures instead of guessing: for each kind of projection
(q/k/v, o, gate/up, and the down projection with the activation fused in front of it), one CUDA
graph runs that projection of every layer once, from the model's own weights (more bytes than
the L2 cache holds, as in a real step), for each candidate, and the fastest is kept, for one row
and for four. A kind where cuBLAS wins keeps cuBLAS, so the step never gets slower than the
measurement says.

The choice rides on the modules: an nn.Linear becomes a `GemvLinear` (same parameters, same
state_dict), a `FusedLinear` gets a `gemv` choice, a GatedMLP a `down_gated` product. Off CUDA
nothing is tuned and nothing changes; the tests set choices by hand and run the kernels through
Triton's interpreter.
"""
from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.accel.fused_linear import FusedLinear, linear_sharing
from kvserve.model.attention import Attention
from kvserve.model.layers import GatedMLP

if TYPE_CHECKING:
    from kvserve.kernels.triton_gemv import GemvConfig

log = logging.getLogger(__name__)

CUBLAS = "cublas"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    """kernels/triton_gemv.py, imported on first use."""
    from kvserve.kernels import (
        triton_gemv,  # Triton comes with CUDA builds of torch only
    )

    return triton_gemv


_IN_GRAPH: ContextVar[bool] = ContextVar("kvserve_small_batch_graph", default=False)


@contextmanager
def graph_capture():
    """Where the small-batch choices apply: the decode graphs' warm-up and capture
    (engine/cuda_graphs.py) run inside this. The tilings won as graph replays; launched one by
    one from Python, a Triton kernel costs the host more than cuBLAS, so eager steps keep cuBLAS."""
    token = _IN_GRAPH.set(True)
    try:
        yield
    finally:
        _IN_GRAPH.reset(token)


@dataclass
class GemvChoice:
    """The kernel a weight's small-batch products take: per row bucket (1: one row; 4: two to
    four), a Triton tiling, or None for cuBLAS (F.linear)."""

    by_rows: dict[int, GemvConfig | None] = field(default_factory=dict)

    def config(self, x: torch.Tensor, weight: torch.Tensor) -> GemvConfig | None:
        """The tiling for input x [..., K], or None where cuBLAS (or the module's own path) runs:
        outside `graph_capture`, more rows than a bucket, autograd, dtypes that differ, a
        compiled graph being traced."""
        if not _IN_GRAPH.get():
            return None
        rows = x.numel() // max(1, x.shape[-1])
        if not 0 < rows <= _kernels().MAX_ROWS or x.dtype != weight.dtype or x.dtype not in _FLOATS:
            return None
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        return self.by_rows.get(1 if rows == 1 else _kernels().MAX_ROWS)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, weight, bias), through the chosen tiling where one applies."""
        config = self.config(x, weight)
        if config is None:
            return F.linear(x, weight, bias)
        return _kernels().gemv(x, weight, bias, config)


class GemvLinear(nn.Linear):
    """An nn.Linear whose small-batch calls take the Triton tiling chosen for its shape (made by
    `linear_sharing`: the layer's own parameters)."""

    gemv: GemvChoice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv.linear(x, self.weight, self.bias)


class GatedDown:
    """down(act(gate) * up) as one kernel for small batches (GatedMLP.down_gated): the down
    projection's weight, the activation applied to each tile of gate and up as it is loaded."""

    def __init__(self, down: nn.Linear, gelu_tanh: bool, choice: GemvChoice):
        self.down = down
        self.gelu_tanh = gelu_tanh
        self.gemv = choice

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """[..., I] halves of the gate/up output -> [..., hidden], or None (the MLP's own path)."""
        config = self.gemv.config(gate, self.down.weight)
        if config is None or up.dtype != gate.dtype:
            return None
        return _kernels().gated_gemv(gate, up, self.down.weight, self.down.bias, self.gelu_tanh, config)


@dataclass
class _Member:
    """One layer's projection of a kind: its weight, and how to attach a choice to it."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    install: Callable[[GemvChoice], None]
    mlp: GatedMLP | None = None  # down+act: the MLP (its activation, for the cuBLAS candidate)




def _members(model: nn.Module) -> dict[tuple[str, tuple[int, ...], bool], list[_Member]]:
    """The projections of the model's attention layers and gated MLPs that can take the kernels,
    grouped by (kind, weight shape, has bias); kinds: qkv, o, gate_up, down+act."""
    groups: dict[tuple, list[_Member]] = defaultdict(list)

    def add(kind: str, weight, bias, install, mlp=None) -> None:
        if weight.dtype in _FLOATS:  # (the device is the caller's: prepare_model tunes on CUDA only)
            groups[(kind, tuple(weight.shape), bias is not None)].append(_Member(weight, bias, install, mlp))

    def set_gemv(module):
        return lambda choice: setattr(module, "gemv", choice)

    def set_o(attn):
        return lambda choice: setattr(attn, "o_proj", linear_sharing(GemvLinear, attn.o_proj, gemv=choice))

    def set_down(mlp):
        return lambda choice: setattr(mlp, "down_gated", GatedDown(mlp.down_proj, mlp.gelu_tanh, choice))

    for m in model.modules():
        if isinstance(m, Attention):
            if isinstance(m.qkv_proj, FusedLinear):
                add("qkv", m.qkv_proj.weight, m.qkv_proj.bias, set_gemv(m.qkv_proj))
            if type(m.o_proj) in (nn.Linear, GemvLinear):
                add("o", m.o_proj.weight, m.o_proj.bias, set_o(m))
        elif isinstance(m, GatedMLP):
            if isinstance(m.gate_up_proj, FusedLinear):
                add("gate_up", m.gate_up_proj.weight, m.gate_up_proj.bias, set_gemv(m.gate_up_proj))
            if type(m.down_proj) in (nn.Linear, GemvLinear) and (m.gelu_tanh or m.silu):
                add("down+act", m.down_proj.weight, m.down_proj.bias, set_down(m), mlp=m)
    return groups


def _product(kind: str, member: _Member, config: GemvConfig | None, x: torch.Tensor) -> torch.Tensor:
    """One member's product of input x with the tiling `config` (None: cuBLAS, after the
    activation's own kernel for down+act, which is the path the fused kernel replaces); for
    down+act x holds gate and up side by side."""
    w, b = member.weight, member.bias
    if kind != "down+act":
        return F.linear(x, w, b) if config is None else _kernels().gemv(x, w, b, config)
    gate, up = x.chunk(2, dim=-1)
    if config is None:
        return F.linear(member.mlp.activate(gate, up), w, b)
    return _kernels().gated_gemv(gate, up, w, b, member.mlp.gelu_tanh, config)


def _input(kind: str, members: list[_Member], rows: int) -> torch.Tensor:
    w = members[0].weight
    width = 2 * w.shape[1] if kind == "down+act" else w.shape[1]
    return torch.randn(rows, width, dtype=w.dtype, device=w.device)


def _runner(kind: str, members: list[_Member], config: GemvConfig | None, rows: int) -> Callable[[], None]:
    """A function making this kind's product for every member once, from one random input of
    `rows` rows, with the tiling `config` (None: cuBLAS)."""
    x = _input(kind, members, rows)

    def run() -> None:
        for m in members:
            _product(kind, m, config, x)
    return run


def _agrees(kind: str, members: list[_Member], config: GemvConfig, rows: int) -> bool:
    """The tiling's product equals cuBLAS's within the dtype's rounding (summed in another
    order), on the first member: a kernel that computes something else is never chosen."""
    x = _input(kind, members, rows)
    want = _product(kind, members[0], None, x).float()
    got = _product(kind, members[0], config, x).float()
    tol = (1e-4 if x.dtype == torch.float32 else 2 ** -6) * (float(want.abs().max()) + 1.0)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol


def graph_time_us(run: Callable[[], None], calls: int, replays: int = 10) -> float:
    """Microseconds a product takes inside a CUDA graph of `run` (which makes `calls` of them):
    the median of `replays` timed replays, after a warm-up (Triton compiles, cuBLAS picks)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def pick(us: dict[str, float]) -> str:
    """The fastest candidate; on a tie cuBLAS."""
    return min(us, key=lambda c: (us[c], c != CUBLAS))


@torch.no_grad()  # as the engine's steps run: the activation's own kernel applies only without autograd
def tune_small_batch_matmuls(model: nn.Module, timer: Callable[[Callable[[], None], int], float] = graph_time_us
                             ) -> list[dict]:
    """Time cuBLAS and each Triton tiling for every projection kind of `model` (float weights on
    CUDA), at one row and at four, and attach the fastest. A tiling whose product disagrees
    with cuBLAS's is rejected untimed. Returns one record per kind and bucket: {"kind", "shape",
    "rows", "us": {candidate: microseconds a product}, "chosen", "rejected"}. `timer(run,
    calls)` measures; the tests pass their own."""
    configs, max_rows = _kernels().CONFIGS, _kernels().MAX_ROWS
    records = []
    for (kind, shape, _), members in _members(model).items():
        choice = GemvChoice()
        for rows in (1, max_rows):
            # Four rows try the one-row winner only: each tiling is a compile, and a device's minutes are few.
            candidates = list(configs) if rows == 1 else [c for c in (choice.by_rows[1],) if c is not None]
            rejected = [str(c) for c in candidates if not _agrees(kind, members, c, rows)]
            us = {CUBLAS: timer(_runner(kind, members, None, rows), len(members))}
            for config in candidates:
                if str(config) not in rejected:
                    us[str(config)] = timer(_runner(kind, members, config, rows), len(members))
            chosen = pick(us)
            choice.by_rows[rows] = next((c for c in candidates if str(c) == chosen), None)
            records.append({"kind": kind, "shape": list(shape), "rows": rows,
                            "us": {k: round(v, 2) for k, v in us.items()}, "chosen": chosen, "rejected": rejected})
            if rejected:
                log.warning("small-batch %s %s x%d: %s disagreed with cuBLAS, not timed", kind, list(shape), rows,
                            ", ".join(rejected))
            log.info("small-batch %s %s x%d: %s (%s)", kind, list(shape), rows, chosen,
                     ", ".join(f"{k} {v:.1f} us" for k, v in us.items()))
        for m in members:  # one choice object: a kind's layers share it
            m.install(choice)
    return records


def use_cublas(model: nn.Module) -> None:
    """Drop every small-batch choice: cuBLAS (and the separate activation kernel) for all
    products again, as the engine runs with pack_weights=False."""
    for m in model.modules():
        if isinstance(m, (FusedLinear, GemvLinear)):
            m.gemv = GemvChoice() if isinstance(m, GemvLinear) else None
        elif isinstance(m, GatedMLP):
            m.down_gated = None
