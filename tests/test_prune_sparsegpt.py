"""SparseGPT (kvserve/compress/prune/sparsegpt.py): exact masks, OBS error compensation beating magnitude
and Wanda on correlated inputs, dead inputs, clear errors."""
from __future__ import annotations

import pytest
import torch

from kvserve.compress.prune.apply import prune_linear
from kvserve.compress.prune.masks import is_nm, sparsity_of
from kvserve.compress.prune.sparsegpt import sparsegpt_prune


def _correlated(n=4096, k=128, out=64, seed=0):
    """Inputs X [n, k] with strongly correlated channels of uneven scale, a weight W [out, k]."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g)
    mix = 0.1 * torch.eye(k) + torch.randn(k, k, generator=g) / k ** 0.5  # every channel a mixture
    x = (z @ mix) * torch.logspace(-0.5, 0.5, k)[torch.randperm(k, generator=g)]
    w = torch.randn(out, k, generator=g)
    return x, w


def _out_err(w, new, x):
    return float(((w - new) @ x.T).pow(2).sum() / (w @ x.T).pow(2).sum())


@pytest.mark.parametrize("sparsity,pattern", [(0.5, None), (None, "2:4"), (None, "4:8"), (0.7, None)])
def test_sparsegpt_output_error_below_magnitude_and_wanda(sparsity, pattern):
    x, w = _correlated()
    h = 2 * x.T @ x / x.shape[0]
    norms = x.norm(dim=0)
    errs = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        new = prune_linear(w, method, sparsity=sparsity, pattern=pattern, hessian=h, input_norms=norms,
                           blocksize=32)
        errs[method] = _out_err(w, new, x)
    assert errs["sparsegpt"] < 0.85 * errs["wanda"], errs
    assert errs["sparsegpt"] < 0.5 * errs["magnitude"], errs
    assert errs["wanda"] < errs["magnitude"], errs  # the inputs have uneven channel scales


@pytest.mark.parametrize("blocksize", [16, 128, 50])
def test_sparsegpt_masks_are_exact(blocksize):
    x, w = _correlated(n=1024, k=96, out=40)
    h = 2 * x.T @ x / x.shape[0]
    new, keep = sparsegpt_prune(w, h, sparsity=0.5, blocksize=blocksize)
    assert int((~keep).sum()) == round(0.5 * w.numel())
    assert torch.equal(new == 0, ~keep)  # pruned exactly zero; kept weights moved, not zeroed
    assert not torch.equal(new[keep], w[keep])  # the kept weights were updated (error compensation)
    for n, m in [(2, 4), (4, 8)]:
        new, keep = sparsegpt_prune(w, h, pattern=f"{n}:{m}", blocksize=blocksize)
        assert is_nm(new, n, m) and ((~keep).reshape(40, -1, m).sum(2) == m - n).all()


def test_sparsity_zero_changes_nothing():
    x, w = _correlated(n=512, k=64, out=16)
    new, keep = sparsegpt_prune(w, 2 * x.T @ x / 512, sparsity=0.0)
    assert keep.all() and torch.equal(new, w)


def test_dead_inputs_are_zeroed_and_bad_hessians_are_clear_errors():
    x, w = _correlated(n=512, k=64, out=16)
    x[:, 5] = 0
    new, _ = sparsegpt_prune(w, 2 * x.T @ x / 512, pattern="2:4")
    assert (new[:, 5] == 0).all() and is_nm(new, 2, 4)
    with pytest.raises(ValueError, match="positive definite"):
        sparsegpt_prune(w, -torch.eye(64), sparsity=0.5, percdamp=0.0)
    with pytest.raises(ValueError, match="do not match"):
        sparsegpt_prune(w, torch.eye(32), sparsity=0.5)
    with pytest.raises(ValueError, match="sparsity or an N:M"):
        sparsegpt_prune(w, torch.eye(64))
    with pytest.raises(ValueError, match="multiple of 8"):
        sparsegpt_prune(w[:, :60], torch.eye(60), pattern="4:8")
    assert sparsity_of(new) >= 0.5
