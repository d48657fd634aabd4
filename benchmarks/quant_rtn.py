"""RTN weight quantization of Gemma 3 270M: quality, size and batch-1 decode speed, side by side.

Configurations (all from one float32 load of the bundled GGUF, dequantized = the baseline):
  fp32                  the baseline
  rtn-int8              8-bit symmetric per-channel (torch's int8 weight-only kernel)
  rtn-int4-g128         4-bit asymmetric, groups of 128 (torch's CPU int4 kernel)
  rtn-int4-g128+head    the same plus the (tied) LM head quantized to 4 bits
Transformer-block linears are quantized; the embedding lookup stays fp32.

Per configuration:
  * WikiText-2 raw test PPL (BOS + seqlen-1 text tokens per window, non-overlapping,
    --max-windows windows) and KL(fp32 || quantized) of the next-token distribution, from one
    pass over the same windows (kvserve.tools.eval.ppl.kl_divergence).
  * resident weight bytes and weight bytes read per decode token (the embedding table is read a
    row at a time once the head is a separate quantized module).
  * batch-1 greedy decode tok/s through the engine (LLM(loaded=...)), interleaved rounds (every
    configuration once per round, a new prompt each round), median of the rounds; and how many
    of those greedy outputs equal fp32's token for token.

    OMP_NUM_THREADS=1 python benchmarks/quant_rtn.py [--seqlen 512] [--max-windows 20] [--rounds 5]
        [--new-tokens 64] [--configs fp32,rtn-int8,...] [--skip-ppl] [--json-dir results]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _common import machine, save_json

from kvserve import LLM, SamplingParams
from kvserve.compress.quant import model_weight_bytes, quantize_model
from kvserve.loading import LoadedModel, load_model
from kvserve.tools.eval.ppl import (
    dataset_path,
    kl_divergence,
    perplexity,
    tokenize_file,
)

CONFIGS = {
    "fp32": None,
    "rtn-int8": dict(bits=8, sym=True, granularity="channel"),
    "rtn-int4-g128": dict(bits=4, sym=False, granularity="group", group_size=128),
    "rtn-int4-g128+head": dict(bits=4, sym=False, granularity="group", group_size=128, lm_head=True),
    "rtn-int8+head": dict(bits=8, sym=True, granularity="channel", lm_head=True),
}
PROMPTS = [
    "The history of the Roman Empire",
    "In mathematics, a prime number is",
    "The best way to learn a new language is",
    "Photosynthesis is the process by which",
    "The first computers were",
    "A recipe for a simple tomato soup:",
    "The river flows through the valley and",
    "Quantum mechanics describes",
]


def decode_read_bytes(model) -> int:
    """Weight bytes one batch-1 decode step reads: every stored tensor except an embedding table
    that is no longer the head (its lookup reads one row)."""
    total = model_weight_bytes(model)
    if model.lm_head is not None and model.config.tie_word_embeddings:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--configs", default="fp32,rtn-int8,rtn-int4-g128,rtn-int4-g128+head")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or "fp32" not in names:
        raise SystemExit(f"--configs: choose from {', '.join(CONFIGS)} (fp32 required), got {unknown or names}")

    base = load_model()
    emb = base.model.embed_tokens.weight
    models, quant = {}, {}
    for name in names:
        if CONFIGS[name] is None:
            models[name] = base.model
            continue
        m = copy.deepcopy(base.model, memo={id(emb): emb})  # the embedding table is shared, unquantized
        quant[name] = quantize_model(m, "rtn", progress=False, **CONFIGS[name]).to_dict()
        models[name] = m
    print(machine())

    rows = {n: {"weight_bytes": model_weight_bytes(m), "decode_read_bytes": decode_read_bytes(m),
                "quant": quant.get(n)} for n, m in models.items()}

    if not args.skip_ppl:
        tokens = tokenize_file(base.tokenizer, dataset_path())
        bos = base.config.bos_token_id
        for n, m in models.items():
            t = time.perf_counter()
            if n == "fp32":
                r = perplexity(m, tokens, args.seqlen, bos_token_id=bos, max_windows=args.max_windows,
                               batch_size=args.batch_size)
            else:
                r = kl_divergence(m, base.model, tokens, args.seqlen, bos_token_id=bos, max_windows=args.max_windows,
                                  batch_size=args.batch_size)
            rows[n].update(ppl=r.ppl, kl=r.kl_mean if n != "fp32" else 0.0, top1_agree=r.top1_agree,
                           windows=r.num_windows, tokens=r.num_tokens, ppl_seconds=time.perf_counter() - t)
            print(f"{n}: PPL {r.ppl:.3f} KL {rows[n]['kl']:.4f} ({r.num_windows} x {r.seqlen}, "
                  f"{rows[n]['ppl_seconds']:.0f} s)", flush=True)

    llms = {n: LLM(loaded=LoadedModel(m, base.config, base.tokenizer, base.source), enable_prefix_caching=False,
                   max_num_seqs=1, kv_cache_gib=0.25) for n, m in models.items()}
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for llm in llms.values():  # warm up
        llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    speed: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {n: [] for n in names}
    for r in range(args.rounds):
        prompt = PROMPTS[r % len(PROMPTS)]
        for n, llm in llms.items():
            out = llm.generate(prompt, params)[0]
            speed[n].append(1 / out.metrics.tpot)
            outputs[n].append(out.outputs[0].token_ids)
    for n in names:
        same = sum(a == b for a, b in zip(outputs[n], outputs["fp32"]))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(outputs[n], outputs["fp32"])]
        rows[n].update(decode_tok_s=statistics.median(speed[n]), decode_runs=speed[n],
                       greedy_equal_fp32=f"{same}/{len(outputs[n])}",
                       greedy_common_prefix_mean=sum(prefix) / len(prefix))

    fp = rows["fp32"]
    print(f"\nGemma 3 270M, WikiText-2 test, seqlen {args.seqlen}, {args.max_windows} windows (BOS per window); "
          f"batch-1 greedy decode of {args.new_tokens} tokens, median of {args.rounds} interleaved rounds\n")
    head = ["config", "PPL", "KL(fp32||q)", "weights MB", "read/token MB", "decode tok/s", "vs fp32",
            "greedy = fp32"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for n in names:
        r = rows[n]
        print(f"| {n} | {r.get('ppl', float('nan')):.3f} | {r.get('kl', float('nan')):.4f} | "
              f"{r['weight_bytes'] / 1e6:.1f} | {r['decode_read_bytes'] / 1e6:.1f} | {r['decode_tok_s']:.1f} | "
              f"{r['decode_tok_s'] / fp['decode_tok_s']:.2f}x | {r['greedy_equal_fp32']} |")
    save_json("quant_rtn", {"seqlen": args.seqlen, "max_windows": args.max_windows, "rounds": args.rounds,
                            "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "configs": rows},
              args.json_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
