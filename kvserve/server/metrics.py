"""Prometheus metrics for the server, vLLM's names under the `kvserve:` prefix.

Two sources, so nothing is counted twice:
* the engine already keeps running/waiting, KV usage, prefix-cache queries/hits and
  preemptions; a custom collector reads `AsyncLLMEngine.stats()` at scrape time (gauges, and
  the engine's cumulative counters exported as counters);
* latencies and token counts are observed per request output on the engine thread
  (`ServerMetrics.on_output`, the engine's OutputObserver): TTFT, ITL, TPOT and e2e from the
  engine's own monotonic timestamps (`RequestMetrics`), so HTTP time is not in them.

Each app gets its own CollectorRegistry (never the global one), so a process - a test suite -
can build several apps.
"""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvserve.engine.outputs import EmbeddingRequestOutput, RequestOutput

PREFIX = "kvserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets as vLLM's: from ~1 ms (a decode step on a GPU) to minutes (a queued long request).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

_GAUGES = {  # stats key -> (metric name, help)
    "num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."),
}
_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("num_preemptions", "Sequences preempted (by recompute) for lack of KV blocks."),
    # Speculative decoding (0 when off); acceptance rate = accepted / draft tokens.
    "spec_num_drafts": ("spec_decode_num_drafts", "Verification steps of speculating sequences."),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


class _EngineStatsCollector(Collector):
    """Reads the engine's gauges and cumulative counters when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        for key, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self._model], float(stats.get(key, 0)))
            yield g
        for key, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self._model], float(stats.get(key, 0)))
            yield c


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(PREFIX + name, doc, labels + (extra or []), registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first, "
                         "per request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.").labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.registry.register(_EngineStatsCollector(stats, model_name))

    def on_output(self, out: RequestOutput | EmbeddingRequestOutput, first: bool) -> None:
        """Called on the engine thread for every output (prometheus_client is thread-safe)."""
        if first:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        if isinstance(out, EmbeddingRequestOutput):  # no tokens generated; one output, finished
            self._finished(out, "stop" if out.outputs is not None else "error" if out.error else None)
            return
        new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        if out.finished:
            self._finished(out, out.outputs[0].finish_reason if out.outputs else None)

    def _finished(self, out: RequestOutput | EmbeddingRequestOutput, reason: str | None) -> None:
        m = out.metrics
        self._success.labels(self.model_name, reason or "abort").inc()
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itl:
            self.itl.observe(gap)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
