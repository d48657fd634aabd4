"""The training building blocks (kvserve/compress/train): windows, chunked losses, the resumable loop.

Oracles: losses formed from the full [rows, vocab] logits with torch's own functions, gradients
of the unchunked loss, a run interrupted and resumed vs one run, and the loss going down on a
text the model can memorize."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvserve.compress.train import (
    DistillLoss,
    LMLoss,
    TrainConfig,
    distill_loss,
    lm_loss,
    train,
    trainable_parameters,
    training_windows,
)
from kvserve.loading import load_model
from kvserve.tools.eval.ppl import make_windows, tokenize_file, window_hidden

TEXT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks. " * 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Gemma 3 (softcapped logits, sliding + global layers) and a text file."""
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("train")
    make_model("gemma3", root / "gemma3", final_logit_softcapping=30.0)
    (root / "text.txt").write_text(TEXT)
    return root


@pytest.fixture()
def loaded(tiny):
    return load_model(tiny / "gemma3")


def _windows(loaded, tiny, seqlen=16, n=None):
    return training_windows(loaded.tokenizer, seqlen, path=tiny / "text.txt",
                            bos_token_id=loaded.config.bos_token_id, max_windows=n)


def _perturbed(model, scale=0.05, seed=3):
    """A different model of the same shape: the teacher of the distillation tests."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


def _reference_losses(student, teacher, windows, tau):
    """(CE, KL at tau) from the full logits: the oracle of the chunked implementations."""
    rows = window_hidden(student, windows)[:, :-1].reshape(-1, student.config.hidden_size)
    s = student.compute_logits(rows)
    targets = windows[:, 1:].reshape(-1)
    ce = F.cross_entropy(s, targets)
    with torch.no_grad():
        t = teacher.compute_logits(window_hidden(teacher, windows)[:, :-1].reshape(rows.shape))
    pt = torch.softmax(t / tau, -1)
    kl = (pt * (torch.log(pt) - torch.log_softmax(s / tau, -1))).sum(-1).mean()
    return ce, kl


def _grads(model, params, fn):
    for p in params:
        p.grad = None
        p.requires_grad_(True)
    fn()
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
        p.requires_grad_(False)
    return out


# --- data ------------------------------------------------------------------------------------

def test_training_windows_are_the_shuffled_non_overlapping_windows(loaded, tiny):
    bos = loaded.config.bos_token_id
    w = _windows(loaded, tiny, seqlen=16)
    ref = make_windows(tokenize_file(loaded.tokenizer, tiny / "text.txt"), 16, bos)
    assert w.dtype == torch.long and w.shape == ref.shape
    assert (w[:, 0] == bos).all()
    assert not torch.equal(w, ref)  # shuffled ...
    assert sorted(map(tuple, w.tolist())) == sorted(map(tuple, ref.tolist()))  # ... the same windows
    assert torch.equal(w, _windows(loaded, tiny, seqlen=16))  # the same seed, the same order
    other = training_windows(loaded.tokenizer, 16, path=tiny / "text.txt", bos_token_id=bos, seed=1)
    assert not torch.equal(w, other)
    assert torch.equal(_windows(loaded, tiny, seqlen=16, n=3), w[:3])
    plain = training_windows(loaded.tokenizer, 16, path=tiny / "text.txt")
    assert plain.shape[1] == 16 and not (plain[:, 0] == bos).all()


def test_training_windows_bad_input(loaded, tiny):
    with pytest.raises(ValueError, match="--text-file.*nope.txt"):
        training_windows(loaded.tokenizer, 16, path=tiny / "nope.txt")
    with pytest.raises(ValueError, match="--seqlen"):
        training_windows(loaded.tokenizer, 1, path=tiny / "text.txt")
    with pytest.raises(ValueError, match="--seqlen 100000"):
        training_windows(loaded.tokenizer, 100000, path=tiny / "text.txt")


# --- losses ----------------------------------------------------------------------------------

def test_losses_match_the_full_logits_oracle(loaded, tiny):
    model = loaded.model
    teacher = _perturbed(model)
    w = _windows(loaded, tiny, n=3)
    with torch.no_grad():
        ce, kl = _reference_losses(model, teacher, w, tau=2.0)
        torch.testing.assert_close(lm_loss(model, w), ce)
        got = distill_loss(model, teacher, w, temperature=2.0, alpha=0.3)
        torch.testing.assert_close(got, 0.7 * ce + 0.3 * 4.0 * kl)


@pytest.mark.parametrize("kind", ["lm", "distill"])
def test_chunked_loss_equals_unchunked_with_the_same_gradients(loaded, tiny, kind):
    model = loaded.model
    teacher = _perturbed(model)
    w = _windows(loaded, tiny, n=3)  # 3 x 15 = 45 rows: chunks of 7 leave a ragged tail

    def make(chunk):
        if kind == "lm":
            return LMLoss(chunk_rows=chunk)
        return DistillLoss(teacher, temperature=2.0, alpha=0.4, chunk_rows=chunk)

    params = list(model.parameters())  # the tied embedding / head included
    box = {}

    def oracle():
        ce, kl = _reference_losses(model, teacher, w, tau=2.0)
        loss = ce if kind == "lm" else 0.6 * ce + 0.4 * 4.0 * kl
        loss.backward()
        box["oracle"] = loss.detach()

    def whole():
        loss = make(10**6)(model, w)
        loss.backward()
        box["whole"] = loss.detach()

    def checkpointed():
        loss = make(7)(model, w)
        loss.backward()
        box["checkpointed"] = loss.detach()

    def forward_backward():
        box["fb"] = make(7).forward_backward(model, w)

    want = _grads(model, params, oracle)
    for fn in (whole, checkpointed, forward_backward):
        got = _grads(model, params, fn)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4)
    for k in ("whole", "checkpointed", "fb"):
        torch.testing.assert_close(box[k], box["oracle"])
    assert any(g.abs().sum() > 0 for g in want)


def test_distill_alpha_ends(loaded, tiny):
    model = loaded.model
    teacher = _perturbed(model)
    w = _windows(loaded, tiny, n=2)
    with torch.no_grad():
        torch.testing.assert_close(distill_loss(model, teacher, w, alpha=0.0, temperature=3.0), lm_loss(model, w))
        assert float(distill_loss(model, model, w, alpha=1.0, temperature=2.0)) == pytest.approx(0.0, abs=1e-6)
        assert float(distill_loss(model, teacher, w, alpha=1.0, temperature=2.0)) > 1e-4


def test_loss_bad_input(loaded):
    model = loaded.model
    with pytest.raises(ValueError, match="--alpha"):
        DistillLoss(model, alpha=1.5)
    with pytest.raises(ValueError, match="--alpha"):
        DistillLoss(model, alpha=-0.1)
    with pytest.raises(ValueError, match="--temperature"):
        DistillLoss(model, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_rows"):
        LMLoss(chunk_rows=0)
    with pytest.raises(ValueError, match="windows"):
        lm_loss(model, torch.zeros(4, dtype=torch.long))


# --- the loop --------------------------------------------------------------------------------

def test_training_lowers_the_loss_and_restores_flags(loaded, tiny):
    model = loaded.model
    w = _windows(loaded, tiny)
    with torch.no_grad():
        before = float(lm_loss(model, w))
    emb = model.embed_tokens.weight.clone()
    params = trainable_parameters(model, train_embeddings=False)
    assert all(p is not model.embed_tokens.weight for p in params) and params
    report = train(model, w, lm_loss, TrainConfig(steps=25, batch_size=4, lr=3e-3, warmup_steps=3),
                   params=params, progress=False)
    with torch.no_grad():
        after = float(lm_loss(model, w))
    assert after < 0.6 * before, (before, after)
    assert report.steps == 25 and len(report.losses) == 25 and report.resumed_from == 0
    assert report.tokens == 25 * 4 * w.shape[1]
    assert torch.equal(model.embed_tokens.weight, emb)  # frozen
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_a_plain_tensor_loss_trains_too(loaded, tiny):
    """A loss without forward_backward (here a lambda) takes the loss.backward() path."""
    model = loaded.model
    w = _windows(loaded, tiny)
    ref = copy.deepcopy(model)
    cfg = TrainConfig(steps=3, batch_size=2, lr=1e-3)
    train(model, w, lambda m, b: lm_loss(m, b), cfg, progress=False)
    train(ref, w, lm_loss, cfg, progress=False)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_resume_equals_one_run(loaded, tiny, tmp_path):
    w = _windows(loaded, tiny)
    teacher = _perturbed(loaded.model)
    loss = DistillLoss(teacher, temperature=2.0, alpha=0.5)
    cfg = TrainConfig(steps=6, batch_size=3, lr=2e-3, warmup_steps=2, weight_decay=0.01, checkpoint_every=3)
    one = copy.deepcopy(loaded.model)
    full = train(one, w, loss, cfg, progress=False)

    two = copy.deepcopy(loaded.model)
    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):  # stop after step 3, as a Ctrl-C would
        train(two, w, _InterruptAfter(loss, 4), cfg, checkpoint=ckpt, progress=False)
    assert torch.load(ckpt, weights_only=True)["step"] == 3  # tensors and plain values only
    fresh = copy.deepcopy(loaded.model)  # a new process: weights from the checkpoint
    rest = train(fresh, w, loss, cfg, checkpoint=ckpt, progress=False)
    assert rest.resumed_from == 3 and rest.steps == 6 and rest.tokens == 3 * 3 * w.shape[1]
    for a, b in zip(one.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert rest.losses == pytest.approx(full.losses, abs=1e-6)
    again = train(copy.deepcopy(loaded.model), w, loss, cfg, checkpoint=ckpt, progress=False)  # already done
    assert again.resumed_from == 6 and again.tokens == 0


class _InterruptAfter:
    """A plain loss (no forward_backward) that raises KeyboardInterrupt on its n-th call."""

    def __init__(self, loss, n):
        self.loss, self.n, self.calls = loss, n, 0

    def __call__(self, model, windows):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return self.loss(model, windows)


def test_resume_with_other_settings_names_the_field(loaded, tiny, tmp_path):
    w = _windows(loaded, tiny)
    ckpt = tmp_path / "ckpt.pt"
    train(loaded.model, w, lm_loss, TrainConfig(steps=2, batch_size=2, lr=1e-3), checkpoint=ckpt, progress=False)
    with pytest.raises(ValueError, match="'lr'"):
        train(loaded.model, w, lm_loss, TrainConfig(steps=2, batch_size=2, lr=2e-3), checkpoint=ckpt, progress=False)
    with pytest.raises(ValueError, match="'steps'"):
        train(loaded.model, w, lm_loss, TrainConfig(steps=4, batch_size=2, lr=1e-3), checkpoint=ckpt, progress=False)
    with pytest.raises(ValueError, match="windows differ"):
        train(loaded.model, w[1:], lm_loss, TrainConfig(steps=2, batch_size=2, lr=1e-3), checkpoint=ckpt,
              progress=False)
    with pytest.raises(ValueError, match="trainable parameters differ"):
        train(loaded.model, w, lm_loss, TrainConfig(steps=2, batch_size=2, lr=1e-3), checkpoint=ckpt,
              params=trainable_parameters(loaded.model, train_embeddings=False), progress=False)
    # cosmetic fields may change
    train(loaded.model, w, lm_loss, TrainConfig(steps=2, batch_size=2, lr=1e-3, log_every=1), checkpoint=ckpt,
          progress=False)
    assert not any(p.requires_grad for p in loaded.model.parameters())  # restored after the errors too


@pytest.mark.parametrize("field, value, flag", [("steps", 0, "--steps"), ("batch_size", 0, "--batch-size"),
                                                ("lr", 0.0, "--lr"), ("lr", float("nan"), "--lr"),
                                                ("warmup_steps", 5, "--warmup-steps"),
                                                ("grad_clip", -1.0, "--grad-clip"),
                                                ("schedule", "step", "--schedule"),
                                                ("checkpoint_every", -1, "--checkpoint-every")])
def test_bad_config(field, value, flag):
    kwargs = {"steps": 4, field: value}
    with pytest.raises(ValueError, match=flag):
        TrainConfig(**kwargs)


def test_schedule():
    cfg = TrainConfig(steps=10, lr=1.0, warmup_steps=2)
    lrs = [cfg.lr_at(s) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and 0 < lrs[-1] < 0.1
    lin = TrainConfig(steps=4, lr=1.0, schedule="linear")
    assert [lin.lr_at(s) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
