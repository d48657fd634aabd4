"""The hostile-client suite against `kvserve serve` (the bundled Gemma 3 270M) of two revisions,
one after the other: 5xx answers, the server's RSS, /health and the latency of normal traffic
while the attacks run.

    cd benchmarks && ../.venv/bin/python hostile_before_after.py --before-rev REV --json-dir results

The older revision runs from a `git worktree` of REV, the newer from this checkout; the client
(kvserve.tools.bench.hostile) is this checkout's for both. The 64 prompts x n 128 request is left out
(`amplify=False`): a server without a cap on sequences per request would answer it with ~9 GB of
logits for Gemma's 262k vocabulary, more than this benchmark should ask of the machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, save_json  # noqa: E402

from kvserve.tools.bench.hostile import run_attack  # noqa: E402


def start_server(tree: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from kvserve.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", str(port), "--kv-cache-gib", "0.5"],
                            cwd=tree, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server of {tree} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server of {tree} did not become healthy")


def measure(tree: Path, port: int, label: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(tree, port, Path(tmp) / "server.log")
        try:
            report = run_attack(f"http://127.0.0.1:{port}", proc.pid, amplify=False)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    row = {"revision": label, **dataclasses.asdict(report)}
    print(f"{label}: {report.statuses}, {len(report.server_errors)} without an answer or 5xx; RSS "
          f"{report.rss_before_mb:.0f} -> peak {report.rss_peak_mb:.0f} MB; /health max {report.health_max_s:.3f} s "
          f"({report.health_failures} failed); normal p50 {report.normal_p50_s:.3f} s, p99 {report.normal_p99_s:.3f} s, "
          f"max {report.normal_max_s:.3f} s ({report.normal_requests} requests); {report.seconds:.0f} s", flush=True)
    for e in report.server_errors[:10]:
        print(f"    {e}")
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before-rev", required=True, help="the older revision (a commit of this repository)")
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{args.before_rev}^{{commit}}"],
                      capture_output=True).returncode != 0:
        print(f"--before-rev {args.before_rev}: not a commit of {ROOT}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.before_rev],
                       check=True, capture_output=True)
        try:
            rows.append(measure(old, args.port, f"before ({args.before_rev})"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
    rows.append(measure(ROOT, args.port + 1, "this checkout"))
    save_json("hostile_before_after", {"machine": machine(), "rows": rows}, args.json_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
