"""AWQ (Lin et al., 2023): activation-aware per-input-channel scales, searched on calibration data,
folded into the op before the linears, then a clipping search, then the plain RTN grid.

Why it works: Q(W diag(s)) diag(s)^-1 x keeps the input channels with large mean |x| (the
salient ones) on a relatively finer grid. The scale is free in floating point because diag(s)^-1
is folded into whatever produced x.

Scale groups of a decoder block (linears that share one input; the AWQ reference's rules):
  * input norm        -> q, k, v      (block output inspected: the attention module)
  * v_proj            -> o_proj       only when v's outputs are o's inputs one to one (MHA, no
                                      GQA/MQA sharing), inspected: o_proj
  * MLP input norm    -> gate, up     (post_attention_layernorm for Llama, pre_feedforward for
                                      Gemma 3), inspected: the MLP
  * up_proj           -> down_proj    inspected: down_proj
Where nothing foldable precedes a linear (o_proj under GQA/MQA) it gets only the clipping.
Folding: a Llama RMSNorm weight w becomes w / s; a Gemma RMSNorm stored as a delta (applied as
1 + w) becomes (1 + w) / s - 1; a preceding linear's output rows (and bias) are divided by s.
The consuming linears' input columns are multiplied by s.

Search per group: s_x = mean |x| per input channel; for alpha = 0, 1/20, ..., 19/20:
s = s_x^alpha (clamped at 1e-4), normalized by sqrt(max(s) min(s)); candidate weights
Q(W s) / s for every linear of the group; loss = MSE of the inspected module's output vs the
float one on the calibration windows; keep the best alpha. Clipping (all linears but q and k):
per output row and group, the symmetric range [-m, m] with m = shrink * max|w|,
shrink in 1, 0.95, ..., 0.55, minimizing the output error on up to 512 sampled input rows.

Sequential: block i is searched on the inputs produced by the already-quantized blocks before it
(kvserve/compress/quant/calibrate.py), transformed in place, then its linears get RTN (AWQQuantizer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.compress.quant.calibrate import Calibrator, run_block, run_windows
from kvserve.model.layers import RMSNorm
from kvserve.weights.rtn import fake_quantize, quantize_rtn
from kvserve.weights.spec import LayerStats, QuantizedWeight, QuantSpec


@dataclass(frozen=True)
class ScaleGroup:
    prev: str  # module the inverse scales fold into (an RMSNorm or a Linear), name in the block
    linears: tuple[str, ...]  # linears sharing the input; their input columns get * s
    inspect: str  # module whose output the search compares ("self_attn", "mlp" or a linear)


def scale_groups(block: nn.Module) -> list[ScaleGroup]:
    """The foldable groups of a Llama-family or Gemma 3 decoder layer (see the module doc)."""
    attn = block.self_attn
    groups = [ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                         "self_attn")]
    if attn.num_heads == attn.num_kv_heads and attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:
        groups.append(ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"))
    norm = "pre_feedforward_layernorm" if hasattr(block, "pre_feedforward_layernorm") else "post_attention_layernorm"
    groups.append(ScaleGroup(norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp"))
    groups.append(ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"))
    return groups


@torch.no_grad()
def fold_scales(block: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """Divide the output of `group.prev` by s [in] and multiply the group's input columns by s:
    the block computes the same function in exact arithmetic."""
    prev = block.get_submodule(group.prev)
    s = s.float()
    if isinstance(prev, RMSNorm):
        w = prev.weight
        if prev.offset:  # applied as (1 + w)
            w.copy_(((1.0 + w.float()) / s - 1.0).to(w.dtype))
        else:
            w.copy_((w.float() / s).to(w.dtype))
    elif isinstance(prev, nn.Linear):
        prev.weight.copy_((prev.weight.float() / s[:, None]).to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.copy_((prev.bias.float() / s).to(prev.bias.dtype))
    else:
        raise ValueError(f"AWQ: cannot fold scales into {group.prev} ({type(prev).__name__})")
    for name in group.linears:
        lin = block.get_submodule(name)
        lin.weight.copy_((lin.weight.float() * s[None, :]).to(lin.weight.dtype))


def _inspect_fn(block: nn.Module, name: str):
    mod = block.get_submodule(name)
    if name == "self_attn":
        return lambda x, meta: mod(x, None, None, meta)
    return lambda x, meta: mod(x)


@torch.no_grad()
def search_scale(model: nn.Module, block: nn.Module, group: ScaleGroup, x: torch.Tensor, seqlen: int,
                 spec: QuantSpec, n_grid: int = 20, batch_size: int = 8) -> tuple[torch.Tensor, float]:
    """x [n * seqlen, in]: the group's input on n calibration windows -> (best s [in], its alpha)."""
    lins = [block.get_submodule(n) for n in group.linears]
    orig = [lin.weight.detach().clone() for lin in lins]
    fn = _inspect_fn(block, group.inspect)
    ref = run_windows(fn, model, x, seqlen, batch_size)
    x_mean = x.abs().float().reshape(-1, x.shape[-1]).mean(0)
    best = (float("inf"), None, 0.0)
    try:
        for r in range(n_grid):
            alpha = r / n_grid
            s = x_mean.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for lin, w in zip(lins, orig):
                lin.weight.copy_((fake_quantize(w.float() * s[None, :], spec) / s[None, :]).to(w.dtype))
            loss = float((run_windows(fn, model, x, seqlen, batch_size) - ref).float().pow(2).mean())
            if loss < best[0]:
                best = (loss, s.clone(), alpha)
    finally:
        for lin, w in zip(lins, orig):
            lin.weight.copy_(w)
    return best[1], best[2]


