"""Where the offline throughput run's time goes: wall-clock timers around kvserve's kernel wrappers.

The workload of `kvserve bench throughput` (64 requests, inputs 32-512, outputs 32-256, seed 0,
greedy, prefix cache off, max_num_seqs 64), in one process, after a two-request warm-up. Each
wrapper of a C kernel (kvserve/kernels) is timed where the model calls it; the body's panel
matmuls are split by rows (1, 2-15, 16+), the LM head's (rows the greedy screen left unsettled)
apart. What the timers leave out of the runner's total is Python and PyTorch glue (embedding,
RoPE tables, index ops, the per-layer calls). A batch-1 decode step runs as one C call
(kvserve/accel/decode_plan.py) and shows up as `decode_plan`. `--weights gguf`: the file's own
blocks, whose int8 products (kernels/ggml_int8.c) are split the same way.

    cd benchmarks && ../.venv/bin/python throughput_profile.py [--weights gguf] [--json-dir DIR]
"""
from __future__ import annotations

import argparse
import collections
import time

from _common import machine, save_json

from kvserve import LLM, SamplingParams, kernels
from kvserve.cli import positive_int
from kvserve.engine import model_runner
from kvserve.loading import load_model
from kvserve.accel import decode_plan
from kvserve.model import attention, layers
from kvserve.tools.bench.throughput import INPUT_RANGE, OUTPUT_RANGE, make_workload

seconds: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def timed(owner, name: str, label=None) -> None:
    """Replace owner.name by a timed call; `label(*args)` names the bucket (default: name)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            key = label(*args) if label else name
            seconds[key] += time.perf_counter() - t
            calls[key] += 1

    setattr(owner, name, wrapper)


def matmul_bucket(kind: str, vocab_size: int):
    """The bucket of a matmul kernel call: the LM head's (n = vocab_size) or the body's, by rows
    (the int8 GGUF products switch from the per-row kernel to the GEMM above 12 rows)."""
    small = 12 if kind == "ggml_q8" else 15

    def bucket(x, packed, *args) -> str:
        n = args[-1] if kind == "panel" else args[1]
        rows = x.shape[0]
        what = "head" if n == vocab_size else "body"
        return f"{kind}_{what}_{'1' if rows == 1 else f'2-{small}' if rows <= small else f'{small + 1}+'}_rows"
    return bucket


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--weights", choices=("float32", "gguf"), default="float32")
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    loaded = load_model(None, "float32", gguf_blocks=args.weights == "gguf")
    cfg = loaded.config
    timed(kernels, "panel_matmul", matmul_bucket("panel", cfg.vocab_size))
    timed(kernels, "ggml_q8_matmul", matmul_bucket("ggml_q8", cfg.vocab_size))
    timed(kernels, "screen_argmax")
    for name in ("norm_rope_write", "norm_rope_write_rows", "prefill_attention", "paged_decode_attention"):
        timed(attention, name)
    timed(layers, "add_rms_norm_kernel", lambda *a: "add_rms_norm")
    timed(layers, "gelu_tanh_mul")
    timed(decode_plan.DecodePlan, "run", lambda *a: "decode_plan")
    timed(model_runner.ModelRunner, "prepare", lambda *a: "runner_prepare")
    timed(model_runner.ModelRunner, "execute_greedy", lambda *a: "runner_total")

    wl = make_workload(args.num_prompts, INPUT_RANGE, OUTPUT_RANGE, cfg.vocab_size, cfg.bos_token_id, 0)
    llm = LLM(loaded=loaded, max_num_seqs=64, enable_prefix_caching=False)
    llm.generate(wl.prompts[:2], [SamplingParams(temperature=0, max_tokens=2)] * 2)  # warm-up
    seconds.clear()
    calls.clear()
    timed(llm.engine, "step", lambda *a: "engine_step")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t = time.perf_counter()
    outs = llm.generate(wl.prompts, params)
    total = time.perf_counter() - t
    assert sum(len(o.token_ids) for o in outs) == wl.output_tokens
    print(f"{machine()}, weights {args.weights}\n{total:.1f} s, {wl.output_tokens / total:.1f} output tok/s, {calls['engine_step']} steps")
    print("| part | s | share | calls |\n|---|---|---|---|")
    for key, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {s:.2f} | {100 * s / total:.1f}% | {calls[key]} |")
    save_json("throughput_profile" + ("_gguf" if args.weights == "gguf" else ""), {"seconds": total, "output_tok_s": wl.output_tokens / total,
                                     "parts": {k: {"s": s, "calls": calls[k]} for k, s in seconds.items()}},
              args.json_dir)


if __name__ == "__main__":
    main()
