"""Pruning masks and scores (kvserve/compress/prune/masks.py) and the sequential pipeline
(kvserve/compress/prune/apply.py): exact sparsity / N:M counts, Wanda's per-row comparison, iterative steps."""
from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import make_model

from kvserve.compress.prune import prune_model
from kvserve.compress.prune.apply import prune_linear
from kvserve.compress.prune.masks import (
    input_norms_from_hessian,
    is_nm,
    nm_mask,
    parse_pattern,
    sparsity_of,
    unstructured_mask,
    wanda_scores,
)
from kvserve.compress.quant.apply import linear_layers
from kvserve.compress.quant.calibrate import calibration_windows
from kvserve.loading import load_model
from kvserve.tools.eval.ppl import window_hidden


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.77])
@pytest.mark.parametrize("ties", [False, True])
def test_unstructured_masks_have_exact_counts(sparsity, ties):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(24, 40, generator=g)
    if ties:  # many equal scores must not change the counts
        scores = (scores * 3).floor()
    row = unstructured_mask(scores, sparsity, "row")
    assert ((~row).sum(1) == int(sparsity * 40)).all()
    layer = unstructured_mask(scores, sparsity, "layer")
    assert int((~layer).sum()) == round(sparsity * 24 * 40)
    if not ties and sparsity:
        # Oracle: the pruned entries are exactly the smallest scores.
        assert scores[~layer].max() < scores[layer].min()
        for r in range(24):
            assert scores[r][~row[r]].max() < scores[r][row[r]].min()


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_keeps_the_n_largest_of_every_group(n, m):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(16, 64, generator=g)
    keep = nm_mask(scores, n, m)
    groups = keep.reshape(16, 64 // m, m)
    assert (groups.sum(2) == n).all()
    sg = scores.reshape(16, 64 // m, m)
    oracle = torch.zeros_like(groups)
    oracle.scatter_(2, sg.argsort(2, descending=True)[..., :n], True)
    assert torch.equal(groups, oracle)
    assert is_nm(scores * keep, n, m)


def test_bad_patterns_and_sparsities_are_value_errors():
    assert parse_pattern("2:4") == (2, 4)
    for bad in ["2-4", "4:2", "0:4", "a:b", "4:4"]:
        with pytest.raises(ValueError, match="pattern"):
            parse_pattern(bad)
    with pytest.raises(ValueError, match="sparsity"):
        unstructured_mask(torch.rand(4, 4), 1.0)
    with pytest.raises(ValueError, match="multiple of 4"):
        nm_mask(torch.rand(4, 6), 2, 4)


def test_input_norms_from_hessian_are_column_norms():
    x = torch.randn(300, 12, dtype=torch.float64)
    h = 2 * x.T @ x / 300
    assert torch.allclose(input_norms_from_hessian(h, 300).double(), x.norm(dim=0), rtol=1e-5)


def test_wanda_compares_within_each_output_row():
    """Rows of very different scales: a per-layer ranking would prune the small rows entirely,
    Wanda prunes exactly half of every row, the lowest |W| * ||X_j|| of that row."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 32, generator=g) * torch.logspace(-3, 0, 8).unsqueeze(1)
    norms = torch.rand(32, generator=g) * 10 + 0.1
    new = prune_linear(w, "wanda", sparsity=0.5, input_norms=norms)
    assert ((new == 0).sum(1) == 16).all()
    score = w.abs() * norms
    for r in range(8):
        assert score[r][new[r] == 0].max() < score[r][new[r] != 0].min()
    # The activation norms matter: Wanda's mask differs from a per-row magnitude mask.
    mag_row = prune_linear(w, "magnitude", sparsity=0.5, per="row")
    assert not torch.equal(new != 0, mag_row != 0)
    # Magnitude ranks the whole layer by default: the small rows are pruned entirely.
    mag = prune_linear(w, "magnitude", sparsity=0.5)
    assert (mag[0] == 0).all() and sparsity_of(mag) == 0.5
    assert torch.equal(wanda_scores(w, norms), score)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gemma_prune")
    make_model("gemma3", folder)
    return folder


def _windows(n=8, length=24, seed=0):
    ids = torch.randint(3, 320, (2000,), generator=torch.Generator().manual_seed(seed))
    return calibration_windows(ids, n, length, seed=seed, bos_token_id=2)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("sparsity,pattern", [(0.5, None), (None, "2:4"), (None, "4:8")])
def test_prune_model_hits_the_requested_sparsity(tiny, method, sparsity, pattern):
    lm = load_model(tiny)
    emb = lm.model.embed_tokens.weight.clone()
    rep = prune_model(lm.model, method, sparsity=sparsity, pattern=pattern, calibration=_windows(), progress=False)
    assert len(rep.layers) == 6 * 7
    for i, block in enumerate(lm.model.layers):
        for name, lin in linear_layers(block):
            if pattern is None:
                if method == "wanda":
                    assert ((lin.weight == 0).sum(1) == lin.in_features // 2).all(), name
                else:
                    assert sparsity_of(lin.weight) == 0.5, name
            else:
                n, m = parse_pattern(pattern)
                assert is_nm(lin.weight, n, m) and sparsity_of(lin.weight) == 0.5, name
    assert rep.achieved_sparsity == 0.5
    assert torch.equal(lm.model.embed_tokens.weight, emb)  # embedding / tied head untouched


def test_wanda_is_sequential_through_pruned_blocks(tiny):
    """Block 1's Wanda mask comes from the inputs the PRUNED block 0 feeds it (oracle: a forward
    through the model with block 0 pruned, input norms taken by hooks)."""
    windows = _windows()
    lm = load_model(tiny)
    ref = copy.deepcopy(lm.model)
    prune_model(lm.model, "wanda", sparsity=0.5, calibration=windows, progress=False)
    with torch.no_grad():
        for name, lin in linear_layers(ref.layers[0]):  # block 0 as prune_model left it
            lin.weight.copy_(lm.model.layers[0].get_submodule(name).weight)
        norms, hooks = {}, []
        for name, lin in linear_layers(ref.layers[1]):
            hooks.append(lin.register_forward_pre_hook(
                lambda m, a, name=name: norms.__setitem__(name, a[0].reshape(-1, a[0].shape[-1]).norm(dim=0))))
        window_hidden(ref, windows)
        for h in hooks:
            h.remove()
    for name, lin in linear_layers(ref.layers[1]):
        oracle = prune_linear(lin.weight, "wanda", sparsity=0.5, input_norms=norms[name]) != 0
        got = lm.model.layers[1].get_submodule(name).weight != 0
        assert (oracle == got).float().mean() > 0.99, name


def test_iterative_steps_call_the_heal_hook(tiny):
    lm = load_model(tiny)
    seen = []

    def heal(model, step):
        seen.append((step, sparsity_of(model.layers[0].mlp.down_proj.weight)))

    rep = prune_model(lm.model, "magnitude", sparsity=0.6, steps=3, heal_fn=heal, progress=False)
    assert [s for s, _ in seen] == [1, 2]
    assert seen[0][1] == pytest.approx(0.2, abs=1e-3) and seen[1][1] == pytest.approx(0.4, abs=1e-3)
    assert rep.achieved_sparsity == pytest.approx(0.6, abs=1e-3) and rep.steps == 3


def test_prune_model_bad_arguments_are_value_errors(tiny):
    lm = load_model(tiny)
    with pytest.raises(ValueError, match="calibration"):
        prune_model(lm.model, "wanda", sparsity=0.5, progress=False)
    with pytest.raises(ValueError, match="method"):
        prune_model(lm.model, "random", sparsity=0.5)
    with pytest.raises(ValueError, match="sparsity"):
        prune_model(lm.model, "magnitude")
    with pytest.raises(ValueError, match="not both"):
        prune_model(lm.model, "magnitude", sparsity=0.5, pattern="2:4")
    with pytest.raises(ValueError, match="steps"):
        prune_model(lm.model, "magnitude", pattern="2:4", steps=2)
    with pytest.raises(ValueError, match="steps"):
        prune_model(lm.model, "magnitude", sparsity=0.5, steps=0)
