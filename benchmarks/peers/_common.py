"""What every peer adapter shares: the spec it is given, the measurement loops, the JSON it prints.

Standard library only: this module is imported by adapters running in the peers' own venvs.

An adapter implements `Engine` (load once, then `generate_timed` for one request at a time and
`throughput` for the offline batch) and calls `main(engine_factory)`. The loops here define the
metrics, so every engine is measured the same way:

- decode: batch-1 greedy on the decode prompt, `decode_new_tokens` new tokens (EOS ignored);
  decode tok/s = (n - 1) / (time of the last token - time of the first token), i.e. the first
  token (prefill) is excluded. One warm-up run, then `repeats` runs.
- prefill: a fresh, distinct `prefill_len`-token prompt per run (never seen before by the engine,
  prefix caching off), 1 new token; TTFT = submit -> first token, prefill tok/s = prefill_len / TTFT.
  The spec's first prefill prompt is the warm-up.
- throughput: all requests at once, EOS ignored, output tok/s = generated tokens / wall time. An
  engine with several settings (e.g. HF static batch sizes) runs each once, then its best one
  `repeats - 1` more times.
- first_tokens: the first `check_tokens` greedy ids on the decode prompt (compared to kvserve's
  by the driver).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

LLAMACPP_KV_MODES = ("unified", "per-sequence")  # llama.cpp batched-context KV layouts (adapter_llamacpp.py)
RESULT_PREFIX = "PEERS_RESULT "  # marks the adapter's result line among an engine's own stdout logging


@dataclass
class Timed:
    """One batch-1 greedy request: its new token ids, TTFT, and first-to-last-token time."""
    tokens: list[int]
    ttft_s: float
    decode_s: float  # time from the first to the last new token (0 for one token)


@dataclass
class ThroughputRun:
    setting: str
    seconds: float
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds


class Engine(Protocol):
    name: str
    dtype: str  # weights as computed: "float32", "Q4_K_M", ...

    def generate_timed(self, ids: list[int], new_tokens: int) -> Timed:
        """Greedy-generate exactly `new_tokens` tokens (EOS ignored) for one prompt, alone."""

    def throughput_settings(self) -> list[str]:
        """Settings to try for the offline run (first is the default)."""

    def throughput(self, prompts: list[list[int]], output_lens: list[int], setting: str) -> ThroughputRun:
        """Generate output_lens[i] tokens (EOS ignored) for every prompt, all submitted at once."""


@dataclass
class AdapterResult:
    engine: str
    dtype: str = ""
    decode_runs: list[float] = field(default_factory=list)  # tok/s
    ttft_runs: list[float] = field(default_factory=list)  # seconds
    prefill_runs: list[float] = field(default_factory=list)  # tok/s
    throughput_runs: list[dict] = field(default_factory=list)  # ThroughputRun + output_tok_s
    throughput_setting: str = ""
    first_tokens: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load_s: float = 0.0
    error: str | None = None


def load_spec(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def threads(spec: dict) -> int:
    return int(spec.get("threads") or os.cpu_count() or 1)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure_decode(engine: Engine, spec: dict, res: AdapterResult) -> None:
    """Batch-1 greedy decode tok/s on the decode prompt (first token excluded)."""
    ids, n = spec["decode_prompt"], spec["decode_new_tokens"]
    warm = engine.generate_timed(ids, min(n, 8))
    res.first_tokens = warm.tokens[: spec["check_tokens"]]
    for r in range(spec["repeats"]):
        t = engine.generate_timed(ids, n)
        if len(t.tokens) != n:
            res.notes.append(f"decode run {r}: {len(t.tokens)} tokens instead of {n}")
        if len(t.tokens) < 2 or t.decode_s <= 0:
            raise RuntimeError("decode produced fewer than 2 tokens")
        res.decode_runs.append((len(t.tokens) - 1) / t.decode_s)
        if len(t.tokens) >= spec["check_tokens"] and len(res.first_tokens) < spec["check_tokens"]:
            res.first_tokens = t.tokens[: spec["check_tokens"]]
        log(f"{res.engine} decode run {r}: {res.decode_runs[-1]:.2f} tok/s")


def measure_prefill(engine: Engine, spec: dict, res: AdapterResult) -> None:
    """TTFT and prefill tok/s on fresh prompts (prompt 0 warms up, one new prompt per run)."""
    prompts = spec["prefill_prompts"]
    engine.generate_timed(prompts[0], 1)
    for r, ids in enumerate(prompts[1: spec["repeats"] + 1]):
        t = engine.generate_timed(ids, 1)
        res.ttft_runs.append(t.ttft_s)
        res.prefill_runs.append(len(ids) / t.ttft_s)
        log(f"{res.engine} prefill run {r}: TTFT {t.ttft_s * 1e3:.1f} ms, {res.prefill_runs[-1]:.1f} tok/s")


def measure_throughput(engine: Engine, spec: dict, res: AdapterResult) -> None:
    """Offline output tok/s; with several settings, the best of one run each, then repeated."""
    prompts, lens = spec["throughput_prompts"], spec["throughput_output_lens"]
    settings = engine.throughput_settings()
    expected = sum(lens)
    first: list[ThroughputRun] = []
    for s in settings:
        run = engine.throughput(prompts, lens, s)
        if run.output_tokens != expected:
            res.notes.append(f"throughput {s}: {run.output_tokens} output tokens, expected {expected}")
        log(f"{res.engine} throughput [{s}]: {run.output_tok_s:.1f} output tok/s")
        first.append(run)
    best = max(first, key=lambda r: r.output_tok_s)
    if len(settings) > 1:
        res.notes.append("throughput sweep (one run each): "
                         + ", ".join(f"{r.setting}: {r.output_tok_s:.1f}" for r in first))
    runs = [best]
    for _ in range(spec["repeats"] - 1):
        runs.append(engine.throughput(prompts, lens, best.setting))
        log(f"{res.engine} throughput [{best.setting}]: {runs[-1].output_tok_s:.1f} output tok/s")
    res.throughput_setting = best.setting
    res.throughput_runs = [dict(asdict(r), output_tok_s=r.output_tok_s) for r in runs]


def engine_name(default: str) -> str:
    """The engine this adapter runs as: `adapter.py SPEC.json OUT.json ENGINE` (one adapter may
    serve several engines, e.g. kvserve-int8; its options are the spec's ENGINE section)."""
    return sys.argv[3] if len(sys.argv) > 3 else default


def main(make_engine: Callable[[dict], Engine], name: str) -> int:
    """Adapter entry point: `adapter.py SPEC.json [OUT.json [ENGINE]]` (ENGINE: see `engine_name`,
    default `name`). Prints one JSON line (the result, after RESULT_PREFIX) on stdout; a failure
    is reported in `error`, with whatever was measured before it."""
    spec = load_spec(sys.argv[1])
    res = AdapterResult(engine=engine_name(name))
    try:
        t = time.perf_counter()
        engine = make_engine(spec)
        res.load_s = time.perf_counter() - t
        res.dtype = engine.dtype
        for metric, fn in (("decode", measure_decode), ("prefill", measure_prefill),
                           ("throughput", measure_throughput)):
            if metric in spec.get("metrics", ["decode", "prefill", "throughput"]):
                fn(engine, spec, res)
        res.notes.extend(getattr(engine, "notes", []))
    except BaseException as e:  # report, never hang the driver
        traceback.print_exc()
        res.error = f"{type(e).__name__}: {e}"
    line = json.dumps(asdict(res))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(line + "\n")
    print(RESULT_PREFIX + line, flush=True)
    return 0 if res.error is None else 1


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
