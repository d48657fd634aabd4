"""Structured (Minitron-style) pruning: a genuinely smaller dense model.

`structured_prune(loaded, calibration=windows, prune_heads=..., ffn_keep=..., hidden_keep=...,
drop_layers=...)` scores the ORIGINAL model's units in one calibration pass
(kvserve/compress/prune/importance.py), keeps the most important ones and copies their weights into a new
model of the smaller shape, described by a new ModelConfig (`dataclasses.replace`). The result is
an ordinary dense LoadedModel: `kvserve.loading.save.save_model` writes it as a normal model folder
that `LLM(DIR)` / `load_model(DIR)` and HF transformers read.

What each kind removes (the shape stays uniform across layers, as ModelConfig requires):
  prune_heads  query heads per layer: rows of q_proj (and its bias), columns of o_proj. With
               GQA/MQA every KV group keeps the same number of query heads (H' / KVH per group,
               the group's most important ones), so H - prune_heads must be a multiple of KVH.
  ffn_keep     MLP neurons per layer (each layer its own most important ones): rows of gate/up,
               columns of down. The count is rounded to a multiple of 64 (16 for intermediate
               sizes under 1024) so matmul kernels keep aligned shapes.
  hidden_keep  embedding channels (the same channels in every layer, they are the residual
               stream): embedding / LM-head columns, every hidden-sized norm weight, the input
               columns of q/k/v/gate/up and the output rows of o/down. Rounded like ffn_keep.
  drop_layers  whole decoder blocks, those with the lowest 1 - cos(block input, block output);
               layer_types follow the kept blocks.

Two consequences of hidden pruning:
  * Gemma multiplies the embedding by sqrt(hidden_size), and the model computes that constant from
    the config. To keep the ORIGINAL sqrt(d) the embedding rows are multiplied by
    sqrt(d) / sqrt(d'); the LM head is the same (tied) matrix, so the final norm's scale is divided
    by the same ratio ((1 + w) -> (1 + w) / r for Gemma's offset norms) and the logits are
    unchanged by the fold. HF's Gemma3 scales by sqrt(hidden_size) too, so the folder stays
    HF-compatible.
  * RMSNorm now averages the square over d' < d channels, so normalised activations change a
    little even for kept channels. That is inherent in Minitron width pruning (it is what the
    healing / distillation step repairs); nothing here compensates for it (multiplying every norm
    gain by sqrt(d / d') was tried on Gemma 3 270M and did not help).

With nothing removed the new model holds exactly the same tensors: its logits equal the original
ones bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.compress.prune.importance import CRITERIA, Importance, compute_importance
from kvserve.loading.loader import build_model
from kvserve.model.base import CausalLM
from kvserve.model.config import SLIDING, ModelConfig
from kvserve.weights.spec import is_quantized_module


@dataclass
class PrunePlan:
    """Which units of the original model survive (indices sorted ascending)."""

    layers: list[int]  # kept decoder blocks
    heads: list[torch.Tensor]  # per kept block: kept query heads [H']
    neurons: list[torch.Tensor]  # per kept block: kept MLP neurons [I']
    channels: torch.Tensor  # kept hidden channels [d']


# --- arguments -----------------------------------------------------------------------------------

def _check_args(cfg: ModelConfig, prune_heads: int, ffn_keep: float, hidden_keep: float, drop_layers: int) -> None:
    """ValueError naming the CLI flag for anything the new shape cannot be."""
    if not isinstance(prune_heads, int) or isinstance(prune_heads, bool) or prune_heads < 0:
        raise ValueError(f"--prune-heads must be an integer >= 0, got {prune_heads!r}")
    if prune_heads >= cfg.num_heads:
        raise ValueError(f"--prune-heads {prune_heads} leaves no query heads (the model has {cfg.num_heads})")
    if (cfg.num_heads - prune_heads) % cfg.num_kv_heads:
        raise ValueError(f"--prune-heads {prune_heads}: {cfg.num_heads - prune_heads} query heads cannot be shared "
                         f"evenly by {cfg.num_kv_heads} KV heads (prune a multiple of {cfg.num_kv_heads})")
    for flag, v in (("--ffn-keep", ffn_keep), ("--hidden-keep", hidden_keep)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1:
            raise ValueError(f"{flag} must be a fraction in (0, 1], got {v!r}")
    if not isinstance(drop_layers, int) or isinstance(drop_layers, bool) or drop_layers < 0:
        raise ValueError(f"--drop-layers must be an integer >= 0, got {drop_layers!r}")
    if drop_layers >= cfg.num_layers:
        raise ValueError(f"--drop-layers {drop_layers} leaves no layers (the model has {cfg.num_layers})")
    if drop_layers and cfg.kv_source is not None:
        raise ValueError("--drop-layers: the model shares K/V across layers (kvserve_kv_source); drop layers "
                         "before `kvserve convert --share-kv-every`")


def kept_width(full: int, keep: float) -> int:
    """Units kept of `full` for fraction `keep`: rounded to a multiple of 64 (16 when full < 1024,
    1 when full < 64), at least one multiple, at most `full`."""
    if keep >= 1:
        return full
    m = 64 if full >= 1024 else 16 if full >= 64 else 1
    n = max(1, round(full * keep / m)) * m
    return min(n, full)


# --- planning ------------------------------------------------------------------------------------

def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, sorted ascending (ties: the lower index wins, stably)."""
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def _check_importance(cfg: ModelConfig, imp: Importance) -> None:
    want = {"heads": (cfg.num_layers, cfg.num_heads), "neurons": (cfg.num_layers, cfg.intermediate_size),
            "channels": (cfg.hidden_size,), "layers": (cfg.num_layers,)}
    for name, shape in want.items():
        got = tuple(getattr(imp, name).shape)
        if got != shape:
            raise ValueError(f"importance.{name} has shape {got}, this model needs {shape} "
                             f"(scores of another model?)")


