"""`kvserve serve` as a real process: SIGTERM drains (the in-flight stream completes, newcomers
get 503) and the process exits 0; bad flags exit 2 with a message before loading anything."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve.cli import main
from kvserve.server.launch import resolve_api_key
from tests.server_harness import free_socket, wait_healthy

pytestmark = pytest.mark.slow


def _kvserve() -> str:
    return shutil.which("kvserve") or str(Path(sys.executable).with_name("kvserve"))


def test_sigterm_lets_the_in_flight_stream_finish_and_exits_0():
    with free_socket() as sock:
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([_kvserve(), "serve", "--port", str(port), "--kv-cache-gib", "0.1",
                             "--max-model-len", "1024", "--served-model-name", "g", "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(url, proc)
        body = {"model": "g", "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=url, timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            refused = None
            for _ in range(50):  # the signal is handled on the server's next loop turn
                refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
                if refused.status_code == 503:
                    break
                time.sleep(0.05)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 40
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv,message", [
    (["serve", "--max-queue", "-1"], "--max-queue"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--shutdown-timeout", "-5"], "--shutdown-timeout"),
    (["serve", "a.gguf", "--model", "b.gguf"], "two models"),
    (["serve", "--api-key", ""], "--api-key"),
    (["serve", "--api-key-file", "/nonexistent/kvserve-key"], "--api-key-file /nonexistent/kvserve-key"),
    (["serve", "--api-key", "k", "--api-key-file", "f"], "not both"),
    (["serve", "--max-n", "129"], "--max-n"),
    (["serve", "--protect-metrics"], "--protect-metrics needs an API key"),
    (["serve", "--allowed-hosts", "localhost,"], "--allowed-hosts"),
    (["serve", "--max-connections", "0"], "--max-connections"),
])
def test_bad_serve_flags_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and message in err


def test_api_key_sources(tmp_path):
    """--api-key-file (first line) or $KVSERVE_API_KEY keep the key out of `ps`; the flag still works."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\nignored\n")
    assert resolve_api_key(None, str(key_file), env={}) == "s3cret"
    assert resolve_api_key(None, None, env={"KVSERVE_API_KEY": " from-env "}) == "from-env"
    assert resolve_api_key("flag", None, env={"KVSERVE_API_KEY": "from-env"}) == "flag"
    assert resolve_api_key(None, None, env={}) is None
    (tmp_path / "empty").write_text("\n")
    for args, message in [((None, str(tmp_path / "empty")), "first line is empty"),
                          ((None, None), "KVSERVE_API_KEY is set but empty")]:
        with pytest.raises(ValueError, match=message):
            resolve_api_key(*args, env={"KVSERVE_API_KEY": "  "})
