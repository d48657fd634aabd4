"""Models by name from the Hugging Face cache: `ORG/NAME` loads the cached snapshot as its folder
loads, `ORG/NAME:QUANT` picks the repository's .gguf file holding QUANT, a local path wins over a
name, an absent name says where it looked, and nothing is downloaded without --allow-download.
The cache is a folder built here in huggingface_hub's layout; nothing is ever downloaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.loading import ModelLoadError
from kvserve.loading.hub import HF_FOLDER_FILES
from kvserve.loading.loader import resolve_model_path
from tests.server_harness import free_socket, wait_healthy
from tests.tiny_models import make_model

TINY = "tiny-org/tiny-llama"
GGUF_REPO = "ggml-org/gemma-3-270m-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def snapshot_folder(cache: Path, repo_id: str) -> Path:
    """An empty snapshot of `repo_id` at COMMIT, refs/main pointing at it (huggingface_hub's layout)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, gemma_path):
    """A cache holding a tiny HF model and a GGUF repository: the bundled Q4_K_M file (linked, as
    the hub links blobs), a Q8_0 decoy that is no GGUF, and a vision projector."""
    cache = tmp_path_factory.mktemp("hf_cache") / "hub"
    make_model("llama", snapshot_folder(cache, TINY))
    gguf = snapshot_folder(cache, GGUF_REPO)
    (gguf / "gemma-3-270m-Q4_K_M.gguf").symlink_to(gemma_path)
    (gguf / "gemma-3-270m-Q8_0.gguf").write_bytes(b"not a gguf")
    (gguf / "mmproj-gemma-3-270m-Q4_K_M.gguf").write_bytes(b"not a model")
    return cache


@pytest.fixture
def in_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def _tiny_snapshot(cache: Path) -> Path:
    return cache / f"models--{TINY.replace('/', '--')}" / "snapshots" / COMMIT


def test_a_name_loads_as_its_cached_folder(in_cache):
    by_name = LLM(TINY, kv_cache_gib=0.01)
    by_path = LLM(str(_tiny_snapshot(in_cache)), kv_cache_gib=0.01)
    assert by_name.engine.loaded.source == _tiny_snapshot(in_cache)
    prompts = ["The quick brown fox", "def f(x):"]
    assert ([o.token_ids for o in by_name.generate(prompts, GREEDY)]
            == [o.token_ids for o in by_path.generate(prompts, GREEDY)])


def test_hf_home_locates_the_cache_too(hub_cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))  # the cache is $HF_HOME/hub
    assert resolve_model_path(TINY) == _tiny_snapshot(hub_cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match=str(tmp_path / "hub" / "models--tiny-org--tiny-llama")):
        resolve_model_path(TINY)


def test_generate_by_name_prints_what_the_folder_prints(in_cache, capsys):
    argv = ["generate", "The quick brown fox", "--max-tokens", "6", "--quiet-metrics", "--kv-cache-gib", "0.01"]
    assert main([*argv, "--model", str(_tiny_snapshot(in_cache))]) == 0
    by_path = capsys.readouterr().out
    assert main([*argv, "--model", TINY]) == 0
    assert capsys.readouterr().out == by_path


@pytest.mark.slow
def test_the_quant_tag_picks_the_gguf_file(in_cache, gemma_path, gemma_llm):
    folder = in_cache / f"models--{GGUF_REPO.replace('/', '--')}" / "snapshots" / COMMIT
    for tag in ("Q4_K_M", "q4_k_m"):  # case-insensitive, as llama-server's -hf
        assert resolve_model_path(f"{GGUF_REPO}:{tag}") == folder / "gemma-3-270m-Q4_K_M.gguf"
    assert resolve_model_path(f"{GGUF_REPO}:Q8_0") == folder / "gemma-3-270m-Q8_0.gguf"
    # Serving it on its own blocks: the name satisfies weights="gguf", and the engine reads the bundled file.
    llm = LLM(f"{GGUF_REPO}:Q4_K_M", weights="gguf", gguf_activations="float", kv_cache_gib=0.05)
    assert llm.engine.loaded.source.resolve() == gemma_path.resolve()
    prompt = "The capital of France is"
    assert llm.generate(prompt, GREEDY)[0].token_ids == gemma_llm.generate(prompt, GREEDY)[0].token_ids


