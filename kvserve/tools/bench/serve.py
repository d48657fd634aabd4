"""`kvserve bench serve`: online serving benchmark against an OpenAI-compatible server.

`bench throughput` says how fast the engine drains a full queue; a server's users instead see
latency under a request *rate*. This client sends N streamed requests with Poisson arrivals
(exponential gaps, mean 1/R, seeded) to `/v1/completions` or `/v1/chat/completions`, optionally
bounded by a concurrency semaphore, and measures per request TTFT, inter-chunk latency (ITL),
TPOT and end-to-end latency, plus achieved request/token throughput and goodput under SLOs.
Several rates make a sweep: one latency-vs-throughput point each.

`--workload shared-prefix` sends K system prompts of L words, each request one of them plus a
unique suffix (a multi-turn conversation's later turns repeat its earlier turns too), and reports
the prefix hit rate from the server's `usage.prompt_tokens_details.cached_tokens`: the workload
where a replica router that knows prefixes beats round-robin.

The client has no tokenizer, so prompt lengths are in *words*, and the output length is fixed
by sending `max_tokens` with `ignore_eos: true`; token counts come from the server's usage chunk
(`stream_options.include_usage`) and fall back to counting content chunks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import httpx
from tqdm import tqdm

from kvserve.paths import WIKITEXT2_TEST, wikitext2_file

SLO_KEYS = ("ttft", "tpot", "e2e")
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# Common English words: each is one token (or close to it) in the usual BPE/SentencePiece
# vocabularies, so a prompt of W random words is roughly W tokens without a tokenizer here.
_WORDS = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there one all we their been has will more would when who its if no
so what up out about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three house water city music river green small light night story place
""".split())


# --------------------------------------------------------------------------- workload


@dataclass
class BenchRequest:
    """One prompt to send; `output_len` becomes max_tokens (with ignore_eos)."""

    prompt: str
    input_words: int
    output_len: int


