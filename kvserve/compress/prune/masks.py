"""Pruning scores and mask selection (unstructured and N:M).

Scores (higher = more important, kept first), for a weight W [out, in]:

* magnitude: |W_ij|.
* Wanda (Sun et al., 2023): |W_ij| * ||X_j||_2, with X [n, in] the calibration inputs of the
  layer. ||X_j||_2 is taken from the Hessian diagonal the calibration collects (H = 2 X^T X / n,
  so ||X_j||_2 = sqrt(n H_jj / 2); the constant factor does not change any comparison).

Masks are boolean `keep` tensors [out, in] (True = weight kept):

* `unstructured_mask(scores, sparsity, per="row"|"layer")`: exactly floor(sparsity * in)
  smallest scores of every output row pruned (Wanda's comparison group), or exactly
  round(sparsity * out * in) smallest of the whole layer (magnitude pruning as in the papers).
* `nm_mask(scores, n, m)`: in every group of m consecutive inputs of a row, the n highest
  scores kept ("2:4" = 2 non-zeros per 4, i.e. 50% sparsity; "4:8" likewise).

Ties are broken by position (torch.topk / sort order), so the counts are exact whatever the
scores.
"""
from __future__ import annotations

import math

import torch

from kvserve.weights.sparse_nm import is_nm, parse_pattern  # noqa: F401  (the prune API names)


def check_sparsity(sparsity: float) -> float:
    if not (0.0 <= float(sparsity) < 1.0) or math.isnan(float(sparsity)):
        raise ValueError(f"--sparsity must be in [0, 1), got {sparsity}")
    return float(sparsity)


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> |W| [out, in] (float32)."""
    return weight.detach().float().abs()


def input_norms_from_hessian(hessian: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """H = 2 X^T X / n [in, in] -> ||X_j||_2 [in] (the column norms of the inputs X [n, in])."""
    d = torch.diagonal(hessian).float().clamp_min(0.0)
    return (d * (num_tokens / 2.0)).sqrt()


def wanda_scores(weight: torch.Tensor, input_norms: torch.Tensor) -> torch.Tensor:
    """weight [out, in], input_norms ||X_j||_2 [in] -> |W_ij| * ||X_j||_2 [out, in]."""
    if input_norms.shape != (weight.shape[1],):
        raise ValueError(f"Wanda: input norms {tuple(input_norms.shape)} do not match the {weight.shape[1]} "
                         f"inputs of the weight")
    return weight.detach().float().abs() * input_norms.float().unsqueeze(0)


def unstructured_mask(scores: torch.Tensor, sparsity: float, per: str = "row") -> torch.Tensor:
    """scores [out, in] -> keep mask [out, in] with the lowest `sparsity` fraction pruned,
    per output row (floor(sparsity * in) each) or per layer (round(sparsity * numel))."""
    sparsity = check_sparsity(sparsity)
    out, k = scores.shape
    keep = torch.ones(out, k, dtype=torch.bool, device=scores.device)
    if per == "row":
        count = int(math.floor(sparsity * k))
        if count:
            idx = torch.topk(scores, count, dim=1, largest=False).indices
            keep.scatter_(1, idx, False)
    elif per == "layer":
        count = int(round(sparsity * out * k))
        if count:
            idx = torch.topk(scores.reshape(-1), count, largest=False).indices
            keep.view(-1)[idx] = False
    else:
        raise ValueError(f"per must be 'row' or 'layer', got {per!r}")
    return keep


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """scores [out, in] -> keep mask [out, in]: n of every m consecutive inputs kept per row."""
    n, m = parse_pattern((n, m))
    out, k = scores.shape
    if k % m:
        raise ValueError(f"N:M pattern {n}:{m} needs the input size ({k}) to be a multiple of {m}")
    groups = scores.reshape(out, k // m, m)
    idx = torch.topk(groups, n, dim=2, largest=True).indices
    keep = torch.zeros(out, k // m, m, dtype=torch.bool, device=scores.device)
    keep.scatter_(2, idx, True)
    return keep.reshape(out, k)


def select_mask(scores: torch.Tensor, sparsity: float | None = None, pattern: tuple[int, int] | None = None,
                per: str = "row") -> torch.Tensor:
    """Dispatch: N:M when `pattern` is given, else unstructured at `sparsity` (per row / layer)."""
    if pattern is not None:
        return nm_mask(scores, *parse_pattern(pattern))
    if sparsity is None:
        raise ValueError("give a sparsity (e.g. 0.5) or an N:M pattern (e.g. 2:4)")
    return unstructured_mask(scores, sparsity, per)


def sparsity_of(weight: torch.Tensor) -> float:
    """Fraction of exact zeros."""
    return float((weight == 0).sum()) / max(weight.numel(), 1)
