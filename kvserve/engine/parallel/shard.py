"""Megatron-style shards of a float model: each rank keeps its slice of every weight and a
ModelConfig at its local shapes, so the model classes, the paged KV pool and the C kernels run
unchanged.

- q/k/v, gate/up: column-parallel (each rank its heads / its intermediate rows).
- o_proj, down_proj: row-parallel (each rank its input columns), the partial sums all-reduced
  (`RowParallel`); their bias is added once (rank 0's; zeros elsewhere).
- K/V heads: split when they divide the ranks; with fewer K/V heads than ranks each rank keeps
  the one its query heads read (Gemma 3 270M has one K/V head: every rank keeps it).
- Embedding and LM head: vocabulary-parallel (`VocabParallelEmbedding`: each rank looks up its
  rows, the rest are zeros, all-reduced; the head gives each rank's logits for its rows, which the
  runner gathers). Ranks hold ceil(V / ranks) rows, the last one padded with zero rows that the
  gather cuts off.
- Norms (q/k norms are per head_dim) and rotary tables: replicated.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.loading.loader import finish_model, use_column_major_weights
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.registry import empty_model


class AllReduce:
    """What the parallel modules call to sum over the ranks (a ParallelGroup's method)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(t)


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product (the wrapped linear, packed or not),
    summed over the ranks."""

    def __init__(self, linear: nn.Module, reduce: AllReduce):
        super().__init__()
        self.linear = linear
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.linear(x).contiguous())


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + valid) of the vocabulary (the weight may hold padding rows past
    `valid`); ids elsewhere give zeros here and their row on the rank holding it."""

    def __init__(self, rows: int, dim: int, start: int, valid: int, reduce: AllReduce | None = None):
        super().__init__(rows, dim, device="meta")
        self.start, self.valid = start, valid
        self.reduce = reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.valid)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h = h.masked_fill(outside[:, None], 0.0)
        return h if self.reduce is None else self.reduce(h)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` keeps."""

    rank: int
    world: int
    cfg: ModelConfig  # the full model's

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.world)

    @property
    def first_kv_head(self) -> int:
        """The first K/V head this rank keeps: its own share, or the one its query heads read."""
        c = self.cfg
        if c.num_kv_heads >= self.world:
            return self.rank * self.kv_heads
        return self.rank * self.heads // (c.num_heads // c.num_kv_heads)

    @property
    def vocab_rows(self) -> int:
        return math.ceil(self.cfg.vocab_size / self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def vocab_valid(self) -> int:
        return max(0, min(self.vocab_rows, self.cfg.vocab_size - self.vocab_start))

    def local_config(self) -> ModelConfig:
        """The config each rank's model is built from: its heads and intermediate width; the
        vocabulary stays the full one (the logits the engine sees)."""
        return dataclasses.replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=self.cfg.intermediate_size // self.world)

    def slice(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full model's tensor `name` (a fresh tensor, not a view)."""
        c, D = self.cfg, self.cfg.head_dim
        leaf = name.rsplit(".", 2)
        proj, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
        if proj == "q_proj":
            return _rows(t, self.rank * self.heads * D, self.heads * D)
        if proj in ("k_proj", "v_proj"):
            return _rows(t, self.first_kv_head * D, self.kv_heads * D)
        if proj in ("gate_proj", "up_proj"):
            f = c.intermediate_size // self.world
            return _rows(t, self.rank * f, f)
        if proj == "o_proj":
            return _row_parallel(t, kind, self.rank, self.heads * D)
        if proj == "down_proj":
            return _row_parallel(t, kind, self.rank, c.intermediate_size // self.world)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            out = t.new_zeros(self.vocab_rows, t.shape[1])
            out[:self.vocab_valid] = t[self.vocab_start:self.vocab_start + self.vocab_valid]
            return out
        return t.clone()


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t.narrow(0, start, n).clone(memory_format=torch.contiguous_format)


def _row_parallel(t: torch.Tensor, kind: str, rank: int, n: int) -> torch.Tensor:
    """A row-parallel layer's weight columns [out, n] of this rank; its bias on rank 0 only."""
    if kind == "bias":
        return t.clone() if rank == 0 else torch.zeros_like(t)
    return t.narrow(1, rank * n, n).clone(memory_format=torch.contiguous_format)


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Refuse, naming the field, a model whose heads or widths do not split over `world` ranks."""
    if cfg.mla:
        raise ValueError(f"tensor_parallel_size {world}: MLA models ({cfg.model_type}) are not supported")
    if cfg.moe is not None:
        raise ValueError(f"tensor_parallel_size {world}: mixture-of-experts models ({cfg.model_type}) are not "
                         "supported")
    if cfg.kv_source is not None:
        raise ValueError(f"tensor_parallel_size {world}: models with cross-layer KV sharing (kv_source) are not "
                         "supported")
    if cfg.num_heads % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's num_heads ({cfg.num_heads})")
    if cfg.intermediate_size % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's intermediate_size "
                         f"({cfg.intermediate_size})")
    kvh = cfg.num_kv_heads
    if (kvh >= world and kvh % world) or (kvh < world and world % kvh):
        raise ValueError(f"tensor_parallel_size {world} and num_kv_heads ({kvh}): one must divide the other")


def check_float_weights(model: CausalLM) -> None:
    """Only a plain float model is split: exactly the tensors its config implies, one float dtype
    (quantized, N:M or 16-bit-kept layers hold other tensors)."""
    expected = empty_model(model.config).state_dict()
    state = model.state_dict()
    dtype = state["embed_tokens.weight"].dtype
    odd = [k for k, t in state.items() if k not in expected or tuple(t.shape) != tuple(expected[k].shape)
           or t.dtype != dtype]
    if odd or set(expected) - set(state) or not dtype.is_floating_point:
        raise ValueError(f"tensor_parallel_size > 1 splits float weights, but this model holds other tensors "
                         f"({(odd or sorted(set(expected) - set(state)))[:3]}): use a float model (--weights float, "
                         "an unquantized checkpoint)")


def shard_model(model: CausalLM, rank: int, world: int, reduce: AllReduce) -> CausalLM:
    """A new model holding rank's slices of `model`'s weights (its own tensors: `model` may be
    dropped, or kept by its owner unchanged), at local shapes, its row-parallel projections and
    embedding summing over the ranks through `reduce`. The caller checked that it splits
    (check_shardable, check_float_weights)."""
    plan = ShardPlan(rank, world, model.config)
    device = model.embed_tokens.weight.device
    out = empty_model(plan.local_config())
    out.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, model.config.hidden_size, plan.vocab_start,
                                              plan.vocab_valid, reduce)
    if out.lm_head is not None:
        out.lm_head = nn.Linear(model.config.hidden_size, plan.vocab_rows, bias=False, device="meta")
    state = {name: plan.slice(name, t.detach()) for name, t in model.state_dict().items()}
    out.load_state_dict(state, assign=True, strict=True)
    out.requires_grad_(False)
    if device.type == "cpu" and out.embed_tokens.weight.dtype == torch.float32:
        use_column_major_weights(out)
    for layer in out.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, reduce)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, reduce)
    return finish_model(out, out.config, device)
