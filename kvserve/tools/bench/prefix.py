"""`kvserve bench prefix`: requests sharing a long system prompt, with and without prefix caching.

N requests = one shared system prompt of S tokens + a distinct suffix of U tokens each, all
submitted at once, O output tokens each (greedy, ignore_eos). Reports the prompt tokens the
model actually computed, the share of the shared part saved, mean TTFT and wall time.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.loading import load_model


def make_requests(n: int, shared: int, unique: int, vocab: int, bos: int | None, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 200_000) - 1
    system = [rng.randint(3, hi) for _ in range(shared)]
    if bos is not None:
        system[0] = bos
    return [system + [rng.randint(3, hi) for _ in range(unique)] for _ in range(n)]


def run(loaded, prompts: list[list[int]], output_len: int, caching: bool) -> dict:
    llm = LLM(loaded=loaded, enable_prefix_caching=caching, kv_cache_gib=1.0)
    llm.generate([[2, 5, 6]], SamplingParams(max_tokens=2))  # warm-up, shares nothing with the prompts
    engine = llm.engine
    before = engine.num_prompt_tokens_computed
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    ttfts = [o.metrics.ttft for o in outs]
    stats = engine.stats()
    return {"caching": caching, "prompt_tokens_computed": engine.num_prompt_tokens_computed - before,
            "mean_ttft_s": sum(ttfts) / len(ttfts), "wall_s": wall, "prefix_cache_hits": stats["prefix_cache_hits"],
            "tokens": [o.token_ids for o in outs]}


def main(args) -> int:
    loaded = load_model(args.model, args.dtype)
    cfg = loaded.config
    prompts = make_requests(args.num_prompts, args.shared_len, args.unique_len, cfg.vocab_size, cfg.bos_token_id,
                            args.seed)
    off = run(loaded, prompts, args.output_len, caching=False)
    on = run(loaded, prompts, args.output_len, caching=True)
    if on["tokens"] != off["tokens"]:
        raise AssertionError("prefix caching changed the greedy outputs")
    total_shared = args.num_prompts * args.shared_len
    unique = args.num_prompts * args.unique_len
    shared_on = on["prompt_tokens_computed"] - unique
    shared_off = off["prompt_tokens_computed"] - unique
    saved = 1 - shared_on / shared_off
    print(f"{args.num_prompts} requests: {args.shared_len}-token shared prefix + {args.unique_len} own tokens, "
          f"{args.output_len} output tokens each (identical outputs with and without the cache)")
    print("| prefix cache | prompt tokens computed | of which shared prefix | mean TTFT (s) | wall (s) |")
    print("|---|---|---|---|---|")
    for r, shared in ((off, shared_off), (on, shared_on)):
        print(f"| {'on' if r['caching'] else 'off'} | {r['prompt_tokens_computed']} | {shared} of {total_shared} | "
              f"{r['mean_ttft_s']:.2f} | {r['wall_s']:.1f} |")
    print(f"shared-prefix computation saved: {saved:.1%}; mean TTFT {off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x lower")
    if args.json:
        Path(args.json).write_text(json.dumps({"off": {k: v for k, v in off.items() if k != "tokens"},
                                               "on": {k: v for k, v in on.items() if k != "tokens"},
                                               "shared_saved": saved}, indent=1))
    return 0
