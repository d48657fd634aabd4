"""The unavoidable work of an offline workload (kvserve.tools.bench.throughput's) on a model, and the
time it needs at given peaks: an optimistic floor (each part the larger of its arithmetic at peak
and its bytes at bandwidth; no glue, perfect overlap). benchmarks/throughput_floor.py measures the
peaks of a machine and runs the workload against it."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.config import SLIDING, ModelConfig
from kvserve.tools.bench.throughput import Workload

FP32 = 4  # bytes


@dataclass
class Work:
    """What the workload must do, in multiply-adds (MACs) and bytes."""
    body_macs: float  # projections and MLP of every row that must pass through them
    prefill_attn_macs: float  # QK^T and PV of prompt rows (their K/V is freshly written, in cache)
    decode_attn_macs: float  # QK^T and PV of generated rows
    decode_kv_bytes: float  # fp32 K/V that generated rows read from the pool
    head_macs: float  # one logit row per output token over the whole vocabulary
    body_weight_bytes_per_step: float
    head_int8_bytes_per_step: float
    min_steps: int  # a request's tokens come one step apart: the longest output needs this many
    output_tokens: int


def layer_macs(cfg: ModelConfig) -> tuple[int, int]:
    """(MACs of one row through a whole layer's matmuls, MACs of its K/V projections alone)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    kv_only = cfg.hidden_size * 2 * kv
    return cfg.hidden_size * q + kv_only + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size, kv_only


def count_work(cfg: ModelConfig, wl: Workload) -> Work:
    if cfg.mla or cfg.kv_source is not None:
        raise ValueError(f"{cfg.model_type}: the count covers plain MHA/GQA/MQA layers, not MLA or cross-layer KV")
    full, kv_only = layer_macs(cfg)
    windows = [cfg.sliding_window if t == SLIDING else None for t in cfg.layer_types]
    attn_per_ctx = 2 * cfg.num_heads * cfg.head_dim  # QK^T and PV MACs per context token, per layer
    kv_bytes_per_ctx = 2 * cfg.num_kv_heads * cfg.head_dim * FP32
    body = prefill_attn = decode_attn = kv_bytes = 0.0
    for prompt, n in zip(wl.prompts, wl.output_lens):
        p = len(prompt)
        rows = p + n - 1  # the last generated token is never fed back
        # Prompt rows other than the last need only the last layer's K/V; every other row needs all.
        body += rows * (cfg.num_layers - 1) * full + n * full + (p - 1) * kv_only
        for w in windows:
            ctx = lambda pos: pos + 1 if w is None else min(pos + 1, w)  # noqa: E731
            prefill_attn += attn_per_ctx * sum(ctx(i) for i in range(p))
            dec = sum(ctx(i) for i in range(p, rows))
            decode_attn += attn_per_ctx * dec
            kv_bytes += kv_bytes_per_ctx * dec
    body_params = cfg.num_layers * full
    return Work(body, prefill_attn, decode_attn, kv_bytes, float(wl.output_tokens) * cfg.vocab_size * cfg.hidden_size,
                body_params * FP32, cfg.vocab_size * cfg.hidden_size, max(wl.output_lens), wl.output_tokens)


def floor_seconds(w: Work, fp32_gflops: float, int16_gmacs: float, read_gbs: float, head: str) -> dict:
    """Each part's time: the larger of its arithmetic at peak and its bytes at bandwidth."""
    flops = lambda macs: 2 * macs / (fp32_gflops * 1e9)  # noqa: E731
    parts = {
        "body": max(flops(w.body_macs), w.min_steps * w.body_weight_bytes_per_step / (read_gbs * 1e9)),
        "prefill attention": flops(w.prefill_attn_macs),
        "decode attention": max(flops(w.decode_attn_macs), w.decode_kv_bytes / (read_gbs * 1e9)),
    }
    if head == "fp32":
        parts["head (fp32)"] = max(flops(w.head_macs), w.min_steps * 4 * w.head_int8_bytes_per_step / (read_gbs * 1e9))
    else:
        parts["head (int16 screen)"] = max(w.head_macs / (int16_gmacs * 1e9),
                                           w.min_steps * w.head_int8_bytes_per_step / (read_gbs * 1e9))
    total = sum(parts.values())
    return {"parts_s": parts, "seconds": total, "output_tok_s": w.output_tokens / total}
