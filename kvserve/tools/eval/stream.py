"""`kvserve eval stream`: NLL over a long token stream with a bounded KV cache (StreamingLLM).

The stream is WikiText-2 raw test, the whole file tokenized once, BOS once at the very start, cut
to `num_tokens`. Entry t - 1 of a method's NLL scores token t given the tokens before it, as the
method sees them. Methods (B = S + W, the cache budget, equal for every bounded method as in the
paper's table: window 0+1024 against sinks 4+1020):

* full       the model's own attention over the whole stream (cache grows with the stream).
* window     the last B tokens, no sinks; evicted tokens are gone; positions inside the cache.
* sinks      S sink tokens + the last W tokens, keys cached before RoPE, positions inside the cache.
* recompute  each scored token predicted from scratch from the B tokens before it (positions
             0..B-1, no BOS unless the context reaches the stream's start): O(B) prefill per token,
             so only on an evenly spaced subsample of positions.
* recompute-bos (opt-in) the same with BOS in place of the oldest context token: separates "the
             context is short" from "the context has no BOS" for models that lean on BOS.

Every method is also reported on exactly that subsample, so all four compare like for like.
Gemma 3's sliding (local) layers: see `layer_policies` in kvserve/model/streaming.py: they keep
their last min(512, B) tokens, no sinks; with B >= 512 they are exactly the model's own.
Streaming runs in chunks of C tokens, which equals token-by-token streaming (tests prove it).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from kvserve.loading import LoadedModel, load_model
from kvserve.model.attention import AttentionMetadata
from kvserve.model.streaming import (
    CacheSize,
    StreamingAttention,
    StreamPolicy,
    layer_policies,
)
from kvserve.paths import WIKITEXT2_TEST, wikitext2_file
from kvserve.tools.eval.windows import NO_SLOTS

log = logging.getLogger(__name__)

METHODS = ("full", "window", "sinks", "recompute", "recompute-bos")
DEFAULT_METHODS = METHODS[:4]


@dataclass(frozen=True)
class StreamEvalConfig:
    """Validated settings; messages name the CLI flags."""

    num_tokens: int = 16384
    sinks: int = 4
    window: int = 1020
    chunk: int = 256
    methods: tuple[str, ...] = DEFAULT_METHODS
    recompute_positions: int = 128

    def __post_init__(self) -> None:
        if self.num_tokens < 2:
            raise ValueError(f"--num-tokens must be >= 2 (one token to score after BOS), got {self.num_tokens}")
        if self.sinks < 0:
            raise ValueError(f"--sinks must be >= 0, got {self.sinks}")
        if self.window < 1:
            raise ValueError(f"--window must be >= 1, got {self.window}")
        if self.chunk < 1:
            raise ValueError(f"--chunk must be >= 1, got {self.chunk}")
        if not 1 <= self.recompute_positions <= self.num_tokens - 1:
            raise ValueError(f"--recompute-positions must be in [1, num_tokens - 1 = {self.num_tokens - 1}], "
                             f"got {self.recompute_positions}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"--methods: unknown or empty {unknown or list(self.methods)} "
                             f"(choose from {', '.join(METHODS)})")

    @property
    def budget(self) -> int:
        """Cache tokens per global layer for every bounded method: S + W."""
        return self.sinks + self.window

    def cache_label(self, method: str) -> str:
        return {"full": "all", "window": f"0+{self.budget}", "sinks": f"{self.sinks}+{self.window}",
                "recompute": f"{self.budget} (recomputed)",
                "recompute-bos": f"{self.budget} (recomputed, BOS first)"}[method]


def parse_methods(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def method_policies(method: str, model_cfg, cfg: StreamEvalConfig) -> list[StreamPolicy]:
    """Per-layer cache policies of a streamed method (recompute runs `full` on each context)."""
    if method in ("full", "recompute", "recompute-bos"):
        return layer_policies(model_cfg)
    if method == "window":
        return layer_policies(model_cfg, sinks=0, window=cfg.budget)
    return layer_policies(model_cfg, sinks=cfg.sinks, window=cfg.window)


# --- data --------------------------------------------------------------------------------------

def default_data_path(flag: str = "--data") -> Path:
    """WikiText-2's raw test split under $KVSERVE_DATA (kvserve/paths.py)."""
    return wikitext2_file(WIKITEXT2_TEST, flag)


