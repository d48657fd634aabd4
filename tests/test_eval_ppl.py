"""`kvserve eval ppl`: windows, batched window forward vs HF transformers and vs the engine's
paged path, KL divergence, and the CLI end to end on the bundled Gemma."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvserve.cli import main
from kvserve.loading import load_model
from kvserve.tools.eval import ppl as ev
from tests.conftest import WIKITEXT
from tests.logits import all_position_logits
from tests.tiny_models import VOCAB, make_model

DATA = WIKITEXT / "wiki.test.raw"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    """A random tiny model (gemma3: sliding window 8, shorter than the windows scored) and its HF twin."""
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}_ppl")
    hf = make_model(request.param, folder)
    return load_model(folder), hf


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_windows_bos_and_tail():
    ids = torch.arange(10, 33)  # 23 text tokens
    w = ev.make_windows(ids, 6, bos_token_id=2)
    assert w.shape == (4, 6) and (w[:, 0] == 2).all()
    assert torch.equal(w[:, 1:].reshape(-1), ids[:20])  # every text token once, tail of 3 dropped
    w = ev.make_windows(ids, 6)
    assert w.shape == (3, 6) and torch.equal(w.reshape(-1), ids[:18])
    assert ev.make_windows(ids, 6, 2, max_windows=2).shape == (2, 6)
    with pytest.raises(ValueError, match="--seqlen 64"):
        ev.make_windows(ids, 64)


@pytest.mark.parametrize("bos", [True, False])
def test_perplexity_matches_hf_transformers(tiny, bos):
    """exp(mean NLL) over the same windows, HF computing each window alone with its own forward."""
    ours, hf = tiny
    ids = _tokens(5 * 24 + 7)
    bos_id = ours.config.bos_token_id if bos else None
    r = ev.perplexity(ours.model, ids, 24, bos_token_id=bos_id, batch_size=2, progress=False)  # uneven last batch
    windows = ev.make_windows(ids, 24, bos_id)
    nll = []
    with torch.no_grad():
        for w in windows:
            logits = hf(w[None]).logits[0].float()
            nll.append(F.cross_entropy(logits[:-1], w[1:], reduction="none"))
    nll = torch.cat(nll).double()
    assert r.num_windows == len(windows) == 5 and r.num_tokens == nll.numel() == 5 * 23
    assert r.bos is bos
    assert math.isclose(r.ppl, math.exp(float(nll.mean())), rel_tol=1e-5), (r.ppl, math.exp(float(nll.mean())))
    per_window = nll.view(5, 23).mean(1)
    assert torch.allclose(torch.tensor(r.window_nll, dtype=torch.float64), per_window, rtol=1e-5)


def test_kl_to_itself_is_zero(tiny):
    ours, _ = tiny
    r = ev.kl_divergence(ours.model, ours.model, _tokens(100), 16, batch_size=3, progress=False)
    assert r.kl_mean == 0.0 and r.kl_max == 0.0 and r.top1_agree == 1.0 and r.ref_ppl == r.ppl


def test_kl_matches_direct_computation_on_the_paged_path(tiny):
    """KL(ref || model) against the same quantity from the engine's own paged attention, one window
    at a time (an independent path to the logits)."""
    from kvserve.compress.quant import quantize_model

    ours, _ = tiny
    folder = ours.source
    quant = load_model(folder)
    quantize_model(quant.model, bits=3, group_size=32, act_dtype=torch.float32, progress=False)
    ids = _tokens(3 * 20, seed=1)
    bos = ours.config.bos_token_id
    r = ev.kl_divergence(quant.model, ours.model, ids, 20, bos_token_id=bos, progress=False)
    kls, nll_q, nll_r = [], [], []
    for w in ev.make_windows(ids, 20, bos):
        lp = torch.log_softmax(all_position_logits(quant, w.tolist())[:-1], -1)
        lq = torch.log_softmax(all_position_logits(ours, w.tolist())[:-1], -1)
        kls.append((lq.exp() * (lq - lp)).sum(-1))
        nll_q.append(-lp.gather(1, w[1:, None])[:, 0])
        nll_r.append(-lq.gather(1, w[1:, None])[:, 0])
    kl = torch.cat(kls).double()
    assert r.kl_mean > 1e-4  # 3-bit weights do move the distribution
    assert math.isclose(r.kl_mean, float(kl.mean()), rel_tol=1e-3, abs_tol=1e-6)
    assert math.isclose(r.ppl, math.exp(float(torch.cat(nll_q).double().mean())), rel_tol=1e-4)
    assert math.isclose(r.ref_ppl, math.exp(float(torch.cat(nll_r).double().mean())), rel_tol=1e-4)


def test_bad_config_names_the_flag():
    for kwargs, flag in [(dict(seqlen=1), "--seqlen"), (dict(max_windows=0), "--max-windows"),
                         (dict(batch_size=0), "--batch-size"), (dict(dataset="c4"), "--dataset")]:
        with pytest.raises(ValueError, match=flag):
            ev.PplConfig(**kwargs)


# --- the bundled Gemma --------------------------------------------------------------------------

@pytest.mark.slow
def test_gemma_window_path_equals_paged_path(gemma):
    """On the real model: the batched window forward scores exactly what the engine's paged
    prefill scores, window by window."""
    ids = ev.tokenize_file(gemma.tokenizer, DATA)[:300]
    bos = gemma.config.bos_token_id
    r = ev.perplexity(gemma.model, ids, 64, bos_token_id=bos, max_windows=3, progress=False)
    nll = []
    for w in ev.make_windows(ids, 64, bos, max_windows=3):
        logits = all_position_logits(gemma, w.tolist())[:-1]
        nll.append(F.cross_entropy(logits, w[1:], reduction="none"))
    assert math.isclose(r.ppl, math.exp(float(torch.cat(nll).double().mean())), rel_tol=1e-4)


@pytest.fixture
def cli_model(gemma, monkeypatch):
    """The CLI loads its model through ev.load_model: hand it the session's Gemma."""
    monkeypatch.setattr(ev, "load_model", lambda model=None, dtype="float32": gemma)


