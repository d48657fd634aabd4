"""The forward pass through torch.compile (EngineConfig.compile), piecewise as vLLM compiles it.

Dynamo traces embedding, norms, projections, RoPE and MLPs of every layer into one graph with a
dynamic token count (inductor fuses the elementwise work around PyTorch's matmuls); the part that
depends on the step's paged metadata, the K/V write and attention over the pool, is one opaque
op per layer (`kvserve::step_attention`) that runs eagerly with the step's KVCache and
AttentionMetadata, handed over by `step_context` rather than as graph inputs, so that block
tables and sequence lists never become guards or recompiles. Should dynamo give up on the graph
(a recompile limit, say) and run `step_graph` eagerly, the same op and context serve that too.

Inside the graph kvserve's ctypes kernels stand aside (`kernels.kernel_lib` gives None while
dynamo traces) and the torch ops they replace are traced instead; the attention op itself still
reaches the C decode / prefill attention kernels. Logits stay outside the graph.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from kvserve.model.attention import Attention, AttentionMetadata, KeptRows, KVCache


@dataclass
class _Step:
    model: nn.Module  # its layers[i].self_attn is layer i's Attention (check_compilable)
    kv_cache: KVCache
    meta: AttentionMetadata


_CURRENT: list[_Step] = []  # a stack: a draft model's step may run inside a target's


@contextmanager
def step_context(model: nn.Module, kv_cache: KVCache, meta: AttentionMetadata) -> Iterator[None]:
    """What `kvserve::step_attention` reads while the compiled graph of one step runs."""
    _CURRENT.append(_Step(model, kv_cache, meta))
    try:
        yield
    finally:
        _CURRENT.pop()


@torch.library.custom_op("kvserve::step_attention", mutates_args=())
def step_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int) -> torch.Tensor:
    """Layer `layer`'s K/V write and attention: q [T, H, D] normed and rotated, k, v [T, KVH, D]
    (k rotated; None for a layer reusing another's K/V) -> [T, H * D] before o_proj. The pool it
    writes is not a graph input: it lives in the step context, like the metadata."""
    if not _CURRENT:
        raise RuntimeError("kvserve::step_attention ran outside a step (no step_context)")
    step = _CURRENT[-1]
    return step.model.layers[layer].self_attn.attend_written(q, k, v, step.kv_cache, step.meta)


@step_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def check_compilable(model: nn.Module) -> None:
    """Every layer's attention must be kvserve's `Attention` (MLA has no compiled form yet)."""
    for i, layer in enumerate(model.layers):
        if type(getattr(layer, "self_attn", None)) is not Attention:
            raise ValueError(f"compile: layer {i} has {type(getattr(layer, 'self_attn', None)).__name__} attention; "
                             f"torch.compile covers models with kvserve's Attention (not MLA)")


def compile_step(model: nn.Module, **options):
    """`model.step_graph` through torch.compile, dynamic in the token count; `options` go to
    torch.compile. Run it with `run_compiled`. The graph is built on the first step of each shape
    class (one token, several): that step pays the warm-up."""
    check_compilable(model)
    return torch.compile(model.step_graph, dynamic=True, **options)


def run_compiled(model: nn.Module, compiled, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                 meta: AttentionMetadata, keep: KeptRows | None = None) -> torch.Tensor:
    """model.forward (every layer, no custom attention hook) through `compiled` (compile_step's)."""
    with step_context(model, kv_cache, meta):
        h = compiled(input_ids, positions)
    # Every row ran (the graph has no kept-row form); the norm is per row, so picking after is equal.
    return h if keep is None else h.index_select(0, keep.rows)
