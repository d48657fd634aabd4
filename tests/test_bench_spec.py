"""`kvserve bench spec` end to end on a tiny random model (fast), and its input errors."""
from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.speculative.draft_vocab import write_draft_vocab
from kvserve.tools.bench.spec import SpecRun, make_prompts, speedups
from tests.conftest import WIKITEXT
from tests.tiny_models import make_model


def test_bench_spec_runs_side_by_side_and_writes_json_and_plot(tmp_path, capsys):
    make_model("llama", tmp_path / "tiny")
    vocab = json.loads((tmp_path / "tiny" / "config.json").read_text())["vocab_size"]
    write_draft_vocab(tmp_path / "vocab.json", list(range(0, vocab, 2)), vocab, source="test")
    out, png = tmp_path / "spec.json", tmp_path / "spec.png"
    rc = main(["bench", "spec", "--model", str(tmp_path / "tiny"), "--proposers", "ngram,self+heuristic,self-exit1+vocab",
               "--draft-vocab", str(tmp_path / "vocab.json"), "--k", "2",
               "--batch", "1,2", "--num-prompts", "2", "--doc-words", "20", "--output-len", "6", "--rounds", "2", "--kv-cache-gib", "0.01", "--top-k", "5",
               "--dataset-path", str(WIKITEXT / "wiki.test.raw"), "--json", str(out), "--plot", str(png)])
    assert rc == 0
    runs = json.loads(out.read_text())
    assert {(r["proposer"], r["k"], r["batch"]) for r in runs} == {
        (p, k, b) for b in (1, 2) for p, k in [("plain", 0), ("ngram", 2), ("self+heuristic", 2),
                                                 ("self-exit1+vocab", 2)]}
    for r in runs:
        assert len(r["seconds"]) == 2 and r["output_tokens"] == 2 * 6
        if r["proposer"] != "plain":
            assert 0.0 <= r["acceptance_rate"] <= 1.0 and 1.0 <= r["tokens_per_step"] <= r["k"] + 1
    assert png.stat().st_size > 1000
    table = capsys.readouterr().out
    assert "| 1 | plain | - |" in table and "speedup" in table and "top-k 5, repetition penalty 1.0" in table


def test_speedup_is_relative_to_plain_at_the_same_batch():
    runs = [SpecRun("plain", 0, 1, 100, [10.0]), SpecRun("ngram", 2, 1, 100, [5.0]),
            SpecRun("plain", 0, 8, 800, [10.0]), SpecRun("ngram", 2, 8, 800, [20.0])]
    assert speedups(runs) == {("plain", 0, 1): 1.0, ("ngram", 2, 1): 2.0, ("plain", 0, 8): 1.0, ("ngram", 2, 8): 0.5}


def test_prompts_are_grounded_in_their_document():
    words = (WIKITEXT / "wiki.test.raw").read_text(encoding="utf-8").split()
    grounded = make_prompts(words, "grounded", 4, 30, seed=1)
    assert "Repeat the following document" in grounded[0] and "Summarize" in grounded[1]
    assert make_prompts(words, "grounded", 4, 30, seed=1) == grounded
    assert all("Document" not in p for p in make_prompts(words, "free", 3, 30, seed=1))


@pytest.mark.parametrize("args, field", [
    (["--proposers", "medusa"], "--proposers"),
    (["--proposers", "draft"], "--speculative-model"),
    (["--proposers", "ngram+dynamic"], "--proposers"),
    (["--proposers", "draft+heuristic"], "--speculative-model"),
    (["--proposers", "self-exit0"], "--proposers"),
    (["--proposers", "ngram+vocab"], "--proposers"),
    (["--proposers", "self+vocab"], "--draft-vocab"),
    (["--workload", "chat"], "--workload"),
    (["--dataset-path", "/nonexistent/wiki.txt"], "--dataset-path"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
])
def test_bad_arguments_name_the_flag(args, field, capsys):
    assert main(["bench", "spec", *args]) == 2
    assert field in capsys.readouterr().err