def random_requests(n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Prompts of `input_len` random common words: distinct from the first word on, so the
    server's prefix cache cannot shortcut prefill between requests."""
    rng = random.Random(seed)
    return [BenchRequest(" ".join(rng.choice(_WORDS) for _ in range(input_len)), input_len, output_len)
            for _ in range(n)]


@dataclass(frozen=True)
class SharedPrefixSpec:
    """K system prompts of `prefix_len` words; each conversation picks one at random and adds
    `suffix_len` new words per turn (turn t repeats the conversation's earlier turns). Replies
    are not fed back, so the prompts do not depend on the server and a run is reproducible."""

    num_prefixes: int = 8
    prefix_len: int = 512
    suffix_len: int = 32
    turns: int = 1

    def __post_init__(self) -> None:
        for name in ("num_prefixes", "prefix_len", "suffix_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")


def shared_prefix_requests(n: int, spec: SharedPrefixSpec, output_len: int, seed: int) -> list[BenchRequest]:
    """`n` requests: ceil(n / turns) conversations, first turns (in random order) before second
    turns, and so on, so that a prefix's requests interleave with the others'."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    prefixes = [words(spec.prefix_len) for _ in range(spec.num_prefixes)]
    num_convs = -(-n // spec.turns)
    convs = [(prefixes[rng.randrange(spec.num_prefixes)], [words(spec.suffix_len) for _ in range(spec.turns)])
             for _ in range(num_convs)]
    out: list[BenchRequest] = []
    for t in range(spec.turns):
        for c in rng.sample(range(num_convs), num_convs):
            prefix, turns = convs[c]
            out.append(BenchRequest(" ".join([prefix, *turns[:t + 1]]), spec.prefix_len + (t + 1) * spec.suffix_len,
                                    output_len))
    return out[:n]


def load_wikitext_words(path: Path) -> list[str]:
    """All words of a WikiText file, without blank lines and ` = Heading = ` lines (titles make
    poor prompt text and would repeat across passages)."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if s and not (s.startswith("=") and s.endswith("=")):
            words.extend(s.split())
    return words


def wikitext_requests(path: Path, n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Passages of exactly `input_len` consecutive words starting at seeded random offsets."""
    words = load_wikitext_words(path)
    if len(words) < input_len:
        raise ValueError(f"--dataset-path {path}: only {len(words)} words, fewer than --input-len {input_len}")
    rng = random.Random(seed)
    starts = [rng.randrange(len(words) - input_len + 1) for _ in range(n)]
    return [BenchRequest(" ".join(words[s:s + input_len]), input_len, output_len) for s in starts]


def default_wikitext_path() -> Path:
    """WikiText-2's raw test split under $KVSERVE_DATA (kvserve/paths.py)."""
    return wikitext2_file(WIKITEXT2_TEST, "--dataset-path")


def _wikitext_file(path: Path) -> Path:
    """Accept the WikiText-2 folder as well as the file."""
    f = path / WIKITEXT2_TEST if path.is_dir() else path
    if not f.is_file():
        raise ValueError(f"--dataset-path: {f} is not a file")
    return f


def build_requests(dataset: str, n: int, input_len: int, output_len: int, seed: int,
                   dataset_path: str | None = None) -> list[BenchRequest]:
    if dataset == "random":
        return random_requests(n, input_len, output_len, seed)
    if dataset == "wikitext2":
        path = _wikitext_file(Path(dataset_path)) if dataset_path else default_wikitext_path()
        return wikitext_requests(path, n, input_len, output_len, seed)
    raise ValueError(f"--dataset: unknown dataset {dataset!r} (random or wikitext2)")


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Planned send times (seconds after the start) of a Poisson process of `rate` req/s: the
    first request at 0, then exponential gaps of mean 1/rate. rate=inf sends everything at once.
    Absolute offsets (not sleeps between sends) keep the schedule from drifting."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


# --------------------------------------------------------------------------- flags


def parse_rates(text: str) -> list[float]:
    """`--request-rate 1,2,inf` -> [1.0, 2.0, inf]; every rate must be > 0."""
    rates = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"--request-rate: expected a number or inf, got {part!r}") from None
        if math.isnan(r) or r <= 0:
            raise ValueError(f"--request-rate: each rate must be > 0 (or inf), got {part!r}")
        rates.append(r)
    if not rates:
        raise ValueError(f"--request-rate: no rate given in {text!r}")
    return rates


@dataclass
class SLO:
    """Service-level objectives in milliseconds; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, r: RequestResult) -> bool:
        """A request is good when it succeeded and meets every given objective. A one-token output
        has no TPOT, so the TPOT objective cannot be missed by it."""
        if not r.success:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        return all(limit is None or value is None or value * 1000 <= limit for limit, value in checks)


def parse_goodput(specs: Sequence[str]) -> SLO:
    """`--goodput ttft:500 tpot:50 e2e:10000` (milliseconds; commas also separate)."""
    slo = SLO()
    items = [s for spec in specs for s in spec.replace(",", " ").split()]
    if not items:
        raise ValueError("--goodput: expected KEY:MS with KEY one of ttft, tpot, e2e")
    seen: set[str] = set()
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        if key in seen:
            raise ValueError(f"--goodput: {key} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {key} needs a number of milliseconds, got {value!r}") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput: {key} must be a positive number of milliseconds, got {value!r}")
        seen.add(key)
        setattr(slo, f"{key}_ms", ms)
    return slo


# --------------------------------------------------------------------------- one request


@dataclass
class ServeTarget:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """What one request saw. Times are seconds; `sent_s`/`scheduled_s` are relative to the run's
    start, latencies relative to `sent_s` (time waiting for the concurrency gate is excluded, as a
    client that bounds its own concurrency would not blame the server for it)."""

    index: int
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    success: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    usage_reported: bool = False

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (n_out - 1)."""
        if not self.success or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def build_payload(target: ServeTarget, req: BenchRequest) -> dict:
    """Greedy, fixed output length (ignore_eos is a vLLM extension our server accepts), streamed
    with a final usage chunk so token counts come from the server's tokenizer."""
    body: dict = {"model": target.model, "max_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def chunk_content(chunk: dict, endpoint: str) -> str:
    """The generated text in one streamed chunk ('' for role-only, usage or empty chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if endpoint == "chat":
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


def _error_text(body: str) -> str:
    """The server's message from an OpenAI-style `{"error": {"message": ...}}` or FastAPI's
    `{"detail": ...}` body, else the body itself, shortened."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:300]
        if err is not None:
            return str(err)[:300]
    return body.strip()[:300]


async def _read_stream(resp: httpx.Response, endpoint: str, result: RequestResult, start: float) -> None:
    """Consume the SSE stream, timing each non-empty content chunk."""
    last: float | None = None
    chunks = 0
    usage: dict | None = None
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            result.error = f"stream error: {_error_text(data)}"
            return
        now = time.perf_counter()
        if chunk_content(chunk, endpoint):
            if last is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            chunks += 1
        if chunk.get("usage"):
            usage = chunk["usage"]
    end = time.perf_counter()
    if last is None:
        result.error = "stream ended without any content"
        return
    result.e2e_s = end - start
    result.usage_reported = bool(usage and usage.get("completion_tokens") is not None)
    result.output_tokens = int(usage["completion_tokens"]) if result.usage_reported else chunks
    if usage and usage.get("prompt_tokens") is not None:
        result.prompt_tokens = int(usage["prompt_tokens"])
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])
    result.success = True