@torch.no_grad()
def search_clip(weight: torch.Tensor, x: torch.Tensor, spec: QuantSpec, n_grid: int = 20,
                max_shrink: float = 0.5) -> torch.Tensor:
    """weight [out, in], x [n, in] sample inputs -> the best clipping max [out, G] per row and group
    (G = spec.num_groups(in); the whole row for per-channel / per-tensor grids)."""
    w = weight.detach().float()
    out, k = w.shape
    G = spec.num_groups(k)
    wg = w.reshape(out, G, k // G)
    xg = x.float().reshape(-1, G, k // G).transpose(0, 1)  # [G, n, g]
    org_max = wg.abs().amax(-1)  # [out, G]
    best_err = torch.full((out, G), float("inf"))
    best_max = org_max.clone()
    for i in range(int(max_shrink * n_grid)):
        m = org_max * (1 - i / n_grid)
        cur = torch.maximum(torch.minimum(wg, m[..., None]), -m[..., None]).reshape(out, k)
        dq = fake_quantize(cur, spec).reshape(out, G, k // G) - wg  # [out, G, g]
        err = torch.bmm(xg, dq.permute(1, 2, 0)).pow(2).mean(1).T  # [out, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, m, best_max)
    return best_max


@torch.no_grad()
def _capture_inputs(model: nn.Module, block: nn.Module, h: torch.Tensor, seqlen: int, names: set[str],
                    batch_size: int) -> dict[str, torch.Tensor]:
    """Run the block on h and keep the full inputs of the named linears."""
    got: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [block.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: got[n].append(a[0].detach()))
             for n in names]
    try:
        run_block(model, block, h, seqlen, batch_size)
    finally:
        for hk in hooks:
            hk.remove()
    return {n: torch.cat(v) for n, v in got.items()}


@dataclass
class AWQQuantizer:
    """`LayerQuantizer` whose real work is `prepare_block` (scale search, folding, clipping on the
    float block, in place); `quantize_layer` is then RTN on the transformed weights.

    search_windows: calibration windows used by the scale search (each candidate re-runs the
    inspected module on them; CPU time is linear in this). clip_rows: input rows sampled for
    the clipping search. clip: run the clipping search.
    """

    spec: QuantSpec
    n_grid: int = 20
    search_windows: int = 8
    clip_rows: int = 512
    clip: bool = True
    batch_size: int = 8
    needs_calibration: bool = False  # no per-layer stats: prepare_block reads the calibrator

    def __post_init__(self) -> None:
        self.alphas: dict[str, float] = {}

    @property
    def calibration_windows(self) -> int:
        """Only this many calibration windows are read (quantize_model runs no more through the blocks)."""
        return self.search_windows

    @torch.no_grad()
    def prepare_block(self, model: nn.Module, i: int, calib: Calibrator) -> None:
        block = model.layers[i]
        seqlen = calib.seqlen
        h = calib.inputs(i)
        nwin = min(self.search_windows, h.shape[0] // seqlen)
        h = h[:nwin * seqlen]
        groups = scale_groups(block)
        names = {g.linears[0] for g in groups} | {"self_attn.o_proj"}
        feats = _capture_inputs(model, block, h, seqlen, names, self.batch_size)
        scaled = {}
        for g in groups:
            s, alpha = search_scale(model, block, g, feats[g.linears[0]], seqlen, self.spec, self.n_grid,
                                    self.batch_size)
            self.alphas[f"layers.{i}.{g.inspect}"] = alpha
            fold_scales(block, g, s)
            for name in g.linears:
                scaled[name] = s
        if not self.clip:
            return
        shared = {n: g.linears[0] for g in groups for n in g.linears}  # linear -> whose input it reads
        for name, lin in block.named_modules():
            if not isinstance(lin, nn.Linear) or name.endswith(("q_proj", "k_proj")):
                continue
            x = feats.get(shared.get(name, name))
            if x is None:
                continue
            if name in scaled:
                x = x / scaled[name]
            stride = max(1, x.shape[0] // self.clip_rows)
            m = search_clip(lin.weight, x[::stride], self.spec, self.n_grid)
            out, k = lin.weight.shape
            G = m.shape[1]
            w = lin.weight.float().reshape(out, G, k // G)
            lin.weight.copy_(torch.maximum(torch.minimum(w, m[..., None]), -m[..., None]).reshape(out, k))

    def quantize_layer(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedWeight:
        return quantize_rtn(weight, self.spec)


@torch.no_grad()
def awq_layer(weight: torch.Tensor, x: torch.Tensor, spec: QuantSpec, n_grid: int = 20, clip: bool = True,
              clip_rows: int = 512) -> tuple[QuantizedWeight, torch.Tensor]:
    """AWQ on one linear alone: weight [out, in], inputs x [n, in] -> (RTN of the scaled, clipped
    W diag(s), s [in]); the layer it stands for is dequantize() / s (s folded into the producer of x)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.requires_grad_(False).copy_(weight.float())
    holder = nn.Module()
    holder.lin = lin
    group = ScaleGroup("", ("lin",), "lin")
    s, _ = search_scale(None, holder, group, x.float(), x.shape[0], spec, n_grid, batch_size=1)
    w = lin.weight * s[None, :]
    if clip:
        xs = x.float() / s
        m = search_clip(w, xs[::max(1, xs.shape[0] // clip_rows)], spec, n_grid)
        out, k = w.shape
        wg = w.reshape(out, m.shape[1], -1)
        w = torch.maximum(torch.minimum(wg, m[..., None]), -m[..., None]).reshape(out, k)
    return quantize_rtn(w, spec), s
