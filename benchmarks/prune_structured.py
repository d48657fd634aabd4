"""Structured (Minitron-style) pruning of Gemma 3 270M before healing: size, quality and batch-1
decode speed of each smaller dense model, side by side with the unpruned one.

Importance is computed ONCE on the original fp32 model (heads, MLP neurons, embedding channels
and 1 - cos(in, out) per layer, one pass over --nsamples random windows of --calib-seqlen tokens
of WikiText-2 wiki.valid.tokens) and every variant is cut from the same scores:

  width-ffn        ffn_keep 0.6 (2048 -> 1216 neurons per layer)
  width-head-ffn   1 of 4 query heads per layer + ffn_keep 0.66 (-> 1344)
  width-hidden     hidden_keep 0.7 (640 -> 448 channels)
  width-hidden-ffn hidden_keep 0.8 (512) + ffn_keep 0.8125 (1664)
  depth-2, depth-4 the 2 / 4 blocks with the lowest 1 - cos(block input, block output)

(each width variant is ~70% of the non-embedding parameters). Per model:
  * non-embedding and total parameters
  * WikiText-2 raw test PPL, KL(fp32 || pruned) and top-1 agreement (seqlen 512, --max-windows
    windows, BOS first; one pass with the reference, kvserve.tools.eval.ppl.evaluate)
  * batch-1 greedy decode tok/s through the engine (LLM(loaded=...)), --new-tokens tokens,
    interleaved rounds (every model once per round, a new prompt each round), median.
With --save-dir each pruned model is written as a model folder (save_model) for later healing.

    OMP_NUM_THREADS=1 python benchmarks/prune_structured.py [--nsamples 32] [--calib-seqlen 512]
        [--max-windows 20] [--rounds 5] [--new-tokens 64] [--variants ...] [--save-dir DIR]
        [--json-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import machine, save_json
from quant_rtn import PROMPTS

from kvserve import LLM, SamplingParams
from kvserve.compress.prune.importance import compute_importance
from kvserve.compress.prune.structured import count_params, structured_prune
from kvserve.loading import load_model
from kvserve.loading.save import save_model
from kvserve.tools.eval.ppl import dataset_path, evaluate, tokenize_file

VARIANTS = {
    "width-ffn": dict(ffn_keep=0.6),
    "width-head-ffn": dict(prune_heads=1, ffn_keep=0.66),
    "width-hidden": dict(hidden_keep=0.7),
    "width-hidden-ffn": dict(hidden_keep=0.8, ffn_keep=0.8125),
    "depth-2": dict(drop_layers=2),
    "depth-4": dict(drop_layers=4),
}


def shape(cfg) -> str:
    return (f"L{cfg.num_layers} d{cfg.hidden_size} H{cfg.num_heads}/{cfg.num_kv_heads} "
            f"ffn{cfg.intermediate_size}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--criterion", default="activation", choices=("activation", "contribution"),
                    help="how heads / neurons are ranked (kvserve/compress/prune/importance.py)")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--save-dir", default=None)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: choose from {', '.join(VARIANTS)}, got {unknown}")
    print(machine(), flush=True)

    from kvserve.compress.quant.calibrate import load_calibration

    base = load_model()
    cfg = base.config
    windows = load_calibration(base.tokenizer, args.nsamples, args.calib_seqlen, seed=0, bos_token_id=cfg.bos_token_id)
    t = time.perf_counter()
    imp = compute_importance(base.model, windows)
    imp_s = time.perf_counter() - t
    print(f"importance: {imp.num_windows} x {args.calib_seqlen} tokens in {imp_s:.0f} s; layer 1-cos: "
          + " ".join(f"{x:.3f}" for x in imp.layers.tolist()), flush=True)

    models = {"unpruned": base}
    rows: dict[str, dict] = {"unpruned": {"args": {}}}
    for n in names:
        t = time.perf_counter()
        models[n] = structured_prune(base, calibration=None, importance=imp, criterion=args.criterion, **VARIANTS[n])
        rows[n] = {"args": VARIANTS[n], "prune_seconds": time.perf_counter() - t}
        if args.save_dir:
            save_model(models[n], f"{args.save_dir}/{n}")
    emb_base = base.model.embed_tokens.weight
    for n, m in models.items():
        c = m.config
        non_emb = count_params(m.model, embedding=False)
        rows[n].update(shape=shape(c), layers_kept=None, params_total=count_params(m.model),
                       params_non_embedding=non_emb)
        if c.num_layers < cfg.num_layers:
            dropped = imp.layers.argsort()[: cfg.num_layers - c.num_layers].tolist()
            rows[n]["layers_kept"] = sorted(set(range(cfg.num_layers)) - set(dropped))
        if n != "unpruned" and m.model.embed_tokens.weight.shape == emb_base.shape and \
                torch.equal(m.model.embed_tokens.weight, emb_base):
            m.model.embed_tokens.weight = emb_base  # share the unchanged 671 MB table (memory only)
    base_non_emb = rows["unpruned"]["params_non_embedding"]
    for n in models:
        rows[n]["non_embedding_fraction"] = rows[n]["params_non_embedding"] / base_non_emb

    if not args.skip_ppl:
        tokens = tokenize_file(base.tokenizer, dataset_path())
        for n, m in models.items():
            t = time.perf_counter()
            r = evaluate(m.model, tokens, args.seqlen, reference=None if n == "unpruned" else base.model,
                         bos_token_id=cfg.bos_token_id, max_windows=args.max_windows, progress=False)
            rows[n].update(ppl=r.ppl, kl=r.kl_mean or 0.0, top1_agree=r.top1_agree if r.top1_agree is not None else 1.0,
                           windows=r.num_windows, tokens=r.num_tokens, ppl_seconds=time.perf_counter() - t)
            print(f"{n}: {rows[n]['shape']} PPL {r.ppl:.3f} KL {rows[n]['kl']:.4f} top1 {rows[n]['top1_agree']:.3f} "
                  f"({rows[n]['ppl_seconds']:.0f} s)", flush=True)

    speed: dict[str, list[float]] = {n: [float("nan")] for n in models}
    llms = {} if args.skip_decode else {
        n: LLM(loaded=m, enable_prefix_caching=False, max_num_seqs=1, kv_cache_gib=0.25) for n, m in models.items()}
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for llm in llms.values():  # warm up
        llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for n in llms:
        speed[n] = []
    for r in range(args.rounds if llms else 0):
        prompt = PROMPTS[r % len(PROMPTS)]
        for n, llm in llms.items():
            out = llm.generate(prompt, params)[0]
            speed[n].append(1 / out.metrics.tpot)
    for n in models:
        rows[n].update(decode_tok_s=statistics.median(speed[n]), decode_runs=speed[n])

    ref = rows["unpruned"]
    print(f"\nGemma 3 270M, structured pruning before healing ({args.criterion} criterion); importance from "
          f"{args.nsamples} x {args.calib_seqlen} wiki.valid windows; WikiText-2 test seqlen {args.seqlen}, "
          f"{args.max_windows} windows (BOS per window); "
          f"batch-1 greedy decode of {args.new_tokens} tokens, median of {args.rounds} interleaved rounds\n")
    head = ["model", "shape", "non-emb params (M)", "vs unpruned", "total params (M)", "PPL", "KL(fp32||pruned)",
            "top-1 agree", "decode tok/s", "speed-up"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for n, r in rows.items():
        print(f"| {n} | {r['shape']} | {r['params_non_embedding'] / 1e6:.1f} | {r['non_embedding_fraction']:.1%} | "
              f"{r['params_total'] / 1e6:.1f} | {r.get('ppl', float('nan')):.2f} | {r.get('kl', float('nan')):.3f} | "
              f"{r.get('top1_agree', float('nan')):.3f} | {r['decode_tok_s']:.1f} | "
              f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x |")
    name = f"prune_structured_{args.criterion}"
    save_json(name, {"criterion": args.criterion, "nsamples": args.nsamples, "calib_seqlen": args.calib_seqlen,
                     "seqlen": args.seqlen, "max_windows": args.max_windows, "rounds": args.rounds,
                     "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
                     "importance_seconds": imp_s, "layer_importance": imp.layers.tolist(),
                     "head_importance": imp.heads.tolist(), "models": rows}, args.json_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
