"""`kvserve bench hostile`: hostile clients against a running server, and what it costs the
others.

While the attacks run, a watcher samples the server process's RSS from /proc, asks /health
every 100 ms and sends normal traffic (a short greedy completion at a time), timing each. The
attacks (bounded in count and time, for a server on this machine):

- oversized and amplifying requests: n x prompts, 100,000 stop strings, 19,000 stop ids,
  12,000 invalid elements, a batch past the queue;
- validation edges and unicode (control characters, emoji, bidi overrides, zero-width spaces),
  template injection in a chat message, unknown and unsupported fields;
- raw HTTP framing: bad and conflicting Content-Length, Content-Length with chunked encoding,
  5 MB chunked, a 200 KB header, three pipelined requests, garbage and a TLS hello;
- 64 parallel streams of which about a third hang up mid-stream, a stream whose client stops
  reading, and a client sending its headers a byte at a time.

The test suite runs it against a live server (tests/test_hostile_clients.py); `--url` runs it
against any OpenAI-compatible server (`--pid` its process, for the RSS).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvserve.tools.bench.serve import percentile

C, CHAT = "/v1/completions", "/v1/chat/completions"


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


class Watcher:
    """Samples the server's RSS and /health latency, and sends normal traffic (a short greedy
    completion at a time) measuring its latency, in threads until stopped."""

    def __init__(self, url: str, pid: int | str = "self", model: str | None = None):
        self.url = url
        self.pid = pid
        self.model = model
        self.normal: list[float] = []  # seconds per normal request
        self.normal_status: list[int] = []
        self.rss: list[float] = []
        self.health: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True),
                         threading.Thread(target=self._traffic, daemon=True)]

    def _traffic(self) -> None:
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        if self.model is not None:
            body["model"] = self.model
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    status = http.post(C, json=body).status_code
                except httpx.HTTPError:
                    status = 0
                self.normal.append(time.monotonic() - t)
                self.normal_status.append(status)
                self._stop.wait(0.05)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while not self._stop.is_set():
                self.rss.append(rss_mb(self.pid))
                t = time.monotonic()
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.health.append((status, time.monotonic() - t))
                self._stop.wait(0.1)

    def __enter__(self) -> "Watcher":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)


def _body(**kw) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, **kw}


def _chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def json_attacks(amplify: bool = True) -> list[tuple[str, dict]]:
    """(path, body): amplification, validation edges, unicode. Each must be a 2xx or a 4xx.
    `amplify` False leaves out 64 prompts x n 128, which a server without a cap on sequences
    per request answers with ~9 GB of logits for a 262k vocabulary."""
    cases = [(C, _body(prompt=["a"] * 64, n=128, max_tokens=1))] if amplify else []  # 8192 sequences
    cases += [
        (C, _body(stop=["x"] * 100_000)),  # a 600 KB list of stop strings
        (C, _body(stop=[0] * 12_000)),  # 12,000 invalid elements
        (C, _body(prompt=["a"] * 512, stop_token_ids=list(range(19_000)))),
        (C, _body(prompt=["a"] * 1025, max_tokens=1)),  # a batch past the queue
        (C, _body(n=129)), (C, _body(n=-1)), (C, _body(n=1.5)), (C, _body(n="2")),
        (C, _body(max_tokens=10**18)), (C, _body(max_tokens=-5)), (C, _body(max_tokens=None)),
        (C, _body(temperature=1e308)), (C, _body(temperature=-1e-9)), (C, _body(top_p=float("1e-400"))),
        (C, _body(top_k=-7)), (C, _body(top_k=10**12)), (C, _body(min_p=2)), (C, _body(seed=2**70)),
        (C, _body(logprobs=10**6)), (C, _body(logprobs=-1)), (C, _body(presence_penalty=1e30)),
        (C, _body(repetition_penalty=0)), (C, _body(min_tokens=10**9)), (C, _body(stop="")),
        (C, _body(stop=[""])), (C, _body(stop={"a": 1})), (C, _body(stop_token_ids=[-1])),
        (C, _body(stop_token_ids=[2**63])), (C, _body(prompt=[10**9])), (C, _body(prompt=[-1])),
        (C, _body(prompt=[[]])), (C, _body(prompt=[[1.5]])), (C, _body(prompt=None)), (C, _body(prompt={})),
        (C, _body(prompt="\u0000\u0001\u0002")), (C, _body(prompt="🦙" * 2000)), (C, _body(prompt="\u202e" * 100)),
        (C, _body(prompt="a\u200b" * 500)), (C, _body(prompt="x" * 200_000)),  # past the context
        (C, _body(model="other-model")), (C, _body(model=["a"])), (C, _body(stream="yes")),
        (C, _body(stream=True, stream_options={"include_usage": "no"})), (C, _body(stream_options={})),
        (C, _body(echo=True)), (C, _body(best_of=3)), (C, _body(suffix="x")), (C, _body(logit_bias={"1": 5})),
        (C, _body(user="u" * 10_000)), (C, _body(cache_salt="s" * 1000)), (C, _body(unknown_field=1)),
        (CHAT, _chat(messages=[])), (CHAT, _chat(messages=[{"role": "wizard", "content": "x"}])),
        (CHAT, _chat(messages=[{"role": "user"}])), (CHAT, _chat(messages=[{"role": "user", "content": None}])),
        (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])),
        (CHAT, _chat(messages=[{"role": "user", "content": "{{ 7*7 }}{% for x in range(10**9) %}{% endfor %}"}])),
        (CHAT, _chat(messages=[{"role": "user", "content": "hi"}] * 5000)),
        (CHAT, _chat(n=64)), (CHAT, _chat(top_logprobs=100, logprobs=True)), (CHAT, _chat(logprobs="yes")),
        (CHAT, _chat(response_format={"type": "json_schema"})), (CHAT, _chat(tools=[{"type": "function"}])),
        (CHAT, _chat(max_completion_tokens=0)), (CHAT, _chat(stop=["y" * 300])),
    ]
    return cases


def raw_attacks(host: str, port: int) -> list[bytes]:
    """Raw HTTP requests: framing the parser must refuse, or requests it must answer once each."""
    ok = json.dumps(_body()).encode()
    head = f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
    return [
        head + b"Content-Length: abc\r\n\r\n" + ok,
        head + b"Content-Length: -5\r\n\r\n" + ok,
        head + b"Content-Length: 5\r\nContent-Length: 50\r\n\r\n" + ok,
        head + f"Content-Length: {len(ok)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode() + ok,
        head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
                                                              for _ in range(80)) + b"0\r\n\r\n",
        head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n",
        head + b"X-Big: " + b"a" * 200_000 + b"\r\nContent-Length: 2\r\n\r\n{}",
        b"".join(head + f"Content-Length: {len(ok)}\r\n\r\n".encode() + ok for _ in range(3)),  # pipelined
        b"GARBAGE / HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS hello
        b"GET /health HTTP/1.0\r\n\r\n",
        f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{{}}".encode(),
    ]


def _send_raw(host: str, port: int, data: bytes, timeout: float = 10) -> list[int]:
    """Send `data`, read until the server closes or goes quiet; the status codes it answered."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server may close on us mid-send (an oversized body)
        chunks = []
        s.settimeout(2)
        while True:
            try:
                b = s.recv(65536)
            except (TimeoutError, OSError):
                break
            if not b:
                break
            chunks.append(b)
    text = b"".join(chunks)
    return [int(line.split()[1]) for line in text.split(b"\r\n") if line.startswith(b"HTTP/1.")]


