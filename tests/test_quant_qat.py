"""QAT (kvserve/compress/quant/qat.py): the fake-quantized forward is the RTN model, the straight-through
gradient is the gradient at the rounded weight, conversion packs exactly the trained grid, and a
short fine-tune beats RTN at the same bit width."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.compress.quant import quantize_model
from kvserve.compress.quant.qat import (
    FakeQuantLinear,
    convert_qat,
    prepare_qat,
    qat_spec,
)
from kvserve.loading import load_model
from kvserve.weights.linear import QuantLinear
from tests.logits import all_position_logits

IDS = [2, 5, 17, 40, 3, 99, 250, 7, 11, 64, 128, 300, 1, 42, 8, 19, 23]
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("qat")
    make_model("gemma3", root / "g", **SHAPE)
    return root / "g"


def test_fake_quant_forward_is_the_rtn_model(source):
    rtn = load_model(source)
    quantize_model(rtn.model, "rtn", bits=4, group_size=32, kernel="dequant", progress=False)
    fq = load_model(source)
    params = prepare_qat(fq.model, qat_spec(bits=4, group_size=32, kernel="dequant"))
    assert len(params) == 7 * fq.config.num_layers
    torch.testing.assert_close(all_position_logits(fq, IDS), all_position_logits(rtn, IDS), atol=1e-5, rtol=1e-5)


def test_straight_through_gradient_is_the_gradient_at_the_rounded_weight():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 32, bias=True)
    fq = FakeQuantLinear(lin, qat_spec(bits=3, group_size=32, kernel="dequant"))
    x = torch.randn(5, 64, generator=g)
    target = torch.randn(5, 32, generator=g)
    ((fq(x) - target) ** 2).sum().backward()
    w_hat = fq.quantized_value().requires_grad_(True)
    ((torch.nn.functional.linear(x, w_hat, lin.bias.detach()) - target) ** 2).sum().backward()
    assert torch.equal(fq.weight.grad, w_hat.grad)
    assert not torch.equal(fq.quantized_value(), fq.weight.detach())  # it does round


@pytest.mark.parametrize("kernel", ["dequant", "auto"])
def test_conversion_packs_exactly_the_trained_grid(source, kernel):
    loaded = load_model(source)
    prepare_qat(loaded.model, qat_spec(bits=4, group_size=32, kernel=kernel))
    with torch.no_grad():  # move the shadows off their initial values, as training would
        for m in loaded.model.modules():
            if isinstance(m, FakeQuantLinear):
                m.weight.add_(torch.randn_like(m.weight) * 0.01)
    fakes = {n: m.quantized_value() for n, m in loaded.model.named_modules() if isinstance(m, FakeQuantLinear)}
    report = convert_qat(loaded.model, kernel=kernel)
    assert len(report.layers) == len(fakes)
    for name, want in fakes.items():
        layer = loaded.model.get_submodule(name)
        assert isinstance(layer, QuantLinear)
        if kernel == "dequant":
            assert torch.equal(layer.dequantized_weight(), want), name
        else:  # int4 kernel: the float zero s * (8 - z) is stored rounded to bf16
            assert layer.kernel == "int4"
            torch.testing.assert_close(layer.dequantized_weight(), want, atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="prepare_qat"):
        convert_qat(loaded.model)


def test_short_distillation_fine_tune_beats_rtn_on_held_out_windows(source):
    """3-bit QAT distilled from the float model: KL to it on windows it never trained on falls
    below RTN's (the prepared model before training IS the RTN model), and the packed model
    scores what the fake-quantized one did."""
    from kvserve.compress.quant.qat import qat
    from kvserve.compress.train import DistillLoss, TrainConfig

    teacher = load_model(source).model
    student = load_model(source)
    g = torch.Generator().manual_seed(0)
    vocab = student.config.vocab_size
    train_w = torch.randint(3, vocab, (400, 24), generator=g)  # never repeated: no memorizing
    held_out = torch.randint(3, vocab, (8, 24), generator=g)
    kl = DistillLoss(teacher, alpha=1.0)
    spec = qat_spec(bits=3, group_size=32, kernel="dequant")
    rtn = load_model(source).model
    prepare_qat(rtn, spec)
    with torch.no_grad():
        kl_rtn = float(kl(rtn, held_out))
    report, trained = qat(student.model, train_w, spec, TrainConfig(steps=100, batch_size=4, lr=3e-4),
                          teacher=teacher, kernel="dequant", progress=False)
    assert trained.steps == 100 and len(report.layers) == 7 * student.config.num_layers
    with torch.no_grad():
        kl_qat = float(kl(student.model, held_out))
    assert kl_qat < 0.9 * kl_rtn, (kl_qat, kl_rtn)
    assert all(isinstance(m, QuantLinear) for n, m in student.model.named_modules() if n.endswith("proj"))


def test_blockwise_qat_lowers_every_block_error_and_the_kl(source):
    """Block-wise QAT (the CPU default): every block's output error falls below RTN's on its
    training windows, and the packed model's KL to the float one on other windows falls too."""
    from kvserve.compress.quant.qat import qat_blockwise
    from kvserve.compress.train import DistillLoss

    teacher = load_model(source).model
    g = torch.Generator().manual_seed(1)
    vocab = teacher.config.vocab_size
    train_w = torch.randint(3, vocab, (16, 32), generator=g)
    held_out = torch.randint(3, vocab, (8, 32), generator=g)
    kl = DistillLoss(teacher, alpha=1.0)
    spec = qat_spec(bits=3, group_size=32, kernel="dequant")
    rtn = load_model(source)
    quantize_model(rtn.model, "rtn", bits=3, group_size=32, kernel="dequant", progress=False)
    student = load_model(source)
    report, record = qat_blockwise(student.model, train_w, spec, epochs=3, lr=1e-3, kernel="dequant", progress=False)
    assert len(report.layers) == 7 * student.config.num_layers
    assert [b["block"] for b in record["blocks"]] == list(range(student.config.num_layers))
    for b in record["blocks"]:
        assert b["mse_qat"] < b["mse_rtn"], b
    with torch.no_grad():
        kl_rtn, kl_qat = float(kl(rtn.model, held_out)), float(kl(student.model, held_out))
    assert kl_qat < kl_rtn, (kl_qat, kl_rtn)  # 0.209 vs 0.219 here: a random model, 512 training tokens
    with pytest.raises(ValueError, match="--qat-epochs"):
        qat_blockwise(load_model(source).model, train_w, spec, epochs=0)