def plan_pruning(cfg: ModelConfig, imp: Importance | None, *, prune_heads: int = 0, ffn_keep: float = 1.0,
                 hidden_keep: float = 1.0, drop_layers: int = 0) -> PrunePlan:
    """The units to keep. `imp` may be None only when nothing is removed."""
    _check_args(cfg, prune_heads, ffn_keep, hidden_keep, drop_layers)
    n_heads = cfg.num_heads - prune_heads
    n_ffn = kept_width(cfg.intermediate_size, ffn_keep)
    n_hidden = kept_width(cfg.hidden_size, hidden_keep)
    removes = (n_heads, n_ffn, n_hidden, drop_layers) != (cfg.num_heads, cfg.intermediate_size, cfg.hidden_size, 0)
    if imp is None:
        if removes:
            raise ValueError("structured pruning needs calibration windows to score what to remove")
        return PrunePlan(layers=list(range(cfg.num_layers)),
                         heads=[torch.arange(cfg.num_heads)] * cfg.num_layers,
                         neurons=[torch.arange(cfg.intermediate_size)] * cfg.num_layers,
                         channels=torch.arange(cfg.hidden_size))
    _check_importance(cfg, imp)
    layers = sorted(_top(imp.layers, cfg.num_layers - drop_layers).tolist())
    group, kept_per_group = cfg.num_heads // cfg.num_kv_heads, n_heads // cfg.num_kv_heads
    heads, neurons = [], []
    for i in layers:
        # Query head h reads KV head h // group; each group keeps its best kept_per_group heads so
        # that new head j still reads KV head j // kept_per_group.
        per_group = [g * group + _top(imp.heads[i, g * group:(g + 1) * group], kept_per_group)
                     for g in range(cfg.num_kv_heads)]
        heads.append(torch.cat(per_group))
        neurons.append(_top(imp.neurons[i], n_ffn))
    return PrunePlan(layers=layers, heads=heads, neurons=neurons, channels=_top(imp.channels, n_hidden))


