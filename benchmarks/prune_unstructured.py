"""Magnitude / Wanda / SparseGPT pruning of Gemma 3 270M at 50% unstructured, 2:4 and 4:8:
WikiText-2 PPL, KL to fp32, top-1 agreement, calibration + pruning time, achieved sparsity.

Transformer-block linears only (the embedding / tied LM head stay dense). Wanda and SparseGPT
calibrate on --nsamples random windows of --calib-seqlen tokens of WikiText-2 `wiki.valid.tokens`
(seed --seed), block by block, each block fed by the already-pruned ones. PPL / KL follow the
quantization tables' protocol (WikiText-2 raw test, BOS + seqlen-1 text tokens per window,
non-overlapping, --max-windows windows). Results are written to the JSON after every config, so
an interrupted run keeps its finished rows.

    OMP_NUM_THREADS=1 python benchmarks/prune_unstructured.py [--configs magnitude-50,wanda-2:4,...]
        [--nsamples 128] [--calib-seqlen 512] [--json-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from _common import machine

from kvserve.compress.prune import prune_model
from kvserve.compress.quant.calibrate import load_calibration
from kvserve.loading import load_model
from kvserve.tools.eval.ppl import dataset_path, kl_divergence, tokenize_file

ALL = [f"{m}-{p}" for m in ("magnitude", "wanda", "sparsegpt") for p in ("50", "2:4", "4:8")]


def parse_config(name: str) -> tuple[str, float | None, str | None]:
    """"wanda-50" -> ("wanda", 0.5, None); "sparsegpt-2:4" -> ("sparsegpt", None, "2:4")."""
    method, _, p = name.partition("-")
    if method not in ("magnitude", "wanda", "sparsegpt") or not p:
        raise SystemExit(f"--configs: expected METHOD-PCT or METHOD-N:M, got {name!r}")
    return (method, None, p) if ":" in p else (method, int(p) / 100, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(ALL))
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--json-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    configs = {n: parse_config(n.strip()) for n in args.configs.split(",") if n.strip()}

    base = load_model()
    print(machine(), flush=True)
    bos = base.config.bos_token_id
    tokens = tokenize_file(base.tokenizer, dataset_path())
    calib = load_calibration(base.tokenizer, args.nsamples, args.calib_seqlen, args.seed, bos)
    out = Path(args.json_dir) / "prune_unstructured.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(), "seqlen": args.seqlen,
           "max_windows": args.max_windows, "nsamples": args.nsamples, "calib_seqlen": args.calib_seqlen,
           "seed": args.seed, "threads": torch.get_num_threads(), "configs": {}}
    if out.is_file():  # resume: keep the rows of an earlier (partial) run
        doc["configs"] = json.loads(out.read_text()).get("configs", {})
    emb = base.model.embed_tokens.weight
    for name, (method, sparsity, pattern) in configs.items():
        if name in doc["configs"]:
            print(f"{name}: already in {out}, skipped", flush=True)
            continue
        m = copy.deepcopy(base.model, memo={id(emb): emb})
        t = time.perf_counter()
        rep = prune_model(m, method, sparsity=sparsity, pattern=pattern,
                          calibration=None if method == "magnitude" else calib, progress=False)
        psec = time.perf_counter() - t
        r = kl_divergence(m, base.model, tokens, args.seqlen, bos_token_id=bos, max_windows=args.max_windows,
                          batch_size=args.batch_size, progress=False)
        errs = [x.rel_output_error for x in rep.layers if x.rel_output_error is not None]
        doc["configs"][name] = {"method": method, "sparsity": sparsity, "pattern": pattern, "ppl": r.ppl,
                                "ref_ppl": r.ref_ppl, "kl": r.kl_mean, "top1_agree": r.top1_agree,
                                "windows": r.num_windows, "prune_seconds": psec,
                                "achieved_sparsity": rep.achieved_sparsity,
                                "mean_rel_output_error": sum(errs) / len(errs) if errs else None}
        print(f"{name}: PPL {r.ppl:.3f} KL {r.kl_mean:.4f} top1 {r.top1_agree:.3f} (fp32 {r.ref_ppl:.3f}); "
              f"sparsity {rep.achieved_sparsity:.4f}; calibrate+prune {psec:.0f} s", flush=True)
        out.write_text(json.dumps(doc, indent=1))
        del m
    print("\n| config | PPL | KL(fp32‖pruned) | top-1 agree | sparsity | calibrate + prune s |")
    print("|---|---|---|---|---|---|")
    for n, r in doc["configs"].items():
        print(f"| {n} | {r['ppl']:.3f} | {r['kl']:.4f} | {r['top1_agree']:.3f} | {r['achieved_sparsity']:.4f} | "
              f"{r['prune_seconds']:.0f} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