async def _streams(url: str, n: int, seed: int) -> list[int]:
    """n concurrent streams; about a third hang up after a few chunks. Their status codes."""
    rng = random.Random(seed)

    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = _body(prompt=f"story {i}", max_tokens=40, ignore_eos=True, stream=True)
        async with http.stream("POST", C, json=body) as resp:
            leave_after = rng.randint(1, 10) if rng.random() < 0.35 else None
            got = 0
            async for line in resp.aiter_lines():
                got += line.startswith("data:")
                if leave_after is not None and got >= leave_after:
                    break  # the client goes away mid-stream
            return resp.status_code

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=n)) as http:
        return list(await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(n))), 120))


def _stalled_stream(host: str, port: int, seconds: float) -> None:
    """A stream whose client reads nothing after its request, then leaves."""
    body = json.dumps(_body(max_tokens=200, ignore_eos=True, stream=True)).encode()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(seconds)


def _slow_headers(host: str, port: int, seconds: float) -> None:
    """Slowloris: a header a byte at a time."""
    with socket.create_connection((host, port), timeout=10) as s:
        deadline = time.monotonic() + seconds
        for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if time.monotonic() > deadline:
                break
            try:
                s.sendall(bytes([b]))
            except OSError:
                return  # cut off
            time.sleep(0.05)