async def send_request(client: httpx.AsyncClient, target: ServeTarget, req: BenchRequest,
                       result: RequestResult, t0: float) -> None:
    """One streamed request; every failure lands in `result.error`, never in an exception, so a
    bad request cannot end the run."""
    start = time.perf_counter()
    result.sent_s = start - t0
    try:
        async with client.stream("POST", target.url, json=build_payload(target, req),
                                 headers=target.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {resp.status_code}: {_error_text(body)}"
                return
            await _read_stream(resp, target.endpoint, result, start)
    except Exception as e:  # noqa: BLE001 -- connection resets, bad JSON, timeouts: all count as failures
        result.error = f"{type(e).__name__}: {e}".rstrip(": ")


async def _timed_request(client: httpx.AsyncClient, target: ServeTarget, req: BenchRequest,
                         result: RequestResult, t0: float, gate: asyncio.Semaphore | None) -> RequestResult:
    """The concurrency gate, then the request under a whole-request deadline (httpx's own
    timeout is per read, which a slowly trickling stream never trips)."""
    async def go() -> None:
        try:
            await asyncio.wait_for(send_request(client, target, req, result, t0), target.timeout_s)
        except asyncio.TimeoutError:
            result.success = False
            result.error = f"timed out after {target.timeout_s:g} s (--timeout)"

    if gate is None:
        await go()
    else:
        async with gate:
            await go()
    return result


# --------------------------------------------------------------------------- one run


async def run_requests(target: ServeTarget, requests: Sequence[BenchRequest], rate: float,
                       max_concurrency: int | None = None, seed: int = 0,
                       progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send `requests` on a Poisson schedule of `rate` req/s; returns the per-request results (in
    request order) and the wall time from the first send to the last completion."""
    offsets = arrival_offsets(len(requests), rate, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # httpx's default pool caps at 100 connections: requests beyond it would queue inside the
    # client and inflate TTFT, so the pool is unbounded and only --max-concurrency bounds load.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = _progress_bar(len(requests), rate) if progress else None
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(target.timeout_s)) as client:
        t0 = time.perf_counter()
        tasks = []
        for i, (req, offset) in enumerate(zip(requests, offsets)):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_timed_request(client, target, req, RequestResult(i, offset), t0, gate))
            if bar is not None:
                task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return results, duration


def _progress_bar(n: int, rate: float):
    return tqdm(total=n, desc=f"rate {_rate_label(rate)}", leave=False, file=sys.stderr)


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) by linear interpolation between the closest ranks, i.e. numpy's
    default method, written out so the report's definition is explicit; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Stats:
    """mean / median / p99, in milliseconds; None when there was nothing to measure."""

    mean: float | None
    median: float | None
    p99: float | None


def summarize_ms(values_s: Sequence[float]) -> Stats:
    if not values_s:
        return Stats(None, None, None)
    ms = [v * 1000.0 for v in values_s]
    return Stats(sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 99))


@dataclass
class RunSummary:
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    input_tokens: int
    output_tokens: int
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    slo_ms: dict | None = None
    good_requests: int | None = None
    goodput: float | None = None
    requests_without_usage: int = 0
    cached_tokens: int | None = None  # prompt tokens served from prefix caches (None: not reported)
    prefix_hit_rate: float | None = None  # cached_tokens / input_tokens of the requests reporting both
    errors: list[str] = field(default_factory=list)
    requests: list[RequestResult] = field(default_factory=list)


def error_digest(results: Sequence[RequestResult], limit: int = 5) -> list[str]:
    """The first `limit` distinct error messages, in order of first appearance, with counts."""
    counts = Counter(r.error for r in results if not r.success)
    return [f"{n}x {msg}" for msg, n in list(counts.items())[:limit]]


def summarize_run(results: Sequence[RequestResult], duration_s: float, rate: float,
                  max_concurrency: int | None = None, slo: SLO | None = None) -> RunSummary:
    """Aggregate one run. Token and latency figures cover successful requests only; ITL pools
    every gap of every request (so long outputs weigh more, as they do for users)."""
    ok = [r for r in results if r.success]
    dur = max(duration_s, 1e-9)
    n_in = sum(r.prompt_tokens or 0 for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    s = RunSummary(
        request_rate=rate, max_concurrency=max_concurrency, completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration_s, request_throughput=len(ok) / dur, input_tokens=n_in, output_tokens=n_out,
        input_throughput=n_in / dur, output_throughput=n_out / dur, total_token_throughput=(n_in + n_out) / dur,
        ttft_ms=summarize_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=summarize_ms([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=summarize_ms([g for r in ok for g in r.itl_s]),
        e2e_ms=summarize_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        requests_without_usage=sum(not r.usage_reported for r in ok),
        errors=error_digest(results), requests=list(results),
    )
    reporting = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    if reporting:
        s.cached_tokens = sum(r.cached_tokens for r in reporting)
        s.prefix_hit_rate = s.cached_tokens / sum(r.prompt_tokens for r in reporting)
    if slo is not None:
        s.slo_ms = {k: v for k in SLO_KEYS if (v := getattr(slo, f"{k}_ms")) is not None}
        s.good_requests = sum(slo.met_by(r) for r in results)
        s.goodput = s.good_requests / dur
    return s


# --------------------------------------------------------------------------- report


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _fmt(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _stats_cell(st: Stats) -> str:
    return f"{_fmt(st.mean)} / {_fmt(st.median)} / {_fmt(st.p99)}"


def table_rows(s: RunSummary) -> list[tuple[str, str]]:
    rows = [
        ("completed / failed", f"{s.completed} / {s.failed}"),
        ("duration (s)", f"{s.duration_s:.2f}"),
        ("request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("input tok/s", f"{s.input_throughput:.1f}" if s.input_tokens else "n/a"),
        ("output tok/s", f"{s.output_throughput:.1f}"),
        ("total tok/s", f"{s.total_token_throughput:.1f}"),
        ("TTFT mean / median / p99 (ms)", _stats_cell(s.ttft_ms)),
        ("TPOT mean / median / p99 (ms)", _stats_cell(s.tpot_ms)),
        ("ITL mean / median / p99 (ms)", _stats_cell(s.itl_ms)),
        ("E2E mean / median / p99 (ms)", _stats_cell(s.e2e_ms)),
    ]
    if s.prefix_hit_rate is not None:
        rows.append(("prefix hit rate (cached / prompt tokens)", f"{s.prefix_hit_rate:.3f}"))
    if s.goodput is not None:
        rows.append(("goodput (req/s)", f"{s.goodput:.2f} ({s.good_requests} of {s.completed + s.failed} met SLOs)"))
    return rows


def print_report(summaries: Sequence[RunSummary], header: str) -> None:
    """One column per rate, metrics as rows (a sweep reads across)."""
    print(f"\n{header}")
    if summaries and summaries[0].slo_ms:
        print("SLOs (ms): " + ", ".join(f"{k} <= {v:g}" for k, v in summaries[0].slo_ms.items()))
    cols = [f"rate={_rate_label(s.request_rate)}" for s in summaries]
    print("| metric | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    per_run = [table_rows(s) for s in summaries]
    for i, (name, _) in enumerate(per_run[0]):
        print(f"| {name} | " + " | ".join(rows[i][1] for rows in per_run) + " |")
    for s in summaries:
        if s.requests_without_usage:
            print(f"rate={_rate_label(s.request_rate)}: {s.requests_without_usage} responses had no usage chunk; "
                  "their output tokens were counted as content chunks and their prompt tokens are unknown")
        if s.errors:
            print(f"rate={_rate_label(s.request_rate)}: {s.failed} failed requests; first errors:")
            for e in s.errors:
                print(f"  {e}")


def summary_to_json(s: RunSummary) -> dict:
    """JSON-safe (inf -> "inf", no NaN) with per-request records, minus the raw ITL lists."""
    d = asdict(s)
    d["request_rate"] = _rate_label(s.request_rate) if math.isinf(s.request_rate) else s.request_rate
    d["requests"] = [{"index": r.index, "success": r.success, "error": r.error or None,
                      "scheduled_s": r.scheduled_s, "sent_s": r.sent_s,
                      "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000,
                      "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1000,
                      "e2e_ms": None if r.e2e_s is None else r.e2e_s * 1000,
                      "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
                      "cached_tokens": r.cached_tokens}
                     for r in s.requests]
    return d


def plot_sweep(summaries: Sequence[RunSummary], path: Path) -> None:
    """Median and p99 TTFT and TPOT against achieved output tok/s, one point per rate: the
    latency a server pays for each level of throughput."""
    import matplotlib  # optional (the [bench] extra): only a chart needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the Agg backend)

    xs = [s.output_throughput for s in summaries]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (attr, name) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))):
        med = [_nan(getattr(s, attr).median) for s in summaries]
        p99 = [_nan(getattr(s, attr).p99) for s in summaries]
        ax.plot(xs, med, "o-", label="median")
        ax.plot(xs, p99, "s--", label="p99")
        for x, y, s in zip(xs, p99, summaries):
            ax.annotate(f"{_rate_label(s.request_rate)} req/s", (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_xlabel("achieved output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs throughput")
        ax.margins(x=0.15, y=0.15)  # room for the rate labels
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def _nan(v: float | None) -> float:
    return float("nan") if v is None else v


# --------------------------------------------------------------------------- CLI


def normalize_base_url(url: str) -> str:
    """Strip a trailing slash and a trailing /v1 (so both `http://h:8000` and `.../v1` work)."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise ValueError(f"--url: expected http://HOST:PORT, got {url!r}")
    return u[:-3] if u.endswith("/v1") else u


def resolve_model(base_url: str, model: str | None, api_key: str | None, timeout_s: float) -> str:
    """Check the server answers before sending anything (an unreachable URL is one clear error,
    not N failed requests) and, without --model, take the first served model."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=min(timeout_s, 30.0))
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise ValueError(f"--url: cannot reach the server at {base_url} ({type(e).__name__}: {e}); "
                         "is `kvserve serve` running there?") from None
    if model:
        return model
    if r.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models returned HTTP {r.status_code} "
                         f"({_error_text(r.text)}); pass --model")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"GET {base_url}/v1/models listed no models; pass --model") from None


def _workload(args, seed: int) -> list[BenchRequest]:
    if getattr(args, "workload", "dataset") == "shared-prefix":
        spec = SharedPrefixSpec(args.num_prefixes, args.prefix_len, args.suffix_len, args.turns)
        return shared_prefix_requests(args.num_prompts, spec, args.output_len, seed)
    return build_requests(args.dataset, args.num_prompts, args.input_len, args.output_len, seed, args.dataset_path)


def _workload_label(args) -> str:
    if getattr(args, "workload", "dataset") == "shared-prefix":
        return (f"shared-prefix: {args.num_prefixes} prefixes of {args.prefix_len} words, suffixes of "
                f"{args.suffix_len} words, {args.turns} turn(s)")
    return f"{args.dataset} prompts of {args.input_len} words"


def main(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the CLI logs at INFO: one line per request otherwise
    rates = parse_rates(args.request_rate)
    slo = parse_goodput(args.goodput) if args.goodput is not None else None
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    base = normalize_base_url(args.url)
    # Each rate gets its own prompts: reusing them would let the server's prefix cache skip
    # prefill for every rate after the first.
    workloads = [_workload(args, args.seed + 1_000_003 * k) for k in range(len(rates))]
    model = resolve_model(base, args.model, args.api_key, args.timeout)
    target = ServeTarget(base, model, args.endpoint, args.api_key, args.timeout)
    summaries = []
    for rate, requests in zip(rates, workloads):
        results, duration = asyncio.run(run_requests(target, requests, rate, args.max_concurrency, args.seed))
        s = summarize_run(results, duration, rate, args.max_concurrency, slo)
        summaries.append(s)
        print(f"rate {_rate_label(rate)}: {s.completed} done, {s.failed} failed in {s.duration_s:.1f} s, "
              f"{s.output_throughput:.1f} output tok/s")
    conc = args.max_concurrency or "unbounded"
    print_report(summaries, f"{target.url} (model {model}): {args.num_prompts} requests per rate, "
                            f"{_workload_label(args)}, max_tokens {args.output_len} "
                            f"(ignore_eos), max concurrency {conc}, seed {args.seed}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
        config.update(model=model, request_rates=[_rate_label(r) if math.isinf(r) else r for r in rates])
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": config, "runs": [summary_to_json(s) for s in summaries]}, indent=1))
        print(f"wrote {path}")
    if args.plot:
        plot_sweep(summaries, Path(args.plot))
    if not any(s.completed for s in summaries):
        print("kvserve: error: no request completed", file=sys.stderr)
        return 1
    return 0
