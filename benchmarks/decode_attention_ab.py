"""Decode step with the C paged-attention kernel vs the torch path (padded gather + SDPA).

Both paths run on the same engine, alternating step by step (A, B, A, B, ...) so that the
machine's noise hits both alike; reports the median step time of each at several batch sizes,
plus the time inside the kernel per step and the context it read.

    python benchmarks/decode_attention_ab.py --dtype bfloat16 --batch-sizes 1,16,64 [--json-dir results]
"""
from __future__ import annotations

import argparse
import time

from _common import machine, median, save_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per batch size (half each path)")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    import kvserve.model.attention as attention
    from kvserve import LLM, SamplingParams
    from kvserve.bench.throughput import INPUT_RANGE, OUTPUT_RANGE, make_workload
    from kvserve.loading import load_model

    loaded = load_model(None, args.dtype)
    cfg = loaded.config
    # The throughput benchmark's prompts (32-512 tokens): realistic mixed context lengths.
    wl = make_workload(64, INPUT_RANGE, OUTPUT_RANGE, cfg.vocab_size, cfg.bos_token_id, 0)
    llm = LLM(loaded=loaded, enable_prefix_caching=False, max_num_seqs=64)
    eng = llm.engine
    kernel = attention.paged_decode_attention
    in_kernel = [0.0]

    def timed_kernel(*a, **k):
        t = time.perf_counter()
        out = kernel(*a, **k)
        in_kernel[0] += time.perf_counter() - t
        return out

    results = {}
    print(f"{machine()}, {args.dtype}")
    print("| batch | context tokens | kernel step (ms) | torch step (ms) | speedup | in kernel (ms/step) |")
    print("|---|---|---|---|---|---|")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for p in wl.prompts[:b]:
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True))
        while eng.scheduler.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                               for s in eng.scheduler.running):
            eng.step()
        context = sum(s.num_tokens for s in eng.scheduler.running)
        fast, slow = [], []
        in_kernel[0] = 0.0
        for i in range(args.steps):
            attention.paged_decode_attention = timed_kernel if i % 2 == 0 else (lambda *a, **k: None)
            t = time.perf_counter()
            eng.step()
            (fast if i % 2 == 0 else slow).append(time.perf_counter() - t)
        attention.paged_decode_attention = kernel
        while eng.has_unfinished():
            eng.step()
        f, s = median(fast) * 1e3, median(slow) * 1e3
        k = in_kernel[0] / len(fast) * 1e3
        results[b] = {"context_tokens": context, "kernel_step_ms": f, "torch_step_ms": s, "kernel_ms": k}
        print(f"| {b} | {context} | {f:.1f} | {s:.1f} | {s / f:.2f}x | {k:.1f} |")
    save_json(f"decode_attention_ab_{args.dtype}", {str(k): v for k, v in results.items()}, args.json_dir)


if __name__ == "__main__":
    main()
