"""`kvserve generate`: streams the same text as the API, prints metrics, rejects bad flags."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from kvserve import SamplingParams
from kvserve.cli import main


def test_generate_streams_greedy_text_and_metrics(gemma_llm, capsys):
    prompt = "The capital of France is"
    expected = gemma_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].text
    assert main(["generate", prompt, "--max-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n"
    for word in ("TTFT", "TPOT", "tok/s", "12 output tokens"):
        assert word in err


def test_generate_no_kv_cache_same_text(gemma_llm, capsys):
    prompt = "Water boils at"
    expected = gemma_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].text
    assert main(["generate", prompt, "--max-tokens", "6", "--no-kv-cache", "--quiet-metrics"]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--dtype", "int3"], "dtype"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "/no/such/model.gguf"),
    (["generate", "", "--max-tokens", "2"], "prompt is empty"),
])
def test_bad_arguments_exit_2_with_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and message in err
    assert "Traceback" not in err


def test_console_script_entry_point():
    exe = shutil.which("kvserve") or str(__import__("pathlib").Path(sys.executable).with_name("kvserve"))
    r = subprocess.run([exe, "generate", "hi", "--min-p", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "min_p" in r.stderr


def test_a_missing_optional_extra_names_it(monkeypatch, capsys):
    """httpx comes with kvserve[bench]: without it `kvserve bench serve` says what to install."""
    monkeypatch.setitem(sys.modules, "httpx", None)  # importing it now raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "kvserve.tools.bench.serve", raising=False)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "pip install 'kvserve[bench]'" in capsys.readouterr().err
