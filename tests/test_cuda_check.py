"""kvserve/tools/bench/cuda_check.py, the GPU check: its verdicts, its reference files, and its CPU dry run
of both models' paths (the GPU run itself needs a lent machine)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.loading import load_model
from kvserve.tools.bench import cuda_check as cuda_check_module
from tests.tiny_models import VOCAB, make_model

TINY_LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5)
SMALL_RUN = ["--device", "cpu", "--prompts", "3", "--prompt-tokens", "12", "--max-tokens", "8",
             "--synthetic-prompts", "2", "--synthetic-max-tokens", "6", "--repeats", "1", "--output-len", "4",
             "--offline-requests", "3", "--kv-cache-gib", "0.05", "--bandwidth-gib", "0.05"]


@pytest.fixture(scope="module")
def cuda_check():
    return cuda_check_module


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    """A random Gemma 3 (sliding and full layers) long enough for the speed workload's prompts."""
    folder = tmp_path_factory.mktemp("gemma3")
    make_model("gemma3", folder, max_position_embeddings=1024)
    return folder


@pytest.fixture
def text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys in blocks. " * 40)
    return path


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def test_compare_verdicts(cuda_check):
    ref = cuda_check.Reference([2, 3], [10, 11, 12, 13], [{10: -0.1}, {11: -0.5, 40: -0.52}, {12: -0.2}, {13: -0.1}])
    assert cuda_check.compare(ref, [10, 11, 12, 13], 0.01).verdict == "equal"
    c = cuda_check.compare(ref, [10, 40, 7, 7], 0.05)  # parts at 1, with the runner-up 0.02 behind
    assert (c.equal_tokens, c.verdict) == (1, "near-tie") and c.margin == pytest.approx(0.02)
    assert cuda_check.compare(ref, [10, 40, 7, 7], 0.01).verdict == "mismatch"
    c = cuda_check.compare(ref, [10, 11, 99, 13], 1e9)  # a token the reference did not rank
    assert c.verdict == "mismatch" and c.margin == float("inf")
    assert cuda_check.compare(ref, [10, 11], 1e9).verdict == "mismatch"  # shorter: not rounding


def test_kernel_table_sums_launches_and_time_per_step(cuda_check):
    """The profiler's kernels of a replay, by name: a two-step replay halves every figure."""
    class Event:
        def __init__(self, name: str, us: float):
            self.name, self.time_range = name, type("Range", (), {"elapsed_us": lambda _: us})()

    events = [Event("gemv", 5.0), Event("norm", 1.0), Event("gemv", 7.0), Event("norm", 3.0), Event("x" * 90, 2.0)]
    table = cuda_check.kernel_table(events, steps=2)
    assert table == [{"kernel": "gemv", "launches_per_step": 1.0, "us_per_step": 6.0, "us_each": 6.0},
                     {"kernel": "norm", "launches_per_step": 1.0, "us_per_step": 2.0, "us_each": 2.0},
                     {"kernel": "x" * 80, "launches_per_step": 0.5, "us_per_step": 1.0, "us_each": 2.0}]


def test_reference_file_round_trip(cuda_check, tiny_gemma, text, tmp_path):
    path = tmp_path / "ref.json"
    assert cuda_check.main(SMALL_RUN + ["--model", str(tiny_gemma), "--text", str(text),
                                        "--write-reference", str(path)]) == 0
    refs = cuda_check.load_references(path, "gemma")
    assert len(refs) == 3 and all(len(r.prompt) == 12 and len(r.tokens) == 8 for r in refs)
    # Each generated token is the top of its own logprobs (greedy), keys back as ints.
    assert all(max(top, key=top.get) == t for r in refs for t, top in zip(r.tokens, r.top_logprobs))


