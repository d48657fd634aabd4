"""Cross-layer KV sharing (`kvserve convert --share-kv-every N`) on Gemma 3 270M: what the cache
saves, measured in the engine's pool, and what the training-free conversion costs in accuracy.

Variants: the original; every 2 (runs of 2 same-type layers, kept projection copied or averaged);
every 3 (copied). Per variant:
  * K/V layers kept, KV bytes per token measured in the pool (one layer group, so a slot holds a
    token of every stored layer), and for a fixed --capacity-gib with sliding-window release on:
    pages and 2048-token sequences at their peak;
  * WikiText-2 raw test PPL, KL(original || variant) and top-1 agreement (seqlen 512,
    --max-windows windows, BOS first; kvserve.tools.eval.ppl.evaluate, the quantization-table protocol);
  * batching throughput with a small pool (--throughput-gib) so memory bounds the batch, the
    variants interleaved for --rounds (`kvserve bench throughput`'s workload and runner).
--save-dir writes each converted model (for `kvserve distill --student`).

    OMP_NUM_THREADS=1 python benchmarks/cla_kv.py [--max-windows 20] [--rounds 2] [--json-dir results]
"""
from __future__ import annotations

import argparse
import statistics
import time

from _common import machine, save_json

VARIANTS = {"original": None, "cla2-copy": (2, "copy"), "cla2-mean": (2, "mean"), "cla3-copy": (3, "copy")}


def pool(loaded, capacity_gib: float) -> dict:
    from kvserve import LLM

    one = LLM(loaded=loaded, kv_cache_gib=0.05, sliding_window_release=False).engine
    eng = LLM(loaded=loaded, kv_cache_gib=capacity_gib).engine
    per_seq = eng.block_manager.peak_blocks(2048, eng.config.max_num_batched_tokens)
    return {"kv_layers": list(loaded.config.kv_layers),
            "bytes_per_token": one.kv_cache.nbytes / one.kv_cache.num_slots,
            "pages": eng.num_blocks, "page_bytes": eng.page_bytes,
            "seqs_2048_at_peak": eng.num_blocks // per_seq}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--capacity-gib", type=float, default=1.0)
    ap.add_argument("--throughput-gib", type=float, default=0.1)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--save-dir", default=None)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from kvserve.compress.convert.cla import share_kv
    from kvserve.loading import load_model
    from kvserve.loading.save import save_model
    from kvserve.tools.bench.throughput import make_workload, run_kvserve
    from kvserve.tools.eval.ppl import dataset_path, evaluate, tokenize_file

    print(f"machine: {machine()}", flush=True)
    base = load_model(None)
    names = args.variants.split(",")
    models = {n: base if VARIANTS[n] is None else share_kv(base, *VARIANTS[n]) for n in names}
    for n, m in models.items():
        if m is not base:
            m.model.embed_tokens.weight = base.model.embed_tokens.weight  # unchanged 671 MB table: share it
            if args.save_dir:
                save_model(m, f"{args.save_dir}/{n}")
    rows = {n: pool(m, args.capacity_gib) for n, m in models.items()}
    tokens = tokenize_file(base.tokenizer, dataset_path())
    for n, m in models.items():
        t = time.perf_counter()
        r = evaluate(m.model, tokens, args.seqlen, reference=None if m is base else base.model,
                     bos_token_id=base.config.bos_token_id, max_windows=args.max_windows, progress=False)
        rows[n].update(ppl=r.ppl, kl=r.kl_mean or 0.0, top1_agree=1.0 if r.top1_agree is None else r.top1_agree,
                       ppl_seconds=time.perf_counter() - t)
        print(f"{n}: K/V layers {len(rows[n]['kv_layers'])} bytes/token {rows[n]['bytes_per_token']:.0f} "
              f"PPL {r.ppl:.3f} KL {rows[n]['kl']:.4f} top1 {rows[n]['top1_agree']:.3f}", flush=True)

    if not args.skip_throughput:
        cfg = base.config
        wl = make_workload(args.num_prompts, (256, 512), (64, 128), cfg.vocab_size, cfg.bos_token_id, 0)
        runs = {n: [] for n in models}
        for _ in range(args.rounds):
            for n, m in models.items():
                r = run_kvserve(m, wl, kv_cache_gib=args.throughput_gib, max_num_seqs=64)
                runs[n].append((r.output_tok_s, r.extra["num_preemptions"], r.extra["peak_kv_blocks"]))
                print(f"  {n}: {r.output_tok_s:.1f} output tok/s, preemptions {r.extra['num_preemptions']}",
                      flush=True)
        for n, v in runs.items():
            rows[n].update(output_tok_s=[x[0] for x in v], median_output_tok_s=statistics.median(x[0] for x in v),
                           num_preemptions=[x[1] for x in v])

    base_bytes = rows["original"]["bytes_per_token"] if "original" in rows else None
    print("\n| model | K/V layers | bytes / token (pool) | vs original | pages / 2048-token seqs in "
          f"{args.capacity_gib} GiB | PPL | KL | top-1 | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        ratio = f"{base_bytes / r['bytes_per_token']:.2f}x smaller" if base_bytes else "-"
        tput = f"{r['median_output_tok_s']:.1f}" if "median_output_tok_s" in r else "-"
        print(f"| {n} | {len(r['kv_layers'])} | {r['bytes_per_token']:.0f} | {ratio} | {r['pages']} / "
              f"{r['seqs_2048_at_peak']} | {r['ppl']:.3f} | {r['kl']:.4f} | {100 * r['top1_agree']:.1f}% | {tput} |")
    save_json("cla_kv", dict(args=vars(args), rows=rows), args.json_dir)


if __name__ == "__main__":
    main()
