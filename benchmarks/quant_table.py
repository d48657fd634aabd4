"""The quantization table of Gemma 3 270M: quality, bytes, batch-1 decode speed and greedy agreement
of every method side by side.

Configurations (`--configs`, comma separated):
  fp32                        the bundled GGUF dequantized: the baseline (required)
  rtn-int8 | rtn-int4-g128 | rtn-int3-g128
                              RTN of the transformer-block linears (int8: symmetric per channel)
  ...+head / ...+head+emb     the tied LM head quantized too / and the embedding lookup reading
                              the head's codes (the fp32 table freed)
  naive-w8a8 | sq-w8a8 | absmax-int8 | llm-int8
                              W8A8 and int8 activation schemes (benchmarks/quant_w8a8.py)
  NAME=DIR                    a folder written by `kvserve quantize` (GPTQ, AWQ, QAT, ...)

Per configuration: WikiText-2 raw test PPL over --max-windows windows of --seqlen tokens (BOS per
window) with KL(fp32 || config) and top-1 agreement in one pass (only for --ppl-configs, default
all: PPL is the slow part); resident weight bytes and bytes read per decode token; batch-1 greedy
decode tok/s through the engine, every configuration once per round (interleaved, a new prompt
each round), median of --rounds; and greedy agreement with fp32 on --greedy-prompts prompts
(`--greedy-tokens` tokens each, all prompts in one batch): how many outputs are equal token for
token and the mean length of the common prefix.

    OMP_NUM_THREADS=1 python benchmarks/quant_table.py --configs fp32,rtn-int8,gptq8=/tmp/gptq8 \
        [--ppl-configs ...] [--rounds 5] [--new-tokens 64] [--greedy-prompts 16] [--greedy-tokens 32]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from _common import machine, save_json
from quant_rtn import PROMPTS as SPEED_PROMPTS
from quant_w8a8 import apply as apply_w8a8
from quant_w8a8 import calibration as w8a8_calibration

from kvserve import LLM, SamplingParams
from kvserve.compress.quant import model_weight_bytes, quantize_model
from kvserve.loading import LoadedModel, load_model
from kvserve.tools.eval.ppl import dataset_path, evaluate, tokenize_file
from kvserve.weights.embedding import QuantEmbedding

RTN = {"rtn-int8": dict(bits=8, sym=True, granularity="channel"),
       "rtn-int4-g128": dict(bits=4, group_size=128),
       "rtn-int3-g128": dict(bits=3, group_size=128)}
W8A8 = ("naive-w8a8", "sq-w8a8", "absmax-int8", "llm-int8")
GREEDY_PROMPTS = SPEED_PROMPTS + [
    "The capital of France is",
    "Water boils at a temperature of",
    "The main causes of the First World War were",
    "To install the package, run",
    "Once upon a time, in a small village,",
    "The theory of evolution states that",
    "Machine learning is a field of",
    "The Great Wall of China was built",
]


def rtn_recipe(name: str) -> dict | None:
    base, *extras = name.split("+")
    if base not in RTN or set(extras) - {"head", "emb"} or ("emb" in extras and "head" not in extras):
        return None
    return {**RTN[base], "lm_head": "head" in extras, "embedding": "emb" in extras}


def decode_read_bytes(model) -> int:
    """Weight bytes one batch-1 decode step reads: every stored tensor except an embedding table
    that is not also the head (its lookup reads one row)."""
    total = model_weight_bytes(model)
    emb = model.embed_tokens
    if model.lm_head is not None and not isinstance(emb, QuantEmbedding):
        total -= emb.weight.numel() * emb.weight.element_size()
    elif isinstance(emb, QuantEmbedding) and not emb.tied:
        total -= emb.weight_nbytes
    return total


def build(name: str, base, amax_fn):
    """-> (model, description) for one configuration name."""
    if name == "fp32":
        return base.model, "float32"
    if "=" in name:
        label, folder = name.split("=", 1)
        return load_model(folder).model, f"folder {folder}"
    emb = base.model.embed_tokens.weight
    m = copy.deepcopy(base.model, memo={id(emb): emb})  # the fp32 table is shared until replaced
    recipe = rtn_recipe(name)
    if recipe is not None:
        quantize_model(m, "rtn", progress=False, **recipe)
        return m, f"rtn {recipe}"
    if name in W8A8:
        apply_w8a8(name, m, amax_fn(), 0.5)
        return m, name
    raise SystemExit(f"--configs: unknown configuration {name!r} (see --help)")


def label_of(name: str) -> str:
    return name.split("=", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="fp32,rtn-int8,rtn-int4-g128,rtn-int4-g128+head+emb")
    ap.add_argument("--ppl-configs", default=None, help="configurations to score (default: all; 'none' for none)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--greedy-prompts", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "fp32" not in names:
        raise SystemExit("--configs must include fp32 (the baseline)")
    labels = [label_of(n) for n in names]
    scored = set(labels) if args.ppl_configs is None else \
        set() if args.ppl_configs == "none" else {c.strip() for c in args.ppl_configs.split(",")}
    print(machine(), flush=True)

    base = load_model()
    amax_cache: list = []

    def amax():
        if not amax_cache:
            from kvserve.compress.quant.smoothquant import collect_act_absmax
            amax_cache.append(collect_act_absmax(base.model, w8a8_calibration(base.tokenizer, base.config.bos_token_id,
                                                                               16, 512)))
        return amax_cache[0]

    models, rows = {}, {}
    for name, label in zip(names, labels):
        m, desc = build(name, base, amax)
        models[label] = m
        rows[label] = {"config": desc, "weight_bytes": model_weight_bytes(m), "decode_read_bytes": decode_read_bytes(m)}
        print(f"{label}: {desc}, {rows[label]['weight_bytes'] / 1e6:.1f} MB", flush=True)

    tokens = tokenize_file(base.tokenizer, dataset_path())
    for label, m in models.items():
        if label not in scored:
            continue
        t = time.perf_counter()
        r = evaluate(m, tokens, args.seqlen, reference=None if label == "fp32" else base.model,
                     bos_token_id=base.config.bos_token_id, max_windows=args.max_windows, batch_size=args.batch_size,
                     progress=False)
        rows[label].update(ppl=r.ppl, kl=r.kl_mean or 0.0, top1_agree=r.top1_agree, windows=r.num_windows,
                           tokens=r.num_tokens, ppl_seconds=time.perf_counter() - t)
        print(f"{label}: PPL {r.ppl:.3f} KL {rows[label]['kl']:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)

    llms = {n: LLM(loaded=LoadedModel(m, base.config, base.tokenizer, base.source), enable_prefix_caching=False,
                   max_num_seqs=max(1, args.greedy_prompts), kv_cache_gib=0.25) for n, m in models.items()}
    # Greedy agreement: all prompts in one batch per configuration.
    prompts = (GREEDY_PROMPTS * (1 + args.greedy_prompts // len(GREEDY_PROMPTS)))[:args.greedy_prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True)
    outs = {n: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] for n, llm in llms.items()}
    for n in labels:
        pairs = list(zip(outs[n], outs["fp32"]))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs]
        rows[n].update(greedy_equal=sum(a == b for a, b in pairs), greedy_prompts=len(pairs),
                       greedy_prefix_mean=sum(prefix) / len(prefix))
    # Batch-1 decode speed, interleaved rounds.
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    speed: dict[str, list[float]] = {n: [] for n in labels}
    for r in range(args.rounds):
        prompt = SPEED_PROMPTS[r % len(SPEED_PROMPTS)]
        for n, llm in llms.items():
            speed[n].append(1 / llm.generate(prompt, params)[0].metrics.tpot)
    for n in labels:
        rows[n].update(decode_tok_s=statistics.median(speed[n]), decode_runs=speed[n])

    fp = rows["fp32"]
    print(f"\nGemma 3 270M, WikiText-2 test, seqlen {args.seqlen}, {args.max_windows} windows (BOS per window); "
          f"batch-1 greedy decode of {args.new_tokens} tokens, median of {args.rounds} interleaved rounds; greedy "
          f"agreement on {len(prompts)} prompts x {args.greedy_tokens} tokens\n")
    head = ["config", "PPL", "KL", "top-1", "weights MB", "read/token MB", "decode tok/s", "vs fp32",
            "greedy = fp32", "common prefix"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for n in labels:
        r = rows[n]
        ppl = f"{r['ppl']:.3f} | {r['kl']:.4f} | " + ("—" if r["top1_agree"] is None else f"{r['top1_agree']:.1%}") \
            if "ppl" in r else "— | — | —"
        print(f"| {n} | {ppl} | {r['weight_bytes'] / 1e6:.1f} | {r['decode_read_bytes'] / 1e6:.1f} | "
              f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / fp['decode_tok_s']:.2f}x | "
              f"{r['greedy_equal']}/{r['greedy_prompts']} | {r['greedy_prefix_mean']:.1f} |")
    save_json("quant_table", {"seqlen": args.seqlen, "max_windows": args.max_windows, "rounds": args.rounds,
                              "new_tokens": args.new_tokens, "greedy_tokens": args.greedy_tokens,
                              "threads": torch.get_num_threads(), "configs": rows}, args.json_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