def test_cpu_dry_run_of_the_bundled_model_path(cuda_check, tiny_gemma, text, tmp_path):
    ref = tmp_path / "ref.json"
    cuda_check.main(SMALL_RUN + ["--model", str(tiny_gemma), "--text", str(text), "--write-reference", str(ref)])
    rc = cuda_check.main(SMALL_RUN + ["--model", str(tiny_gemma), "--reference", str(ref), "--skip-synthetic",
                                      "--json-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "cuda_check_cpu.json").read_text())
    gemma = data["models"]["gemma"]
    assert data["ok"] and not gemma["errors"]
    assert set(gemma["greedy"]) == {"graphs, one at a time", "graphs, one batch", "eager, one batch"}
    assert all(c["verdict"] == "equal" and c["equal_tokens"] == 8 for rows in gemma["greedy"].values() for c in rows)
    speed = gemma["speed"]
    assert speed["kvserve"]["decode_batch1_tok_s"] > 0 and speed["kvserve"]["offline_output_tok_s"] > 0
    runs = speed["kvserve"]["offline_seconds_runs"]  # twice: a first run's one-time costs show
    assert len(runs) == 2 and speed["kvserve"]["offline_seconds"] == min(runs)
    assert speed["kvserve"]["offline_triton_compiles"] == [{}, {}]  # (C kernels on the CPU; the hook: test_triton_compile)
    prof = speed["kvserve"]["offline_host_profile"]
    assert prof["engine_steps"] >= 8 and prof["ms_per_step"] > 0  # (3 requests of 32-256 tokens)
    assert len(prof["top_own_time"]) == 20 and all(r["calls"] > 0 for r in prof["top_own_time"])
    assert speed["hf"]["decode_batch1_tok_s"] > 0 and speed["decode_vs_hf"] > 0
    assert speed["bound"]["bytes_per_token"] > 0 and 0 < speed["kvserve_share_of_bound"]


def test_cpu_dry_run_of_the_synthetic_model_path(cuda_check, tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_check, "LLAMA_1B", TINY_LLAMA)  # the 1B shapes take minutes on two cores
    # The graph runner's CPU stand-in, so that the multi-step runs are checked and timed too.
    monkeypatch.setattr(LLMEngine, "_cuda_graphs_apply", lambda self: self._cuda_graphs_fit())
    rc = cuda_check.main(SMALL_RUN + ["--skip-gemma", "--num-scheduler-steps", "3", "--json-dir", str(tmp_path)])
    assert rc == 0
    llama = json.loads((tmp_path / "cuda_check_cpu.json").read_text())["models"]["llama_1b"]
    assert not llama["errors"]
    assert "graphs, 3-step runs, one batch" in llama["greedy"]
    assert all(c["verdict"] == "equal" and c["equal_tokens"] == 6 for rows in llama["greedy"].values() for c in rows)
    speed = llama["speed"]
    assert speed["hf"]["prefill_512_tok_s"] > 0
    multi = speed["kvserve_multi_step"]
    assert multi["decode_batch1_tok_s"] > 0 and multi["offline_output_tok_s"] > 0
    assert speed["multi_step_share_of_bound"] > 0 and speed["kvserve"]["host_step_ms"] > 0
    assert speed["kvserve_cublas"]["decode_batch1_tok_s"] > 0 and speed["small_batch_kernels_speedup"] > 0
    assert json.loads((tmp_path / "cuda_check_cpu.json").read_text())["environment"]["wall_s"] > 0


def test_host_step_leaves_the_replays_out(cuda_check, tmp_path, monkeypatch):
    monkeypatch.setattr(LLMEngine, "_cuda_graphs_apply", lambda self: self._cuda_graphs_fit())
    make_model("llama", tmp_path)
    llm = LLM(loaded=load_model(tmp_path), kv_cache_gib=0.01, max_num_seqs=2)
    graphs = llm.engine.runner.graphs
    replays = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, inputs: replays.append(len(inputs)) or run(self, inputs))
    host = cuda_check.host_step_ms(llm, VOCAB, 2, steps=32)
    assert replays == [1] and host > 0  # one real replay; 30 more steps handed its outputs
    assert "run" not in vars(graphs)  # the runner's own method again
    llm.generate([[2, 5, 6]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert replays == [1, 1, 1, 1]
    assert cuda_check.host_step_ms(LLM(loaded=load_model(tmp_path), kv_cache_gib=0.01, enforce_eager=True),
                                   VOCAB, 2) is None


class _TimeLimit(BaseException):
    """What a device's time limit does to the run: it stops, with no chance to save."""


def test_a_run_cut_off_keeps_the_figures_it_measured(cuda_check, tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_check, "LLAMA_1B", TINY_LLAMA)
    monkeypatch.setattr(LLMEngine, "_cuda_graphs_apply", lambda self: self._cuda_graphs_fit())

    def cut_off(*args, **kwargs):
        raise _TimeLimit

    monkeypatch.setattr(cuda_check, "decode_only_speed", cut_off)  # the cuBLAS-only engine, after multi-step
    with pytest.raises(_TimeLimit):
        cuda_check.main(SMALL_RUN + ["--skip-gemma", "--skip-hf", "--num-scheduler-steps", "3",
                                     "--json-dir", str(tmp_path)])
    llama = json.loads((tmp_path / "cuda_check_cpu.json").read_text())["models"]["llama_1b"]
    assert llama["greedy"] and not llama["errors"]
    speed = llama["speed"]
    assert speed["kvserve_share_of_bound"] > 0 and speed["multi_step_share_of_bound"] > 0
    assert "kvserve_cublas" not in speed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_without_cuda_it_says_so(cuda_check, tiny_gemma, capsys):
    assert cuda_check.main(["--device", "cuda", "--model", str(tiny_gemma)]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_bad_reference_file_is_named(cuda_check, tiny_gemma, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"other": []}')
    rc = cuda_check.main(SMALL_RUN + ["--model", str(tiny_gemma), "--reference", str(bad), "--skip-synthetic",
                                      "--skip-speed"])
    assert rc == 2
    assert str(bad) in capsys.readouterr().err


def test_text_too_short_for_the_prompts_is_named(cuda_check, tiny_gemma, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    rc = cuda_check.main(SMALL_RUN + ["--model", str(tiny_gemma), "--text", str(short), "--prompts", "2",
                                      "--skip-speed", "--skip-synthetic"])
    assert rc == 2
    err = capsys.readouterr().err
    assert str(short) in err and "--prompts x --prompt-tokens = 24" in err


def test_prompt_count_must_be_positive(cuda_check, capsys):
    with pytest.raises(SystemExit):
        cuda_check.main(["--device", "cpu", "--prompts", "0"])
    assert "--prompts" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--bandwidth-gib", "--kv-cache-gib", "--offline-requests"])
def test_sizes_must_be_positive(cuda_check, flag, capsys):
    with pytest.raises(SystemExit):
        cuda_check.main(["--device", "cpu", flag, "0"])
    assert flag in capsys.readouterr().err


def test_scheduler_steps_are_bounded(cuda_check, capsys):
    with pytest.raises(SystemExit):
        cuda_check.main(["--device", "cpu", "--num-scheduler-steps", "1000"])
    assert "--num-scheduler-steps must be at most 32" in capsys.readouterr().err