# --- building the smaller model ------------------------------------------------------------------

def pruned_config(cfg: ModelConfig, plan: PrunePlan) -> ModelConfig:
    layer_types = [cfg.layer_types[i] for i in plan.layers]
    # A layer type no kept layer has (e.g. no sliding layer left) loses its window and rotary
    # parameters, as the config.json of such a model would say.
    window = cfg.sliding_window if SLIDING in layer_types else None
    rope = {t: r for t, r in cfg.rope.items() if t in layer_types}
    return dataclasses.replace(cfg, hidden_size=int(plan.channels.numel()),
                               intermediate_size=int(plan.neurons[0].numel()),
                               num_heads=int(plan.heads[0].numel()), num_layers=len(plan.layers),
                               layer_types=layer_types, sliding_window=window, rope=rope)


def _head_rows(head_dim: int, heads: torch.Tensor) -> torch.Tensor:
    """Query heads -> the q_proj rows (o_proj columns) they own [H' * head_dim]."""
    return (heads[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


# Per tensor of a decoder block: which index set selects its rows (dim 0) and its columns (dim 1).
# "q": the kept query heads' rows, "ffn": kept neurons, "hidden": kept channels, None: all.
_BLOCK_SLICES: dict[str, tuple[str | None, str | None]] = {
    "self_attn.q_proj.weight": ("q", "hidden"), "self_attn.q_proj.bias": ("q", None),
    "self_attn.k_proj.weight": (None, "hidden"), "self_attn.k_proj.bias": (None, None),
    "self_attn.v_proj.weight": (None, "hidden"), "self_attn.v_proj.bias": (None, None),
    "self_attn.o_proj.weight": ("hidden", "q"), "self_attn.o_proj.bias": ("hidden", None),
    "self_attn.q_norm.weight": (None, None), "self_attn.k_norm.weight": (None, None),  # over head_dim
    "mlp.gate_proj.weight": ("ffn", "hidden"), "mlp.gate_proj.bias": ("ffn", None),
    "mlp.up_proj.weight": ("ffn", "hidden"), "mlp.up_proj.bias": ("ffn", None),
    "mlp.down_proj.weight": ("hidden", "ffn"), "mlp.down_proj.bias": ("hidden", None),
}


def _select(t: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None) -> torch.Tensor:
    t = t if rows is None else t.index_select(0, rows)
    return t if cols is None else t.index_select(1, cols)


def pruned_state_dict(model: CausalLM, plan: PrunePlan) -> dict[str, torch.Tensor]:
    """The kept weights under the new model's names (block j = original block plan.layers[j])."""
    cfg = model.config
    ch = plan.channels
    new_index = {i: j for j, i in enumerate(plan.layers)}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = _select(t, None, ch)
        elif name == "norm.weight":
            out[name] = _select(t, ch, None)
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            j = new_index.get(int(i))
            if j is None:
                continue
            if rest.endswith("layernorm.weight"):
                rows, cols = "hidden", None
            elif rest in _BLOCK_SLICES:
                rows, cols = _BLOCK_SLICES[rest]
            else:
                raise RuntimeError(f"structured pruning does not know how to slice {name!r}")
            sets = {None: None, "hidden": ch, "ffn": plan.neurons[j], "q": _head_rows(cfg.head_dim, plan.heads[j])}
            out[f"layers.{j}.{rest}"] = _select(t, sets[rows], sets[cols])
        else:
            raise RuntimeError(f"structured pruning does not know how to slice {name!r}")
    if model.scale_embedding and ch.numel() != cfg.hidden_size:
        # Keep the original embedding scale sqrt(d): the model now multiplies by sqrt(d'), so the
        # rows carry the ratio. A tied head reads the same matrix; the final norm takes the ratio
        # back out so the logits are unchanged by the fold.
        ratio = math.sqrt(cfg.hidden_size) / math.sqrt(ch.numel())
        emb = out["embed_tokens.weight"]
        out["embed_tokens.weight"] = (emb.double() * ratio).to(emb.dtype)
        if model.lm_head is None:
            w = out["norm.weight"].double()
            w = (1.0 + w) / ratio - 1.0 if model.norm.offset else w / ratio
            out["norm.weight"] = w.to(out["norm.weight"].dtype)
    return out


def build_pruned(model: CausalLM, plan: PrunePlan, source=None) -> CausalLM:
    """A new model of the planned shape holding the kept weights (the original is not modified),
    built by the loader's own `build_model` so it has the layout a loaded model has (fp32 CPU
    weights column-major, fresh rotary tables)."""
    if any(is_quantized_module(m) for m in model.modules()):
        raise ValueError("structured pruning needs a dense model (this one holds quantized modules)")
    weight = model.embed_tokens.weight
    return build_model(pruned_config(model.config, plan), pruned_state_dict(model, plan), weight.dtype,
                       weight.device, source)


# --- entry point ---------------------------------------------------------------------------------

def structured_prune(loaded, *, calibration: torch.Tensor | None, prune_heads: int | None = 0,
                     ffn_keep: float | None = 1.0, hidden_keep: float | None = 1.0, drop_layers: int | None = 0,
                     importance: Importance | None = None, criterion: str = "activation", batch_size: int = 4):
    """A NEW, smaller LoadedModel (same tokenizer and source) pruned from `loaded` (unchanged).

    calibration: token windows [n, L] scored in one pass (`importance` computed earlier may be
    given instead, e.g. to prune one model several ways). prune_heads: query heads removed per
    layer. ffn_keep / hidden_keep: fractions of MLP neurons / embedding channels kept.
    drop_layers: decoder blocks removed (lowest 1 - cos(input, output)). None for any of the four
    (a CLI flag not given) means "remove nothing of this kind". criterion: how heads and neurons
    are ranked, Minitron's "activation" (default) or "contribution" (importance.py).
    """
    cfg = loaded.config
    prune_heads = 0 if prune_heads is None else prune_heads
    ffn_keep = 1.0 if ffn_keep is None else ffn_keep
    hidden_keep = 1.0 if hidden_keep is None else hidden_keep
    drop_layers = 0 if drop_layers is None else drop_layers
    _check_args(cfg, prune_heads, ffn_keep, hidden_keep, drop_layers)
    if criterion not in CRITERIA:
        raise ValueError(f"--importance must be one of {', '.join(CRITERIA)}, got {criterion!r}")
    nothing = (prune_heads, kept_width(cfg.intermediate_size, ffn_keep),
               kept_width(cfg.hidden_size, hidden_keep), drop_layers) == (0, cfg.intermediate_size, cfg.hidden_size, 0)
    if importance is None and not nothing:
        if calibration is None:
            raise ValueError("structured pruning needs calibration windows [n, L] to score what to remove")
        importance = compute_importance(loaded.model, calibration, batch_size=batch_size)
    if importance is not None:
        importance = importance.select(criterion)
    plan = plan_pruning(cfg, importance, prune_heads=prune_heads, ffn_keep=ffn_keep, hidden_keep=hidden_keep,
                        drop_layers=drop_layers)
    new = build_pruned(loaded.model, plan, loaded.source)
    return dataclasses.replace(loaded, model=new, config=new.config)


def count_params(model: nn.Module, embedding: bool = True) -> int:
    """Parameters of a model (a tied head counted once); `embedding=False` leaves out the
    embedding table and an untied LM head (the "non-embedding" count)."""
    total = sum(p.numel() for p in model.parameters())
    if not embedding:
        total -= model.embed_tokens.weight.numel()
        if model.lm_head is not None:
            total -= model.lm_head.weight.numel()
    return total
