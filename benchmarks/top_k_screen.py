"""Top-k and penalized sampling through the head's int8 screen: what it saves, batch-1 and offline.

A row sampled under top-k draws from its k largest logits alone (a greedy row from its largest),
so the fp32 head's screen (kvserve/kernels/greedy_head.c, `screen_top_k`) bounds every logit and
computes exactly only the tokens that can be among the k, and those a repetition penalty (or any
other penalty or bias) changes. The bundled Gemma 3 270M in fp32 (its head is 671 MB of a batch-1
step's ~1 GB), each setting with the screen and without it (the full head), in turns:

1. decode at batch 1 and 8: 128 new tokens per request after a 33-token prompt, seeded, output
   tok/s (median), and whether both paths drew the same tokens; top-k settings, and greedy and
   Ollama's defaults with a repetition penalty;
2. `kvserve bench throughput`'s offline workload (64 requests, inputs 32-512, outputs 32-256,
   random ids) for the top-k settings: output tok/s (median).

    cd benchmarks && ../.venv/bin/python top_k_screen.py --json-dir results
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager, nullcontext

from _common import machine, median, save_json
from kvserve import LLM
from kvserve.engine.model_runner import ModelRunner
from kvserve.loading import load_model
from kvserve.tools.bench.throughput import INPUT_RANGE, OUTPUT_RANGE, Sampling, make_workload, run_kvserve

SETTINGS = [Sampling(0.7, top_k=50), Sampling(0.8, top_p=0.95, top_k=40, min_p=0.05)]  # HF's top-k; llama.cpp's chain
PENALIZED = [Sampling(repetition_penalty=1.1), Sampling(0.8, top_p=0.9, top_k=40, repetition_penalty=1.1)]  # greedy; Ollama's
PROMPT = [2] + list(range(1000, 1032))


@contextmanager
def full_head():
    """Top-k rows computing every logit: the screen turned off for them."""
    saved = ModelRunner.screen_top_k
    ModelRunner.screen_top_k = property(lambda self: (0, 0, 0))
    try:
        yield
    finally:
        ModelRunner.screen_top_k = saved


def decode(llm: LLM, s: Sampling, batch: int) -> tuple[float, list[list[int]]]:
    """`batch` seeded requests of 128 new tokens at once -> (output tok/s, their tokens)."""
    params = [s.params(128) for _ in range(batch)]
    for i, p in enumerate(params):
        p.seed = 1 + i
    prompts = [[PROMPT[0], 1000 + 7 * i] + PROMPT[2:] for i in range(batch)]
    t = time.perf_counter()
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    return 128 * batch / (time.perf_counter() - t), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="batch-1 runs per setting and path")
    ap.add_argument("--engine-repeats", type=int, default=2, help="offline runs per setting and path (0: skip)")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    print(machine())
    loaded = load_model(None, "float32")
    llm = LLM(loaded=loaded)
    decode(llm, Sampling(), 1)  # warm-up
    rows = []
    for batch in (1, 8):
        for s in SETTINGS + PENALIZED:
            runs: dict[str, list[float]] = {"screen": [], "full head": []}
            tokens: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):
                for path in runs:
                    with full_head() if path == "full head" else nullcontext():
                        rate, tokens[path] = decode(llm, s, batch)
                    runs[path].append(round(rate, 2))
                    print(f"batch-{batch}", s, path, f"{rate:.1f} tok/s", flush=True)
            rows.append({"setting": str(s), "metric": f"batch-{batch} decode output tok/s",
                         **{k: round(median(v), 2) for k, v in runs.items()}, "runs": runs,
                         "same_tokens": tokens["screen"] == tokens["full head"]})
    llm.engine.close()
    cfg = loaded.config
    wl = make_workload(64, INPUT_RANGE, OUTPUT_RANGE, cfg.vocab_size, cfg.bos_token_id, 0)
    for s in SETTINGS if args.engine_repeats else []:
        runs = {"screen": [], "full head": []}
        for _ in range(args.engine_repeats):
            for path in runs:
                with full_head() if path == "full head" else nullcontext():
                    r = run_kvserve(loaded, wl, s, max_num_seqs=64, enable_prefix_caching=False)
                runs[path].append(round(r.output_tok_s, 1))
                print("offline", s, path, f"{r.output_tok_s:.1f} output tok/s", flush=True)
        rows.append({"setting": str(s), "metric": "offline output tok/s", **{k: round(median(v), 2) for k, v in runs.items()},
                     "runs": runs})
    save_json("top_k_screen", {"rows": rows}, args.json_dir)


if __name__ == "__main__":
    main()
