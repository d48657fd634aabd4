"""GPTQ (Frantar et al., 2022): quantize a weight column by column, each rounding error pushed
onto the columns not yet quantized through the inverse Hessian of the layer's inputs.

Per layer: H = 2 X^T X / n from the calibration inputs X [n, in] (collected by
kvserve/compress/quant/calibrate.py through the already-quantized earlier blocks). Dead inputs (H_jj = 0)
get H_jj = 1 and W[:, j] = 0. H += percdamp * mean(diag H) * I. U = upper Cholesky factor of H^-1.
For column i: q = Q(w_i), err = (w_i - q) / U_ii, W[:, i:] -= err U[i, i:]. Columns run in lazy
blocks of `blocksize`: updates inside a block are applied immediately, the block's accumulated
errors update the remaining columns with one matmul at the end of the block.

act_order: columns in order of decreasing H_jj (the most-used inputs first, when there is
the most freedom left to compensate). Groups: with a group-wise spec the grid of a group is
chosen when its first column is reached, from the CURRENT (error-updated) weights of that group's
columns; with act_order those are groups of consecutive columns in the permuted order, so the
QuantizedWeight carries g_idx (group of each original column). static_groups: every group's grid
is taken from the original weights up front (no g_idx needed with act_order, so the fast int4
kernel still applies). Per-channel / per-tensor grids are fixed up front from the whole weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.weights.rtn import compute_qparams, grid_qparams, quantize
from kvserve.weights.spec import LayerStats, QuantizedWeight, QuantSpec


def _grid(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max grid of the columns w [out, c] as one group per row -> scale, zero [out]."""
    return grid_qparams(w.amin(1), w.amax(1), spec)


def _inverse_hessian_factor(h: torch.Tensor, percdamp: float, name: str) -> torch.Tensor:
    """Dampened H [k, k] -> U, the upper Cholesky factor of H^-1 (float32)."""
    h = h.double()
    k = h.shape[0]
    damp = percdamp * float(torch.diagonal(h).mean())
    h = h + damp * torch.eye(k, dtype=h.dtype)
    L, info = torch.linalg.cholesky_ex(h)
    if int(info) == 0:
        hinv = torch.cholesky_inverse(L)
        U, info = torch.linalg.cholesky_ex(hinv, upper=True)
    if int(info) != 0 or not torch.isfinite(L).all():
        raise ValueError(f"GPTQ: the Hessian of {name} is not positive definite (dampening {percdamp}); "
                         f"raise --damp (e.g. 0.1) or use more calibration data (--nsamples / --calib-seqlen)")
    return U.float()


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, *, percdamp: float = 0.01,
                  blocksize: int = 128, act_order: bool = False, static_groups: bool = False,
                  name: str = "layer") -> QuantizedWeight:
    """weight [out, in], hessian [in, in] (2 X^T X / n) -> QuantizedWeight (see the module doc)."""
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"GPTQ {name}: weight {tuple(weight.shape)} and Hessian {tuple(hessian.shape)} do not match")
    if percdamp < 0:
        raise ValueError(f"--damp must be >= 0, got {percdamp}")
    if blocksize < 1:
        raise ValueError(f"blocksize must be >= 1, got {blocksize}")
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    out, k = W.shape
    groups = spec.num_groups(k)  # validates group_size | in
    gsize = spec.group_size if spec.granularity == "group" else None

    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    scale = torch.empty(out, groups)
    zero = None if spec.sym else torch.empty(out, groups, dtype=torch.int32)
    static: tuple[torch.Tensor, torch.Tensor | None] | None = None
    if gsize is None:  # one grid for the whole row (or tensor), from the whole weight
        s, z = compute_qparams(W, spec)
        scale[:] = s
        if zero is not None:
            zero[:] = z
    elif static_groups:
        static = compute_qparams(W, spec)  # [out, G] from the original weights
        scale[:] = static[0]
        if zero is not None:
            zero[:] = static[1]

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]

    U = _inverse_hessian_factor(H, percdamp, name)
    codes = torch.zeros(out, k, dtype=torch.int32)
    col_scale = torch.empty(out, 1)
    col_zero = None if spec.sym else torch.empty(out, 1, dtype=torch.int32)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i  # column in the (possibly permuted) order
            if gsize is None:
                g = 0
            elif static is not None:
                g = (int(perm[c]) if perm is not None else c) // gsize
            else:
                g = c // gsize
                if c % gsize == 0:  # a new group: its grid from the current, error-updated weights
                    end = c + gsize
                    cur = W1[:, i:i + gsize] if end <= i2 else torch.cat([W1[:, i:], W[:, i2:end]], dim=1)
                    s, z = _grid(cur, spec)
                    scale[:, g] = s
                    if zero is not None:
                        zero[:, g] = z
            col_scale[:, 0] = scale[:, g]
            if col_zero is not None:
                col_zero[:, 0] = zero[:, g]
            w = W1[:, i:i + 1]
            q = quantize(w, col_scale, col_zero, spec)
            codes[:, c] = q[:, 0]
            deq = (q - col_zero if col_zero is not None else q).float() * col_scale
            err = (w - deq) / U1[i, i]
            W1[:, i:] -= err * U1[i:i + 1, i:]
            E1[:, i:i + 1] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if gsize is not None and static is None:
            g_idx = (torch.arange(k) // gsize)[inv].long()
    return QuantizedWeight(codes.contiguous(), scale, zero, spec, g_idx)


@dataclass
class GPTQQuantizer:
    """`LayerQuantizer` for GPTQ: needs `stats.hessian` (kvserve/compress/quant/calibrate.py)."""

    spec: QuantSpec
    percdamp: float = 0.01
    blocksize: int = 128
    act_order: bool = False
    static_groups: bool = False
    needs_calibration: bool = True

    def quantize_layer(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedWeight:
        name = (stats.extra.get("name") if stats is not None else None) or "layer"
        if stats is None or stats.hessian is None:
            raise ValueError(f"GPTQ needs the input Hessian of {name} (calibration statistics)")
        return gptq_quantize(weight, stats.hessian, self.spec, percdamp=self.percdamp, blocksize=self.blocksize,
                             act_order=self.act_order, static_groups=self.static_groups, name=name)
