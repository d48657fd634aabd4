"""torch.compile of the forward pass (EngineConfig.compile) against the eager paths, in turns in one
process so a slow spell of the host lands on all of them:

- `kernels`: the default, fp32 weights packed for kvserve's C decode-step kernels (batch-1 decode is
  one C call for the layer stack, model/decode_plan.py);
- `compile`: torch.compile (inductor) of the forward pass, attention an opaque op per layer, the
  body's matmuls PyTorch's (MKL), the LM head packed (its kernel and greedy screen, outside the graph);
- `eager`: the same weights and head as `compile`, the same forward eagerly (the compile engine with
  its compiled graph set aside): what compiling alone buys.

Per round and engine: batch-1 decode (fresh 32-token prompt, --output-len new tokens), a fresh
512-token prefill (TTFT), and an offline batch (--batch requests, inputs 32-512, outputs 32-128).

    python benchmarks/compile_ab.py [--rounds 3] [--batch 16] [--json-dir results]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from _common import machine, median, save_json
from kvserve import LLM, SamplingParams
from kvserve.bench.throughput import make_workload
from kvserve.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="requests of the offline batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    common = dict(enable_prefix_caching=False, max_num_seqs=64)
    llms = {"kernels": LLM(loaded=load_model(None), **common)}
    shared = load_model(None)  # compile and eager: the same unpacked body, packed head
    llms["compile"] = LLM(loaded=shared, compile=True, **common)
    llms["eager"] = LLM(loaded=shared, compile=True, **common)
    llms["eager"].engine.runner.compiled = None
    vocab, rng = shared.config.vocab_size, random.Random(0)
    greedy = dict(temperature=0, ignore_eos=True)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    warmup = {}
    for name, llm in llms.items():  # a prompt, then one-row and two-row steps: every shape class
        t = time.perf_counter()
        llm.generate([fresh(16)], SamplingParams(max_tokens=2, **greedy))
        llm.generate([fresh(16), fresh(24)], SamplingParams(max_tokens=2, **greedy))
        warmup[name] = time.perf_counter() - t
        print(f"{name:8s} warm-up {warmup[name]:.1f} s", flush=True)

    wl = make_workload(args.batch, (32, 512), (32, 128), vocab, shared.config.bos_token_id, 1)
    batch_params = [SamplingParams(max_tokens=n, **greedy) for n in wl.output_lens]
    runs: dict[str, dict[str, list[float]]] = {n: {"decode_tok_s": [], "prefill_tok_s": [], "batch_tok_s": []}
                                               for n in llms}
    tokens: dict[str, list[list[int]]] = {}
    order = list(llms)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            llm = llms[name]
            out = llm.generate([fresh(32)], SamplingParams(max_tokens=args.output_len, **greedy))[0]
            runs[name]["decode_tok_s"].append(1 / out.metrics.tpot)
            out = llm.generate([fresh(args.prefill_len)], SamplingParams(max_tokens=1, **greedy))[0]
            runs[name]["prefill_tok_s"].append(args.prefill_len / out.metrics.ttft)
            t = time.perf_counter()
            outs = llm.generate(wl.prompts, batch_params)
            runs[name]["batch_tok_s"].append(wl.output_tokens / (time.perf_counter() - t))
            tokens[name] = [o.token_ids for o in outs]
            print(f"round {r} {name:8s} " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs[name].items()), flush=True)
    summary = {name: {k: median(v) for k, v in got.items()} | {"warmup_s": warmup[name], "runs": got}
               for name, got in runs.items()}
    same = {name: sum(a == b for a, b in zip(tokens[name], tokens["kernels"])) for name in llms}
    print(f"\n| engine | warm-up s | batch-1 decode tok/s | {args.prefill_len}-token prefill tok/s | "
          f"{args.batch} requests, output tok/s | requests equal to kernels |")
    print("|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['warmup_s']:.1f} | {s['decode_tok_s']:.2f} | {s['prefill_tok_s']:.1f} | "
              f"{s['batch_tok_s']:.1f} | {same[name]}/{args.batch} |")
    for k in ("decode_tok_s", "prefill_tok_s", "batch_tok_s"):
        print(f"{k}: compile / eager {summary['compile'][k] / summary['eager'][k]:.2f}x, "
              f"compile / kernels {summary['compile'][k] / summary['kernels'][k]:.2f}x")
    print(machine())
    save_json("compile_ab", {"args": vars(args), "summary": summary, "equal_to_kernels": same}, args.json_dir)


if __name__ == "__main__":
    main()