@dataclass
class HostileReport:
    statuses: dict[str, int] = field(default_factory=dict)  # status code -> answers
    server_errors: list[str] = field(default_factory=list)  # what got a 5xx
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    health_max_s: float = 0.0
    health_failures: int = 0
    health_probes: int = 0
    normal_p50_s: float = 0.0
    normal_p99_s: float = 0.0
    normal_max_s: float = 0.0
    normal_requests: int = 0
    normal_failures: int = 0
    seconds: float = 0.0


def run_attack(url: str, pid: int | str = "self", amplify: bool = True, seed: int = 0,
               model: str | None = None) -> HostileReport:
    """Every attack once, with the watcher running; the report of what the server answered and
    what it cost."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    report = HostileReport(rss_before_mb=rss_mb(pid))
    answers: list[tuple[str, int]] = []
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=120) as http, Watcher(url, pid, model) as watch:
        background = [threading.Thread(target=_stalled_stream, args=(host, port, 3.0)),
                      threading.Thread(target=_slow_headers, args=(host, port, 3.0))]
        for t in background:
            t.start()
        for path, body in json_attacks(amplify):
            try:
                status = http.post(path, json=body).status_code
            except httpx.HTTPError:
                status = 0  # no answer: counted, and a failure below
            answers.append((f"{path} {str(body)[:80]}", status))
        for data in raw_attacks(host, port):
            answers += [(f"raw {data[:60]!r}", s) for s in _send_raw(host, port, data)]
        answers += [("stream", s) for s in asyncio.run(_streams(url, 64, seed))]
        for t in background:
            t.join(timeout=30)
    report.seconds = time.monotonic() - t0
    for what, s in answers:
        report.statuses[str(s)] = report.statuses.get(str(s), 0) + 1
        if s >= 500 or s == 0:
            report.server_errors.append(f"{s}: {what}")
    report.rss_peak_mb = max(watch.rss, default=report.rss_before_mb)
    report.health_probes = len(watch.health)
    report.health_max_s = max((t for _, t in watch.health), default=0.0)
    report.health_failures = sum(s != 200 for s, _ in watch.health)
    report.normal_requests = len(watch.normal)
    report.normal_failures = sum(s != 200 for s in watch.normal_status)
    report.normal_p50_s = percentile(watch.normal, 50) or 0.0
    report.normal_p99_s = percentile(watch.normal, 99) or 0.0
    report.normal_max_s = max(watch.normal, default=0.0)
    return report


def main(args: argparse.Namespace) -> int:
    if not Path(f"/proc/{args.pid}/status").is_file():
        raise ValueError(f"--pid {args.pid}: no such process on this machine (its RSS is read from /proc)")
    r = run_attack(args.url, args.pid, amplify=not args.no_amplify, seed=args.seed)
    print(f"{sum(r.statuses.values())} answers {r.statuses} in {r.seconds:.1f} s; server errors: {len(r.server_errors)}")
    for e in r.server_errors[:20]:
        print(f"  {e}")
    print(f"RSS {r.rss_before_mb:.0f} MB before, peak {r.rss_peak_mb:.0f} MB; /health max {r.health_max_s:.3f} s, "
          f"{r.health_failures} of {r.health_probes} failed; normal traffic p50 {r.normal_p50_s:.3f} s, "
          f"p99 {r.normal_p99_s:.3f} s, max {r.normal_max_s:.3f} s ({r.normal_requests} requests, "
          f"{r.normal_failures} failed)")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(r), indent=1))
    return 1 if r.server_errors or r.health_failures else 0
