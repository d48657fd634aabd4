"""lm-evaluation-harness against `kvserve serve` (its `local-completions` model, over HTTP) and
against HF transformers (its `hf` model) on the same Gemma GGUF and the same local tasks: a
multiple-choice loglikelihood task and a greedy generate-until task (tests/lm_eval_tasks/, data
shipped beside them; nothing is downloaded). Per-sample loglikelihoods agree within 1e-3, and
accuracies and generations are equal."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' JSONL files are read, never fetched
import lm_eval  # noqa: E402  (the dev extras': a missing package fails here, it does not skip)
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from tests.server_harness import live_server, make_engine  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = "tests/lm_eval_tasks"  # the YAMLs name their data files relative to the repository root
MC, GEN = "kvserve_mc", "kvserve_gen"
MODEL = "gemma-test"
LL_TOL = 1e-3


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """lm-eval's task registry with the local tasks; lm-eval reseeds the global RNGs, so they
    are restored for the tests that follow."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        yield TaskManager(include_path=str(ROOT / TASKS_DIR))
    finally:
        os.chdir(cwd)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


@pytest.fixture(scope="module")
def server(gemma):
    with live_server(make_engine(gemma, kv_cache_gib=0.2, max_model_len=2048), MODEL) as srv:
        yield srv


def _evaluate(lm, tasks: TaskManager, names: list[str]) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tasks, log_samples=True, bootstrap_iters=0)


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _assert_loglikelihoods_equal(ours: dict, ref: dict) -> None:
    a, b = _samples(ours, MC), _samples(ref, MC)
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        assert x["arguments"] == y["arguments"]  # the same contexts and continuations were scored
        for (ll, greedy), (ref_ll, ref_greedy) in zip((r[0] for r in x["resps"]), (r[0] for r in y["resps"])):
            assert abs(ll - ref_ll) < LL_TOL, (x["doc_id"], ll, ref_ll)
            assert greedy == ref_greedy
    assert ours["results"][MC]["acc,none"] == ref["results"][MC]["acc,none"]


def test_local_completions_equal_hf(server, tasks, hf_gemma, hf_gemma_tokenizer, tmp_path):
    """The setting that gives Gemma its BOS on both sides: local-completions tokenizes with the
    model's HF tokenizer (a local folder) and adds BOS, as `--model hf` does by default."""
    hf_gemma_tokenizer.save_pretrained(tmp_path)
    local = LocalCompletionsAPI(model=MODEL, base_url=f"{server.url}/v1/completions", tokenizer_backend="huggingface",
                                tokenizer=str(tmp_path), add_bos_token=True, batch_size=8, max_retries=1)
    ours = _evaluate(local, tasks, [MC, GEN])
    assert server.wait_pool_full(10), server.state.engine.stats()
    ref = _evaluate(HFLM(pretrained=hf_gemma, tokenizer=hf_gemma_tokenizer, batch_size=8), tasks, [MC, GEN])

    _assert_loglikelihoods_equal(ours, ref)
    assert ours["results"][MC]["acc,none"] > 0.5  # the model does answer these (chance is 0.25)
    gen, ref_gen = _samples(ours, GEN), _samples(ref, GEN)
    assert len(gen) == len(ref_gen) == 10
    assert [s["resps"] for s in gen] == [s["resps"] for s in ref_gen]
    assert ours["results"][GEN]["exact_match,none"] == ref["results"][GEN]["exact_match,none"] > 0


def test_remote_tokenizer_is_detected_and_equals_hf(server, tasks, hf_gemma, hf_gemma_tokenizer):
    """local-completions with no tokenizer named finds the server's /tokenizer_info and /tokenize
    and tokenizes through them; that tokenizer adds no special tokens, so the reference runs
    without BOS too."""
    local = LocalCompletionsAPI(model=MODEL, base_url=f"{server.url}/v1/completions", batch_size=8, max_retries=1)
    assert local.tokenizer_backend == "remote"
    text = "Question: What is the capital of France?\nAnswer: Paris"
    assert local.tok_encode(text) == hf_gemma_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert local.eot_token_id == hf_gemma_tokenizer.eos_token_id
    ours = _evaluate(local, tasks, [MC])
    ref = _evaluate(HFLM(pretrained=hf_gemma, tokenizer=hf_gemma_tokenizer, add_bos_token=False, batch_size=8),
                    tasks, [MC])
    _assert_loglikelihoods_equal(ours, ref)
    assert server.wait_pool_full(10), server.state.engine.stats()