@pytest.mark.slow
def test_cli_end_to_end_on_gemma(cli_model, gemma, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", "--seqlen", "128", "--max-windows", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| PPL |" in printed and "2 windows x 128 tokens" in printed
    doc = json.loads(out.read_text())
    assert doc["num_windows"] == 2 and doc["num_tokens"] == 254 and doc["bos"] is True
    assert 1 < doc["ppl"] < 1000 and doc["data"].endswith("wiki.test.raw") and doc["quant"] is None

    # Quantized in-process, KL to the float32 model in the same pass; the session model is untouched.
    out8 = tmp_path / "int8.json"
    assert main(["eval", "ppl", "--seqlen", "128", "--max-windows", "2", "--kl-to", "baseline", "--quant", "rtn",
                 "--bits", "8", "--granularity", "channel", "--sym", "--json", str(out8)]) == 0
    q = json.loads(out8.read_text())
    assert q["quant"]["label"] == "int8 sym per-channel" and q["quant"]["kernels"] == {"int8": 7 * 18}
    assert math.isclose(q["ref_ppl"], doc["ppl"], rel_tol=1e-6)
    assert 0 < q["kl_mean"] < 0.05 and q["top1_agree"] > 0.8
    assert q["weight_bytes"] < doc["weight_bytes"]
    assert all(isinstance(m, torch.nn.Linear) for m in (gemma.model.layers[0].mlp.down_proj,
                                                         gemma.model.layers[-1].self_attn.q_proj))


@pytest.mark.slow
def test_cli_kl_to_baseline_of_itself_is_zero(cli_model, tmp_path):
    out = tmp_path / "self.json"
    assert main(["eval", "ppl", "--seqlen", "64", "--max-windows", "1", "--kl-to", "baseline",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kl_mean"] == 0.0 and doc["ppl"] == doc["ref_ppl"]


@pytest.mark.parametrize("argv,message", [
    (["--seqlen", "1"], "--seqlen"),
    (["--max-windows", "0"], "--max-windows"),
    (["--batch-size", "0"], "--batch-size"),
    (["--dataset", "c4"], "--dataset"),
    (["--text-file", "/no/such/file.txt"], "/no/such/file.txt"),
    (["--quant", "rtn", "--bits", "9"], "bits"),
    (["--quant", "rtn", "--group-size", "0"], "group_size"),
])
def test_cli_bad_arguments_exit_2_naming_the_flag(argv, message, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("bad flags must be rejected before the model loads")

    monkeypatch.setattr(ev, "load_model", no_load)
    assert main(["eval", "ppl"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and message in err, err


@pytest.mark.slow
def test_cli_text_too_short(cli_model, tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("a few words")
    assert main(["eval", "ppl", "--text-file", str(small), "--seqlen", "128"]) == 2
    assert "--seqlen 128" in capsys.readouterr().err