@pytest.mark.parametrize("mode", ["block", "e2e"])
def test_quantize_cli_qat_writes_a_loadable_folder(source, tmp_path, capsys, mode):
    import json

    from kvserve.cli import main

    text = tmp_path / "train.txt"
    text.write_text(" ".join(f"word{i % 37} and more text {i}" for i in range(400)))
    out = tmp_path / "q"
    common = ["quantize", str(source), "--method", "qat", "--qat-mode", mode, "--bits", "4", "--group-size", "32"]
    extra = (["--nsamples", "2", "--calib-seqlen", "16", "--calib-file", str(text), "--qat-epochs", "1"]
             if mode == "block" else
             ["--qat-steps", "3", "--qat-seqlen", "16", "--qat-batch-size", "2", "--qat-text-file", str(text)])
    rc = main(common + extra + ["--out", str(out), "--json", str(tmp_path / "r.json")])
    assert rc == 0
    info = json.loads((tmp_path / "r.json").read_text())
    assert info["method"] == "qat" and info["qat"]["mode"] == mode
    assert (len(info["qat"]["blocks"]) == 6) if mode == "block" else (info["qat"]["steps"] == 3)
    back = load_model(out)
    assert {m.kernel for m in back.model.modules() if isinstance(m, QuantLinear)} == {"int4"}
    bad = ["--qat-epochs", "0"] if mode == "block" else ["--qat-steps", "0"]
    rc = main(common + extra + bad + ["--out", str(tmp_path / "bad")])
    assert rc == 2 and bad[0] in capsys.readouterr().err
