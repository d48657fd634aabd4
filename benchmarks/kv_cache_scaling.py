"""Per-token decode time vs sequence length, with and without the KV cache.

Without a cache every new token recomputes the whole sequence (O(T) work per token, O(T^2)
in total); with it each step feeds one token and reads the cache. Greedy, same prompt, same
tokens (checked). Reports the median inter-token latency around several lengths.

    python benchmarks/kv_cache_scaling.py --tokens 192 [--json-dir results]
"""
from __future__ import annotations

import argparse

from _common import machine, median, save_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--window", type=int, default=8, help="tokens per reported point")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from kvserve import LLM, SamplingParams
    from kvserve.loading import load_model

    loaded = load_model()
    prompt = "The history of the printing press begins"
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for name, use_cache in (("cache", True), ("no-cache", False)):
        llm = LLM(loaded=loaded, kv_cache_gib=0.25, use_kv_cache=use_cache)
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))  # warm-up
        out = llm.generate(prompt, params)[0]
        results[name] = out
    assert results["cache"].token_ids == results["no-cache"].token_ids, "cache changed the greedy tokens"
    n_prompt = results["cache"].metrics.num_prompt_tokens
    points = sorted({args.window} | set(range(32, args.tokens + 1, 32)))
    rows = []
    for end in points:
        row = {"seq_len": n_prompt + end}
        for name, out in results.items():
            itl = out.metrics.itl[max(0, end - args.window - 1):end - 1]
            row[name] = median(itl) * 1000
        rows.append(row)
    print(f"machine: {machine()}; prompt {n_prompt} tokens, {args.tokens} greedy tokens, identical with/without cache")
    print("| sequence length | ms/token with KV cache | ms/token without | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']} | {r['cache']:.1f} | {r['no-cache']:.1f} | {r['no-cache'] / r['cache']:.1f}x |")
    for name, out in results.items():
        m = out.metrics
        print(f"{name}: e2e {m.e2e:.1f} s, {m.output_tokens_per_s:.2f} tok/s")
    save_json("kv_cache_scaling", {"rows": rows}, args.json_dir)


if __name__ == "__main__":
    main()
