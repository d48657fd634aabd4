"""`kvserve bench latency`: one request at a time: prefill tok/s and TTFT on a fresh prompt,
batch-1 decode tok/s, and how close decode runs to the memory-bandwidth bound.

Batch-1 decode reads every weight once per token (the tied LM head included; where the engine
screens greedy tokens through the head's int8 copy, accel/greedy_head.py, that copy instead of the
fp32 head) plus the KV cache of the context, so its bound is bandwidth / bytes-per-token. The
bandwidth is measured here, on this machine, by a reduction over a 1 GiB tensor (what a GEMV
streaming weights can reach).
Every prompt is new (random token ids, prefix cache off), so prefill is really computed.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.accel.greedy_head import head_screen
from kvserve.kernels.host_memory import empty_huge
from kvserve.loading import load_model
from kvserve.model.base import stored_weight_bytes
from kvserve.tools.bench.throughput import make_workload


@dataclass
class LatencyResult:
    dtype: str
    input_len: int
    output_len: int
    ttft_s: float  # median, prompt of input_len tokens (tokenization excluded: ids are given)
    prefill_tok_s: float  # input_len / TTFT
    decode_tok_s: float  # median of (n - 1) / (last token time - first token time)
    bytes_per_token: int  # weights + KV read by one decode step at the mean context length
    bandwidth_gbs: float  # measured read bandwidth
    bound_tok_s: float  # bandwidth / bytes_per_token
    fraction_of_bound: float  # decode_tok_s / bound_tok_s
    runs: list[dict]
    warmup_s: float = 0.0  # the first (untimed) request: kernels loaded, the graph compiled under compile


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct stored tensor (a tied LM head once; packed codes and scales of a
    quantized model as stored)."""
    return stored_weight_bytes(model)


def decode_bytes_per_token(loaded, context_len: int) -> int:
    """Bytes one batch-1 greedy decode step must read: all weights (the head's int8 screen in
    place of the fp32 head where the model has one: a step reads one row of a tied embedding),
    plus K/V of the context (a sliding-window layer reads at most its window)."""
    cfg = loaded.config
    elem = next(loaded.model.parameters()).element_size()
    heads, k_dim, v_dim = cfg.kv_cache_layout  # MLA: one latent of d_c + d_rope, no V
    per_layer = heads * (k_dim + v_dim) * elem
    kv = sum(per_layer * min(context_len, cfg.window(i) or context_len) for i in range(cfg.num_layers))
    weights = weight_bytes(loaded.model)
    screen = head_screen(loaded.model)
    if screen is not None:
        weights += screen.nbytes - screen.weight.numel() * screen.weight.element_size()
    return weights + kv


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5, device: str = "cpu") -> float:
    """Median read bandwidth (GB/s) of a sum over a `gib` GiB fp32 tensor on `device`. On the CPU
    the tensor is advised for 2 MB pages, as the weights a decode step streams are: over 4 KB pages
    the same sum read ~25% slower (a TLB miss every 4 KB), understating the bound."""
    n = int(gib * 2**30 // 4)
    x = torch.ones(n, device=device) if device != "cpu" else empty_huge(n, dtype=torch.float32).fill_(1.0)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    x.sum()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def measure(loaded, input_len: int, output_len: int, repeats: int, seed: int = 0,
            bandwidth_gib: float = 1.0, weights: str = "float", pack_weights: bool = True,
            compile: bool = False) -> LatencyResult:
    """`weights`, `pack_weights`, `compile`: EngineConfig's; bytes per token count the weights the
    engine really holds."""
    cfg = loaded.config
    llm = LLM(loaded=loaded, enable_prefix_caching=False, max_num_seqs=1,
              max_model_len=min(cfg.max_position_embeddings, input_len + output_len + 16), weights=weights,
              pack_weights=pack_weights, compile=compile)
    loaded = llm.engine.loaded  # the quantized copy when weights is int8 / int4
    # repeats + 1 distinct prompts (the first warms up), the throughput benchmark's token ids.
    prompts = make_workload(repeats + 1, (input_len, input_len), (1, 1), cfg.vocab_size, cfg.bos_token_id, seed).prompts
    t = time.perf_counter()  # a prompt and a decode step: each shape class of a compiled graph
    llm.generate(prompts[0][:16], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    warmup = time.perf_counter() - t
    runs = []
    for ids in prompts[1:]:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))[0]
        m = out.metrics
        decode = 1 / m.tpot if m.tpot else float("nan")  # tpot: mean gap between output tokens
        runs.append({"ttft_s": m.ttft, "prefill_tok_s": input_len / m.ttft, "decode_tok_s": decode})
    ttft = statistics.median(r["ttft_s"] for r in runs)
    decode = statistics.median(r["decode_tok_s"] for r in runs)
    bpt = decode_bytes_per_token(loaded, input_len + output_len // 2)
    bw = read_bandwidth_gbs(bandwidth_gib)
    bound = bw * 1e9 / bpt
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    dtype = dtype if weights == "float" else f"{weights} weights, {dtype}"
    dtype += ", torch.compile" if compile else ""
    return LatencyResult(dtype, input_len, output_len, ttft, input_len / ttft, decode, bpt, bw, bound,
                         decode / bound, runs, warmup)


def print_result(r: LatencyResult) -> None:
    print(f"\n{r.dtype}, prompt {r.input_len} tokens, {r.output_len} new tokens, median of {len(r.runs)}")
    print("| metric | value |")
    print("|---|---|")
    print(f"| TTFT ({r.input_len}-token prompt) | {r.ttft_s * 1e3:.1f} ms |")
    print(f"| prefill | {r.prefill_tok_s:.1f} tok/s |")
    print(f"| batch-1 decode | {r.decode_tok_s:.2f} tok/s |")
    print(f"| bytes read per decode token | {r.bytes_per_token / 1e6:.1f} MB |")
    print(f"| measured read bandwidth | {r.bandwidth_gbs:.1f} GB/s |")
    print(f"| bandwidth bound | {r.bound_tok_s:.1f} tok/s |")
    print(f"| achieved fraction of the bound | {r.fraction_of_bound:.0%} |")
    print(f"| warm-up (first request, untimed) | {r.warmup_s:.1f} s |")


def main(args) -> int:
    loaded = load_model(args.model, args.dtype, gguf_blocks=args.weights == "gguf",
                        gguf_activations=args.gguf_activations, gguf_mmap=args.gguf_mmap)
    result = measure(loaded, args.input_len, args.output_len, args.repeats, args.seed, weights=args.weights,
                     pack_weights=args.pack_weights, compile=args.compile)
    print_result(result)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(result), indent=1))
        print(f"wrote {path}")
    return 0