@pytest.mark.parametrize("name,message", [
    (f"{GGUF_REPO}:Q5_K_M", "no .gguf file in .* holds 'Q5_K_M' in its name; the .gguf files there: "
                            "gemma-3-270m-Q4_K_M.gguf, gemma-3-270m-Q8_0.gguf; .*--allow-download"),
    (f"{GGUF_REPO}:q", "2 .gguf files in .* hold 'q': gemma-3-270m-Q4_K_M.gguf, gemma-3-270m-Q8_0.gguf"),
    (GGUF_REPO, "holds no config.json .* gemma-3-270m-Q4_K_M.gguf, gemma-3-270m-Q8_0.gguf.* ggml-org/gemma-3-270m-GGUF:Q4_K_M"),
    ("nobody/nothing", "not in the Hugging Face cache: looked for .*models--nobody--nothing .*--allow-download"),
    ("nobody/nothing:Q4_K_M", "looked for .*models--nobody--nothing"),
])
def test_names_that_resolve_to_nothing_say_why(in_cache, name, message):
    with pytest.raises(ModelLoadError, match=message) as e:
        resolve_model_path(name)
    assert str(e.value).startswith(name + ":")


def test_an_absent_name_exits_2_naming_the_cache(in_cache, capsys):
    assert main(["generate", "hi", "--model", "nobody/nothing"]) == 2
    err = capsys.readouterr().err
    assert str(in_cache / "models--nobody--nothing") in err and "--allow-download" in err
    assert main(["generate", "hi", "--model", "no_such_model.gguf"]) == 2  # not a name: a path, as before
    assert "no_such_model.gguf: no such file or folder" in capsys.readouterr().err


def test_a_local_path_wins_over_a_name(in_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / TINY).mkdir(parents=True)
    assert resolve_model_path(TINY) == Path(TINY)


def test_allow_download_asks_huggingface_hub_for_what_the_name_needs(in_cache, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(_tiny_snapshot(in_cache))

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    captured = {}
    monkeypatch.setattr("kvserve.server.launch.serve", lambda config, opts: captured.update(config=config) or 0)
    assert main(["serve", "tiny-org/elsewhere", "--allow-download", "--kv-cache-gib", "0.01"]) == 0
    llm = LLM(captured["config"].model, allow_download=captured["config"].allow_download, kv_cache_gib=0.01)
    assert llm.engine.loaded.source == _tiny_snapshot(in_cache)
    assert calls[0] == ("tiny-org/elsewhere", {"cache_dir": in_cache, "allow_patterns": HF_FOLDER_FILES,
                                               "local_files_only": False})
    resolve_model_path("tiny-org/elsewhere")
    assert calls[-1][1]["local_files_only"] is True  # no flag, no download
    with pytest.raises(ModelLoadError, match="no .gguf file"):  # the fake snapshot holds no GGUF
        resolve_model_path("tiny-org/elsewhere:Q4_K_M", allow_download=True)
    # Only the file of the asked quantization is fetched from a GGUF repository.
    assert calls[-1][1] == {"cache_dir": in_cache, "allow_patterns": ["*[qQ]4_[kK]_[mM]*.gguf"],
                            "local_files_only": False}


@pytest.mark.slow
def test_serve_by_name(in_cache):
    """`kvserve serve ORG/NAME` as a process: the name is the served model, the replies are the folder's."""
    expected = LLM(str(_tiny_snapshot(in_cache)), kv_cache_gib=0.01).generate("The quick brown fox", GREEDY)[0].text
    with free_socket() as sock:
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[1]  # this checkout's kvserve, as the tests import it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", TINY, "--port", str(port),
                             "--kv-cache-gib", "0.01"], env=env, cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 120)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [TINY]
        r = httpx.post(url + "/v1/completions", json={"model": TINY, "prompt": "The quick brown fox", "max_tokens": 6,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    finally:
        proc.terminate()
        proc.wait(timeout=60)
