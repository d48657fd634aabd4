"""`kvserve distill` (kvserve/compress/train/distill.py, cli.py) on tiny models: a teacher and the same
model with its last layer dropped as the student."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvserve.cli import main
from kvserve.compress.train.distill import CHECKPOINT, DistillOptions
from kvserve.compress.train.losses import DistillLoss
from kvserve.loading import load_model
from kvserve.loading.save import save_model

TEXT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks. " * 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("distill")
    make_model("gemma3", root / "teacher", final_logit_softcapping=30.0)
    loaded = load_model(root / "teacher")
    model = loaded.model
    del model.layers[-1]
    cfg = dataclasses.replace(loaded.config, num_layers=loaded.config.num_layers - 1,
                              layer_types=loaded.config.layer_types[:-1])
    model.config = cfg
    save_model(dataclasses.replace(loaded, model=model, config=cfg), root / "student")
    (root / "text.txt").write_text(TEXT)
    return root


def _argv(root, out, *extra):
    return ["distill", "--teacher", str(root / "teacher"), "--student", str(root / "student"), "--out", str(out),
            "--text-file", str(root / "text.txt"), "--seqlen", "16", "--batch-size", "2", "--lr", "3e-4",
            "--eval-seqlen", "32", "--eval-file", str(root / "text.txt"), "--no-progress", "--log-every", "0",
            *extra]


def _weights(folder):
    return {k: v.clone() for k, v in load_model(folder).model.state_dict().items()}


def test_distill_cli_heals_the_student_and_saves_it(models, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(_argv(models, out, "--steps", "16", "--warmup-steps", "4", "--alpha", "1", "--eval-windows", "3",
                    "--json", str(tmp_path / "r.json")))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed
    info = json.loads((tmp_path / "r.json").read_text())
    b, a = info["before"], info["after"]
    assert a["kl_to_teacher"] < 0.85 * b["kl_to_teacher"], (b, a)
    assert a["teacher_ppl"] == pytest.approx(b["teacher_ppl"])
    assert info["train"]["steps"] == 16 and info["train"]["tokens"] == 16 * 2 * 16
    assert info["train"]["warmup_steps"] == 4
    saved = load_model(out)
    assert saved.config.num_layers == load_model(models / "teacher").config.num_layers - 1
    before, after = _weights(models / "student"), _weights(out)
    assert torch.equal(before["embed_tokens.weight"], after["embed_tokens.weight"])  # frozen by default
    assert not torch.equal(before["layers.0.mlp.up_proj.weight"], after["layers.0.mlp.up_proj.weight"])
    assert not (out / CHECKPOINT).exists()
    assert (out / "tokenizer.json").is_file()


def test_train_embeddings_flag(models, tmp_path):
    out = tmp_path / "out"
    assert main(_argv(models, out, "--steps", "2", "--eval-windows", "0", "--train-embeddings")) == 0
    before, after = _weights(models / "student"), _weights(out)
    assert not torch.equal(before["embed_tokens.weight"], after["embed_tokens.weight"])


def test_interrupted_run_resumes_to_the_same_student(models, tmp_path, monkeypatch, capsys):
    steps = ["--steps", "6", "--checkpoint-every", "2", "--eval-windows", "0"]
    assert main(_argv(models, tmp_path / "one", *steps)) == 0

    original = DistillLoss.forward_backward
    calls = {"n": 0}

    def interrupt_at_step_4(self, model, windows):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return original(self, model, windows)

    out = tmp_path / "two"
    monkeypatch.setattr(DistillLoss, "forward_backward", interrupt_at_step_4)
    assert main(_argv(models, out, *steps)) == 130
    monkeypatch.setattr(DistillLoss, "forward_backward", original)
    assert torch.load(out / CHECKPOINT, weights_only=False)["step"] == 3  # saved on the interrupt
    capsys.readouterr()
    assert main(_argv(models, out, *steps)) == 2  # a checkpoint is there: --resume is required
    assert "--resume" in capsys.readouterr().err
    assert main(_argv(models, out, *steps[:2], "--alpha", "0.9", "--eval-windows", "0", "--resume")) == 2
    assert "alpha" in capsys.readouterr().err
    assert main(_argv(models, out, *steps, "--lr", "1e-3", "--resume")) == 2
    assert "'lr'" in capsys.readouterr().err
    assert main(_argv(models, out, *steps, "--resume", "--json", str(tmp_path / "r.json"))) == 0
    assert json.loads((tmp_path / "r.json").read_text())["train"]["resumed_from"] == 3
    one, two = _weights(tmp_path / "one"), _weights(out)
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("extra, message", [
    (["--steps", "0"], "--steps"),
    (["--tokens", "0"], "--tokens"),
    (["--alpha", "1.5"], "--alpha"),
    (["--temperature", "0"], "--temperature"),
    (["--seqlen", "1"], "--seqlen"),
    (["--eval-windows", "-1"], "--eval-windows"),
    (["--batch-size", "0"], "--batch-size"),
    (["--text-file", "/nonexistent/text.txt"], "--text-file"),
])
def test_bad_flags_fail_before_loading(models, tmp_path, capsys, monkeypatch, extra, message):
    import kvserve.loading

    monkeypatch.setattr(kvserve.loading, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(_argv(models, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_steps_and_tokens_are_exclusive(models, tmp_path):
    with pytest.raises(SystemExit):
        main(_argv(models, tmp_path / "out", "--steps", "2", "--tokens", "100"))


def test_steps_from_tokens():
    assert DistillOptions(tokens=1000, batch_size=2, seqlen=16).num_steps == 32
    assert DistillOptions().num_steps == 100 and DistillOptions(steps=7).train_config().steps == 7


def test_a_frozen_embedding_equal_to_the_teachers_is_shared(models):
    from kvserve.compress.train.distill import share_frozen_embedding

    teacher, student = load_model(models / "teacher"), load_model(models / "student")
    other = load_model(models / "student")
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    assert not share_frozen_embedding(teacher.model, other.model)
    assert other.model.embed_tokens.weight is not teacher.model.embed_tokens.weight
    assert share_frozen_embedding(teacher.model, student.model)
    assert student.model.embed_tokens.weight is teacher.model.embed_tokens.weight
