"""GPTQ and AWQ vs RTN on Gemma 3 270M: WikiText-2 PPL, KL to fp32, calibration time.

Configurations (method-bits-group): rtn-int4-g128, gptq-int4-g128, awq-int4-g128 and the same at
int3 (all asymmetric, groups of 128, transformer-block linears; embedding / tied head fp32).
GPTQ and AWQ calibrate on --nsamples random windows of --calib-seqlen tokens of WikiText-2
`wiki.valid.tokens` (seed --seed), layer by layer, each block fed by the already-quantized ones.
PPL / KL are measured exactly like benchmarks/quant_rtn.py (WikiText-2 raw test, BOS + seqlen-1
text tokens per window, non-overlapping, --max-windows windows), so the rows compare with it.

    OMP_NUM_THREADS=1 python benchmarks/quant_methods.py [--configs gptq-int4-g128,awq-int4-g128]
        [--nsamples 128] [--calib-seqlen 512] [--seqlen 512] [--max-windows 20] [--json-dir results]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from _common import machine, save_json
from quant_rtn import decode_read_bytes

from kvserve.compress.quant import model_weight_bytes, quantize_model
from kvserve.compress.quant.calibrate import load_calibration
from kvserve.loading import load_model
from kvserve.tools.eval.ppl import (
    dataset_path,
    kl_divergence,
    perplexity,
    tokenize_file,
)

METHODS = ("rtn", "gptq", "awq")


def parse_config(name: str) -> tuple[str, int, int]:
    """"gptq-int4-g128" -> ("gptq", 4, 128)."""
    try:
        method, bits, group = name.split("-")
        assert method in METHODS and bits.startswith("int") and group.startswith("g")
        return method, int(bits[3:]), int(group[1:])
    except (ValueError, AssertionError):
        raise SystemExit(f"--configs: expected METHOD-intB-gG with METHOD in {METHODS}, got {name!r}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="gptq-int4-g128,awq-int4-g128")
    ap.add_argument("--baseline", action="store_true", help="also score fp32 (PPL only)")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--act-order", action="store_true", help="gptq: act-order with static groups (int4 kernel)")
    ap.add_argument("--awq-search-windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs = {n: parse_config(n) for n in names}

    base = load_model()
    print(machine(), flush=True)
    bos = base.config.bos_token_id
    tokens = tokenize_file(base.tokenizer, dataset_path())
    calib = None
    if any(m != "rtn" for m, _, _ in configs.values()):
        t = time.perf_counter()
        calib = load_calibration(base.tokenizer, args.nsamples, args.calib_seqlen, args.seed, bos)
        print(f"calibration windows {tuple(calib.shape)} in {time.perf_counter() - t:.1f} s", flush=True)
    rows: dict[str, dict] = {}
    if args.baseline:
        r = perplexity(base.model, tokens, args.seqlen, bos_token_id=bos, max_windows=args.max_windows,
                       batch_size=args.batch_size, progress=False)
        rows["fp32"] = {"ppl": r.ppl, "kl": 0.0, "weight_bytes": model_weight_bytes(base.model)}
        print(f"fp32: PPL {r.ppl:.3f}", flush=True)
    emb = base.model.embed_tokens.weight
    for name, (method, bits, group) in configs.items():
        m = copy.deepcopy(base.model, memo={id(emb): emb})
        options = {}
        if method == "gptq":
            options = {"percdamp": args.damp, "act_order": args.act_order, "static_groups": args.act_order}
        elif method == "awq":
            options = {"search_windows": args.awq_search_windows}
        t = time.perf_counter()
        rep = quantize_model(m, method, bits=bits, group_size=group, calibration=None if method == "rtn" else calib,
                             method_options=options, progress=False)
        qsec = time.perf_counter() - t
        r = kl_divergence(m, base.model, tokens, args.seqlen, bos_token_id=bos, max_windows=args.max_windows,
                          batch_size=args.batch_size, progress=False)
        rows[name] = {"method": method, "bits": bits, "group_size": group, "options": options,
                      "quantize_seconds": qsec, "ppl": r.ppl, "ref_ppl": r.ref_ppl, "kl": r.kl_mean,
                      "top1_agree": r.top1_agree, "windows": r.num_windows, "weight_bytes": model_weight_bytes(m),
                      "decode_read_bytes": decode_read_bytes(m), "kernels": rep.kernels()}
        print(f"{name}: PPL {r.ppl:.3f} KL {r.kl_mean:.4f} top1 {r.top1_agree:.3f} (fp32 {r.ref_ppl:.3f}); "
              f"quantize+calibrate {qsec:.0f} s", flush=True)
        del m

    print(f"\nGemma 3 270M, WikiText-2 test, seqlen {args.seqlen}, {args.max_windows} windows (BOS per window); "
          f"calibration {args.nsamples} x {args.calib_seqlen} tokens of wiki.valid.tokens, seed {args.seed}; "
          f"{torch.get_num_threads()} thread(s)\n")
    head = ["config", "PPL", "KL(fp32||q)", "top-1 agree", "weights MB", "quantize s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for n, r in rows.items():
        print(f"| {n} | {r['ppl']:.3f} | {r['kl']:.4f} | {r.get('top1_agree') or 1.0:.3f} | "
              f"{r['weight_bytes'] / 1e6:.1f} | {r.get('quantize_seconds', 0.0):.0f} |")
    save_json("quant_methods", {"seqlen": args.seqlen, "max_windows": args.max_windows, "nsamples": args.nsamples,
                                "calib_seqlen": args.calib_seqlen, "seed": args.seed,
                                "threads": torch.get_num_threads(), "configs": rows}, args.json_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
