"""SparseGPT (Frantar & Alistarh, 2023): prune a weight column block by column block, choosing
the mask with the OBS saliency and compensating each removed weight on the columns not yet
processed through the inverse Hessian of the layer's inputs.

Per layer: H = 2 X^T X / n [in, in] (kvserve/compress/quant/calibrate.py). Dead inputs (H_jj = 0) get
H_jj = 1 and W[:, j] = 0. H += percdamp * mean(diag H) * I. U = upper Cholesky factor of H^-1
(the same factor GPTQ uses: U_ii^2 is the diagonal of the inverse Hessian of the columns still
free when column i is reached).

For each block of `blocksize` columns [i1, i2):

* mask selection (unstructured): saliency w_ij^2 / U_jj^2 over the block's current
  (error-updated) weights; the lowest ones of the block are pruned, as many as keep the running
  total at round(sparsity * out * i2) (exact layer sparsity, spread evenly over the blocks).
* mask selection (N:M): when column i starts a group of m, per row the m - n lowest saliencies
  of columns i..i+m-1 are pruned.
* column i: q = w_i with the pruned entries zeroed; err = (w_i - q) / U_ii;
  W[:, i:i2] -= err U[i, i:i2]; after the block W[:, i2:] -= Err U[i1:i2, i2:] (lazy update).

The returned weight has exact zeros at the pruned positions and updated kept weights.
"""
from __future__ import annotations

import torch

from kvserve.compress.prune.masks import check_sparsity, parse_pattern


def inverse_hessian_factor(h: torch.Tensor, percdamp: float, name: str) -> torch.Tensor:
    """Dampened H [k, k] -> upper Cholesky factor of H^-1 [k, k] (float32)."""
    h = h.double()
    k = h.shape[0]
    h = h + percdamp * float(torch.diagonal(h).mean()) * torch.eye(k, dtype=h.dtype)
    L, info = torch.linalg.cholesky_ex(h)
    if int(info) == 0:
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if int(info) != 0 or not torch.isfinite(L).all():
        raise ValueError(f"SparseGPT: the Hessian of {name} is not positive definite (dampening {percdamp}); "
                         f"raise --damp or use more calibration data (--nsamples / --calib-seqlen)")
    return U.float()


def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, *, sparsity: float | None = None,
                    pattern: tuple[int, int] | str | None = None, percdamp: float = 0.01, blocksize: int = 128,
                    name: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in], hessian [in, in] -> (pruned weight [out, in] float32, keep mask [out, in]).

    Exactly one of sparsity (unstructured fraction) and pattern (N:M, e.g. "2:4") is used; a
    pattern wins when both are given.
    """
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"SparseGPT {name}: weight {tuple(weight.shape)} and Hessian {tuple(hessian.shape)} "
                         f"do not match")
    if percdamp < 0:
        raise ValueError(f"--damp must be >= 0, got {percdamp}")
    if blocksize < 1:
        raise ValueError(f"blocksize must be >= 1, got {blocksize}")
    nm = parse_pattern(pattern) if pattern is not None else None
    if nm is None:
        if sparsity is None:
            raise ValueError("SparseGPT: give a sparsity or an N:M pattern")
        sparsity = check_sparsity(sparsity)
    W = weight.detach().float().clone(memory_format=torch.contiguous_format)
    H = hessian.detach().float().clone()
    out, k = W.shape
    if nm is not None:
        n, m = nm
        if k % m:
            raise ValueError(f"N:M pattern {n}:{m} needs the input size of {name} ({k}) to be a multiple of {m}")
        if blocksize % m:  # a group of m columns must not straddle two blocks
            blocksize = max(m, blocksize - blocksize % m)

    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    U = inverse_hessian_factor(H, percdamp, name)
    diag = torch.diagonal(U)
    keep = torch.ones(out, k, dtype=torch.bool)
    pruned_so_far = 0
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        K1 = torch.ones(W1.shape, dtype=torch.bool)
        if nm is None:
            target = int(round(sparsity * out * i2)) - pruned_so_far
            if target > 0:
                sal = W1.pow(2) / diag[i1:i2].pow(2).unsqueeze(0)
                idx = torch.topk(sal.reshape(-1), target, largest=False).indices
                K1.view(-1)[idx] = False
            pruned_so_far += max(target, 0)
        for i in range(i2 - i1):
            if nm is not None and i % m == 0:
                sal = W1[:, i:i + m].pow(2) / diag[i1 + i:i1 + i + m].pow(2).unsqueeze(0)
                idx = torch.topk(sal, m - n, dim=1, largest=False).indices
                K1[:, i:i + m].scatter_(1, idx, False)
            w = W1[:, i]
            q = torch.where(K1[:, i], w, torch.zeros_like(w))
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i:i + 1, i:]
            W1[:, i] = q
            E1[:, i] = err
        W[:, i1:i2] = W1
        keep[:, i1:i2] = K1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return W, keep
