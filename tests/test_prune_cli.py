"""`kvserve prune` (kvserve/compress/prune/cli.py): saved folders load back pruned; bad flags are clear errors."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from tiny_models import make_model

from kvserve.cli import main
from kvserve.compress.prune.masks import is_nm, sparsity_of
from kvserve.compress.quant.apply import linear_layers
from kvserve.loading import load_model
from kvserve.weights.sparse_nm import SparseNMLinear


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gemma_prune_cli")
    make_model("gemma3", folder)
    text = folder / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys in blocks. " * 40)
    return folder, text


def test_cli_magnitude_unstructured_saves_a_dense_pruned_folder(tiny, tmp_path):
    folder, _ = tiny
    out, rep = tmp_path / "m50", tmp_path / "rep.json"
    assert main(["prune", str(folder), "--method", "magnitude", "--sparsity", "0.5", "--out", str(out),
                 "--json", str(rep)]) == 0
    lm = load_model(out)
    for block in lm.model.layers:
        for name, lin in linear_layers(block):
            assert sparsity_of(lin.weight) == 0.5, name
    info = json.loads(rep.read_text())
    assert info["achieved_sparsity"] == 0.5 and info["method"] == "magnitude" and not info["compressed"]


def test_cli_sparsegpt_two_four_compressed(tiny, tmp_path):
    folder, text = tiny
    out = tmp_path / "s24"
    assert main(["prune", str(folder), "--method", "sparsegpt", "--pattern", "2:4", "--compress", "--nsamples", "4",
                 "--calib-seqlen", "16", "--calib-file", str(text), "--skip", "layers.0.", "--out", str(out)]) == 0
    lm = load_model(out)
    mods = [m for _, m in lm.model.named_modules() if isinstance(m, SparseNMLinear)]
    assert len(mods) == 5 * 7  # block 0 skipped: stored dense
    assert all(is_nm(m.dense_weight(), 2, 4) for m in mods)
    assert sparsity_of(lm.model.layers[0].mlp.down_proj.weight) < 0.1


@pytest.mark.parametrize("flags,message", [
    ([], "--method is required"),
    (["--method", "magnitude"], "exactly one of --sparsity"),
    (["--method", "magnitude", "--sparsity", "0.5", "--pattern", "2:4"], "exactly one of --sparsity"),
    (["--method", "magnitude", "--sparsity", "0.5", "--compress"], "--compress needs"),
    (["--method", "magnitude", "--pattern", "4:2"], "pattern"),
    (["--method", "magnitude", "--sparsity", "1.5"], "sparsity"),
    (["--method", "magnitude", "--pattern", "2:4", "--steps", "2"], "steps"),
])
def test_cli_bad_flags_are_clear_errors(tiny, tmp_path, capsys, flags, message):
    folder, _ = tiny
    assert main(["prune", str(folder), *flags, "--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err


def test_cli_structured_flags_without_the_module_are_a_clear_error(tiny, tmp_path, capsys, monkeypatch):
    folder, text = tiny
    monkeypatch.setitem(sys.modules, "kvserve.compress.prune.structured", None)  # import fails as if absent
    assert main(["prune", str(folder), "--ffn-keep", "0.5", "--nsamples", "2", "--calib-seqlen", "16",
                 "--calib-file", str(text), "--out", str(tmp_path / "s")]) == 2
    assert "kvserve.compress.prune.structured" in capsys.readouterr().err


def test_iterative_pruning_with_healing_keeps_zeros_and_heals(tiny, tmp_path):
    """--steps 2 --heal-steps N: distillation after each step keeps every pruned weight at zero
    (so the final sparsity is exact), changes the surviving weights, and leaves the student closer
    to the unpruned model than the same iterative pruning without healing."""
    from kvserve.tools.eval.ppl import evaluate

    folder, text = tiny
    common = ["prune", str(folder), "--method", "wanda", "--sparsity", "0.5", "--steps", "2", "--nsamples", "4",
              "--calib-seqlen", "16", "--calib-file", str(text)]
    plain, healed, rep = tmp_path / "plain", tmp_path / "healed", tmp_path / "rep.json"
    assert main([*common, "--out", str(plain)]) == 0
    assert main([*common, "--heal-steps", "6", "--heal-lr", "1e-3", "--heal-alpha", "1", "--heal-seqlen", "16", "--heal-batch-size", "2",
                 "--heal-text-file", str(text), "--out", str(healed), "--json", str(rep)]) == 0
    info = json.loads(rep.read_text())
    assert [h["after_step"] for h in info["healing"]] == [1, 2] and info["healing"][0]["steps"] == 6
    a, b = load_model(plain), load_model(healed)
    for (name, la), (_, lb) in zip(linear_layers(a.model.layers[0]), linear_layers(b.model.layers[0])):
        assert sparsity_of(lb.weight) == 0.5, name
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)
    teacher = load_model(folder)
    ids = a.tokenizer.encode(text.read_text())
    kl = {n: evaluate(m.model, torch.tensor(ids), 32, reference=teacher.model, max_windows=4, progress=False).kl_mean
          for n, m in (("plain", a), ("healed", b))}
    assert kl["healed"] < 0.9 * kl["plain"], kl