def load_token_stream(tokenizer, path: Path, num_tokens: int, bos_token_id: int | None) -> torch.Tensor:
    """The file tokenized once (BOS once at the start when given) -> its first num_tokens [N] int64."""
    if not path.is_file():
        raise ValueError(f"--data: WikiText-2 file {path} not found")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    if bos_token_id is not None:
        ids = [bos_token_id] + ids
    if num_tokens > len(ids):
        raise ValueError(f"--num-tokens {num_tokens} exceeds the {len(ids)} tokens of {path}")
    return torch.tensor(ids[:num_tokens], dtype=torch.long)


def subsample_targets(num_tokens: int, k: int) -> torch.Tensor:
    """k evenly spaced scored positions in [1, num_tokens - 1] -> [k'] int64 (k' <= k, distinct)."""
    return torch.linspace(1, num_tokens - 1, k, dtype=torch.float64).round().long().unique()


# --- scoring -----------------------------------------------------------------------------------

def forward_chunk(model, attention: StreamingAttention, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """ids, positions [T] (positions continue the stream `attention` has seen) -> hidden [T, hidden]."""
    attention.begin(positions)
    return model(ids, positions, None, AttentionMetadata(slot_mapping=NO_SLOTS, seqs=[], custom=attention))


def token_nll(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hidden [T, hidden], targets [T] -> NLL [T] fp32 (logits in fp32)."""
    logits = model.compute_logits(hidden)
    return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None])[:, 0]


def stream_nll(model, tokens: torch.Tensor, policies: list[StreamPolicy], chunk: int,
               desc: str = "stream", progress: bool = True) -> tuple[torch.Tensor, list[CacheSize]]:
    """tokens [N] streamed chunk by chunk -> (NLL [N - 1] of tokens 1..N-1, cache size per chunk)."""
    attention = StreamingAttention.for_model(model, policies)
    n = int(tokens.shape[0])
    out = []
    with torch.inference_mode(), tqdm(total=n, desc=desc, unit="tok", disable=not progress) as bar:
        for a in range(0, n, chunk):
            ids = tokens[a:a + chunk]
            hidden = forward_chunk(model, attention, ids, torch.arange(a, a + len(ids)))
            targets = tokens[a + 1:a + 1 + len(ids)]  # the last token of the stream has no target
            out.append(token_nll(model, hidden[:len(targets)], targets))
            bar.update(len(ids))
    return torch.cat(out), attention.sizes


def recompute_nll(model, tokens: torch.Tensor, targets: torch.Tensor, context: int, bos: int | None = None,
                  progress: bool = True) -> tuple[torch.Tensor, list[CacheSize]]:
    """Sliding window with recomputation: token t from a fresh pass over tokens[t - context : t]
    at positions 0.. (the model's own attention) -> (NLL [K] at `targets` [K], cache sizes).
    With `bos`, a context that does not reach the stream's start begins with BOS instead of its
    oldest token (same length)."""
    policies = layer_policies(model.config)
    nll, sizes = [], []
    with torch.inference_mode():
        for t in tqdm(targets.tolist(), desc="recompute" + ("-bos" if bos is not None else ""), unit="pos",
                      disable=not progress):
            start = max(0, t - context)
            ids = tokens[start:t]
            if bos is not None and start > 0:
                ids = torch.cat([torch.tensor([bos]), tokens[start + 1:t]])
            attention = StreamingAttention.for_model(model, policies)
            hidden = forward_chunk(model, attention, ids, torch.arange(len(ids)))
            nll.append(token_nll(model, hidden[-1:], tokens[t:t + 1]))
            size = attention.sizes[0]
            sizes.append(CacheSize(t, size.max_layer_tokens, size.total_bytes))
    return torch.cat(nll), sizes


@dataclass
class MethodResult:
    name: str
    cache: str  # e.g. "4+1020"
    nll: torch.Tensor | None  # [N - 1], tokens 1..N-1; None for recompute (subsample only)
    sub_nll: torch.Tensor  # [K] at the shared subsample
    sizes: list[CacheSize]
    seconds: float


def run_method(loaded: LoadedModel, tokens: torch.Tensor, method: str, cfg: StreamEvalConfig,
               targets: torch.Tensor, progress: bool = True) -> MethodResult:
    t0 = time.perf_counter()
    if method.startswith("recompute"):
        bos = int(tokens[0]) if method == "recompute-bos" else None  # the stream starts with BOS
        sub, sizes = recompute_nll(loaded.model, tokens, targets, cfg.budget, bos, progress)
        nll = None
    else:
        policies = method_policies(method, loaded.config, cfg)
        nll, sizes = stream_nll(loaded.model, tokens, policies, cfg.chunk, desc=method, progress=progress)
        sub = nll[targets - 1]
    return MethodResult(method, cfg.cache_label(method), nll, sub, sizes, time.perf_counter() - t0)


# --- summary -----------------------------------------------------------------------------------

def bucket_edges(num_tokens: int) -> list[int]:
    """[0, 1K, 4K, 16K, 64K, ...] below num_tokens, then num_tokens."""
    edges, e = [0], 1024
    while e < num_tokens:
        edges.append(e)
        e *= 4
    return edges + [num_tokens]


def _k(x: int) -> str:
    return f"{x // 1024}K" if x and x % 1024 == 0 else str(x)


def bucket_labels(edges: list[int]) -> list[str]:
    return [f"[{_k(a)},{_k(b)})" for a, b in zip(edges, edges[1:])]


def ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean())) if nll.numel() else float("nan")


@dataclass
class Row:
    """One method's summary (PPL = exp(mean NLL))."""

    method: str
    cache: str
    ppl_all: float | None  # every scored token; None when only the subsample was scored (recompute)
    buckets_all: list[float] | None  # PPL per position bucket over every scored token
    ppl_sub: float  # the shared subsample
    buckets_sub: list[float]  # PPL per position bucket over the subsample
    dnll_sub: tuple[float, float] | None  # mean NLL - full's on the subsample, its standard error
    cache_max_tokens: int  # per layer, the fullest layer at its peak
    cache_max_bytes: int  # all layers, each at its peak in the chunk
    seconds: float


def _bucket_ppl(pos: torch.Tensor, nll: torch.Tensor, edges: list[int]) -> list[float]:
    return [ppl(nll[(pos >= a) & (pos < b)]) for a, b in zip(edges, edges[1:])]


def summarize(results: list[MethodResult], targets: torch.Tensor, num_tokens: int) -> list[Row]:
    edges = bucket_edges(num_tokens)
    full = next((r for r in results if r.name == "full"), None)
    rows = []
    for r in results:
        dnll = None
        if full is not None:
            d = (r.sub_nll - full.sub_nll).double()  # paired: the same positions, so noise cancels
            se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")
            dnll = (float(d.mean()), se)
        every = r.nll is not None
        rows.append(Row(r.name, r.cache, ppl(r.nll) if every else None,
                        _bucket_ppl(torch.arange(1, num_tokens), r.nll, edges) if every else None,
                        ppl(r.sub_nll), _bucket_ppl(targets, r.sub_nll, edges), dnll,
                        max(s.max_layer_tokens for s in r.sizes), max(s.total_bytes for s in r.sizes), r.seconds))
    return rows


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _markdown(head: list[str], lines: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(cells) + " |" for cells in lines])


def format_tables(rows: list[Row], num_tokens: int, targets: torch.Tensor) -> str:
    """Two Markdown tables (they read in a terminal and paste into docs): every scored token, and
    the shared subsample where all methods, recompute included, are scored on the same positions."""
    edges = bucket_edges(num_tokens)
    labels = bucket_labels(edges)
    head = (["method", "cache", f"PPL ({num_tokens - 1} tokens)"] + [f"PPL {b}" for b in labels]
            + ["max cache tok/layer", "max cache MiB", "time (s)"])
    lines = [[r.method, r.cache, _fmt(r.ppl_all)] + [_fmt(b) for b in (r.buckets_all or [None] * len(labels))]
             + [str(r.cache_max_tokens), f"{r.cache_max_bytes / 2**20:.1f}", f"{r.seconds:.0f}"] for r in rows]
    counts = [int(((targets >= a) & (targets < b)).sum()) for a, b in zip(edges, edges[1:])]
    head_sub = (["method", f"PPL (subsample, {targets.numel()} positions)", "ΔNLL vs full (± s.e.)"]
                + [f"PPL {b} (n={n})" for b, n in zip(labels, counts)])
    lines_sub = [[r.method, _fmt(r.ppl_sub), "—" if r.dnll_sub is None else
                  f"{r.dnll_sub[0]:+.3f} ± {r.dnll_sub[1]:.3f}"] + [_fmt(b) for b in r.buckets_sub] for r in rows]
    return (f"All scored tokens:\n\n{_markdown(head, lines)}\n\n"
            f"Shared subsample (evenly spaced positions, every method):\n\n{_markdown(head_sub, lines_sub)}")


def moving_average(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [n] -> [n - width + 1] means over consecutive windows of `width` (width <= n)."""
    c = torch.cat([torch.zeros(1, dtype=torch.float64), x.double().cumsum(0)])
    return ((c[width:] - c[:-width]) / width).float()


def _smoothed(pos: torch.Tensor, values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean position, mean value) over consecutive windows of `width` points (capped at the count)."""
    w = max(1, min(width, values.numel()))
    return moving_average(pos.double(), w), moving_average(values, w)


def plot(results: list[MethodResult], targets: torch.Tensor, cfg: StreamEvalConfig, path: str,
         width: int = 256) -> None:
    """Three panels over the stream position: NLL (moving average of `width` tokens; recompute
    methods: of 8 subsample points), NLL minus full's NLL (4 x `width` tokens; recompute: 32
    subsample points, paired), and the cache size per layer."""
    import matplotlib  # optional (the [bench] extra): only a chart needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the Agg backend)

    fig, (ax, axd, axc) = plt.subplots(3, 1, figsize=(10, 9.5), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 2, 1.2]})
    full = next((r for r in results if r.name == "full"), None)
    for r in results:
        label = f"{r.name}: {r.cache}"
        if r.nll is not None:
            pos = torch.arange(1, r.nll.numel() + 1)
            line = ax.plot(*_smoothed(pos, r.nll, width), label=label, lw=1)[0]
            if full is not None and r is not full:
                axd.plot(*_smoothed(pos, r.nll - full.nll, 4 * width), color=line.get_color(), label=label, lw=1)
        else:
            line = ax.plot(*_smoothed(targets, r.sub_nll, 8), "o-", ms=2, lw=0.8,
                           label=f"{label} (subsample, 8-point average)")[0]
            if full is not None:
                axd.plot(*_smoothed(targets, r.sub_nll - full.sub_nll, 32), "o-", ms=2, lw=0.8,
                         color=line.get_color(), label=f"{label} (subsample, 32-point average)")
        axc.step([s.position for s in r.sizes], [s.max_layer_tokens for s in r.sizes], where="post",
                 color=line.get_color(), label=r.name)
    for a in (ax, axd, axc):
        a.axvline(cfg.budget, color="grey", ls=":", lw=1)
        a.grid(alpha=0.3)
    axd.axhline(0, color="black", lw=0.8)
    ax.set_title(f"StreamingLLM on WikiText-2: NLL over position (cache budget {cfg.budget}: dotted line)")
    ax.set_ylabel(f"NLL (moving average, {width} tokens)")
    ax.legend(fontsize=8)
    axd.set_ylabel("NLL − full's NLL")
    axd.legend(fontsize=8)
    axc.set_yscale("log")
    axc.set_ylabel("cache tokens / layer")
    axc.set_xlabel("position in the stream")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _trace(sizes: list[CacheSize], points: int = 200) -> list[list[int]]:
    step = max(1, len(sizes) // points)
    return [[s.position, s.max_layer_tokens, s.total_bytes] for s in sizes[::step]]


def to_json(results: list[MethodResult], rows: list[Row], targets: torch.Tensor, cfg: StreamEvalConfig,
            meta: dict) -> dict:
    labels = bucket_labels(bucket_edges(cfg.num_tokens))
    methods = {}
    for r, row in zip(results, rows):
        entry = {
            "cache": r.cache, "ppl_all": row.ppl_all, "ppl_subsample": row.ppl_sub,
            "delta_nll_vs_full_subsample": None if row.dnll_sub is None else
            {"mean": row.dnll_sub[0], "standard_error": row.dnll_sub[1]},
            "ppl_buckets_all": None if row.buckets_all is None else dict(zip(labels, row.buckets_all)),
            "ppl_buckets_subsample": dict(zip(labels, row.buckets_sub)),
            "cache_max_tokens_per_layer": row.cache_max_tokens, "cache_max_bytes": row.cache_max_bytes,
            "cache_trace": {"columns": ["position", "max_layer_tokens", "total_bytes"], "rows": _trace(r.sizes)},
            "nll_subsample": [round(float(x), 5) for x in r.sub_nll], "seconds": r.seconds,
        }
        if r.nll is not None:
            ma = moving_average(r.nll, min(256, r.nll.numel()))
            entry["nll_moving_average_256"] = [round(float(x), 4) for x in ma[::64]]
        methods[r.name] = entry
    return {**meta, "config": {"num_tokens": cfg.num_tokens, "sinks": cfg.sinks, "window": cfg.window,
                               "budget": cfg.budget, "chunk": cfg.chunk, "methods": list(cfg.methods),
                               "recompute_positions": cfg.recompute_positions},
            "subsample_positions": targets.tolist(), "methods": methods}


# --- entry points ------------------------------------------------------------------------------

@dataclass
class StreamReport:
    results: list[MethodResult]
    rows: list[Row]
    targets: torch.Tensor
    meta: dict = field(default_factory=dict)


def evaluate(loaded: LoadedModel, cfg: StreamEvalConfig, data: Path, progress: bool = True,
             on_method: Callable[[StreamReport], None] | None = None) -> StreamReport:
    """Tokenize the stream, run every method of cfg, summarize. `on_method` gets the report so
    far after each method (a long run that is interrupted keeps what it finished)."""
    if "full" in cfg.methods and cfg.num_tokens > loaded.config.max_position_embeddings:
        raise ValueError(f"--num-tokens {cfg.num_tokens} exceeds the model's context "
                         f"{loaded.config.max_position_embeddings} (method full)")
    bos = loaded.config.bos_token_id if loaded.config.add_bos_token else None
    if "recompute-bos" in cfg.methods and bos is None:
        raise ValueError("--methods recompute-bos: this model does not start its inputs with a BOS token")
    tokens = load_token_stream(loaded.tokenizer, data, cfg.num_tokens, bos)
    targets = subsample_targets(cfg.num_tokens, cfg.recompute_positions)
    meta = {"model": str(loaded.source), "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
            "data": str(data), "bos_once": bos is not None, "threads": torch.get_num_threads()}
    results: list[MethodResult] = []
    for method in cfg.methods:
        r = run_method(loaded, tokens, method, cfg, targets, progress)
        results.append(r)
        log.info("%s: PPL %s, subsample PPL %.2f, %.0f s", method,
                 "—" if r.nll is None else f"{ppl(r.nll):.2f}", ppl(r.sub_nll), r.seconds)
        if on_method is not None:
            on_method(StreamReport(results, summarize(results, targets, cfg.num_tokens), targets, meta))
    return StreamReport(results, summarize(results, targets, cfg.num_tokens), targets, meta)


def write_json(report: StreamReport, cfg: StreamEvalConfig, path: str) -> None:
    doc = to_json(report.results, report.rows, report.targets, cfg, report.meta)
    doc["complete"] = len(report.results) == len(cfg.methods)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def main(args: argparse.Namespace) -> int:
    cfg = StreamEvalConfig(num_tokens=args.num_tokens, sinks=args.sinks, window=args.window, chunk=args.chunk,
                           methods=parse_methods(args.methods), recompute_positions=args.recompute_positions)
    data = Path(args.data).expanduser() if args.data else default_data_path()
    if not data.is_file():  # before the (slow) model load
        raise ValueError(f"--data: WikiText-2 file {data} not found (pass --data PATH)")
    loaded = load_model(args.model, dtype=args.dtype)
    t0 = time.perf_counter()

    def save(partial: StreamReport) -> None:  # after every method, so an interrupted run keeps them
        write_json(partial, cfg, args.json)

    report = evaluate(loaded, cfg, data, on_method=save if args.json else None)
    print(f"{report.meta['model']} ({report.meta['dtype']}), {cfg.num_tokens} tokens of {data.name} "
          f"(BOS once at the start), chunk {cfg.chunk}, subsample of {report.targets.numel()} positions, "
          f"{time.perf_counter() - t0:.0f} s")
    print(format_tables(report.rows, cfg.num_tokens, report.targets))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report.results, report.targets, cfg, args.plot)
    return 0
