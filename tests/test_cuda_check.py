"""benchmarks/cuda_check.py, the prepared GPU check: its verdicts and its CPU dry run (the GPU run
itself needs a lent machine)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.loading import load_model
from tests.tiny_models import make_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cuda_check():
    spec = importlib.util.spec_from_file_location("cuda_check", ROOT / "benchmarks" / "cuda_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("cuda_check", None)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    """A random Gemma 3 (sliding and full layers) long enough for the speed workload's prompts."""
    folder = tmp_path_factory.mktemp("gemma3")
    make_model("gemma3", folder, max_position_embeddings=1024)
    return folder


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def test_compare_verdicts_against_teacher_forced_logprobs(cuda_check, tiny_gemma):
    llm = LLM(loaded=load_model(tiny_gemma), enable_prefix_caching=False, kv_cache_gib=0.05)
    prompt = [2, 40, 41, 42, 43]
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    assert cuda_check.compare(llm, prompt, ref, list(ref), 0.01).verdict == "equal"
    # Part at token 3 with the reference's runner-up there: the margin is their log-prob gap.
    top = llm.generate(prompt + ref[:3], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    ranked = sorted(top.outputs[0].top_logprobs[0].items(), key=lambda kv: -kv[1])
    assert ranked[0][0] == ref[3]
    other, gap = ranked[1][0], ranked[0][1] - ranked[1][1]
    got = ref[:3] + [other, ref[4], ref[5]]
    c = cuda_check.compare(llm, prompt, ref, got, tie_margin=gap * 2)
    assert (c.equal_tokens, c.verdict) == (3, "near-tie") and c.margin == pytest.approx(gap, abs=1e-6)
    assert cuda_check.compare(llm, prompt, ref, got, tie_margin=gap / 2).verdict == "mismatch"
    assert cuda_check.compare(llm, prompt, ref, ref[:4], 1e9).verdict == "mismatch"  # shorter: not rounding


def test_cpu_dry_run_writes_its_report(cuda_check, tiny_gemma, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys in blocks. " * 40)
    rc = cuda_check.main(["--device", "cpu", "--model", str(tiny_gemma), "--text", str(text), "--prompts", "3",
                          "--prompt-tokens", "12", "--max-tokens", "8", "--repeats", "1", "--offline-requests", "3",
                          "--kv-cache-gib", "0.05", "--json-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "cuda_check_cpu.json").read_text())
    assert data["ok"] and len(data["single"]) == len(data["batched"]) == 3
    assert all(c["verdict"] == "equal" and c["equal_tokens"] == 8 for c in data["single"] + data["batched"])
    assert data["speed"]["decode_batch1_tok_s"] > 0 and data["speed"]["offline_output_tok_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_without_cuda_it_says_so(cuda_check, capsys):
    assert cuda_check.main(["--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_missing_text_file_is_named(cuda_check, tmp_path, capsys):
    assert cuda_check.main(["--device", "cpu", "--text", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt" in capsys.readouterr().err


def test_text_too_short_for_the_prompts_is_named(cuda_check, tiny_gemma, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("Too short.")
    rc = cuda_check.main(["--device", "cpu", "--model", str(tiny_gemma), "--text", str(text), "--prompts", "2",
                          "--prompt-tokens", "12", "--skip-speed", "--kv-cache-gib", "0.05"])
    assert rc == 2
    err = capsys.readouterr().err
    assert str(text) in err and "--prompts x --prompt-tokens = 24" in err


def test_prompt_count_must_be_positive(cuda_check, capsys):
    with pytest.raises(SystemExit):
        cuda_check.main(["--device", "cpu", "--prompts", "0"])
    assert "--prompts" in capsys.readouterr().err
