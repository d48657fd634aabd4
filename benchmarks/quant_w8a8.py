"""W8A8 and int8 activation quantization of Gemma 3 270M, and the quantized-folder round trip.

Configurations (from one float32 load of the bundled GGUF, dequantized = the baseline; the
transformer-block linears are replaced, the tied LM head / embedding stay fp32):
  naive-w8a8         per-tensor int8 weights x per-tensor dynamic int8 activations, no smoothing
  sq-w8a8            SmoothQuant (alpha, folded into the norms / up_proj) + per-channel weights x
                     per-token dynamic activations (O1-like, with per-channel weights)
  sq-w8a8-tensor     SmoothQuant + per-tensor weights x per-tensor dynamic activations
  w8a8-token         per-channel weights x per-token activations, no smoothing
  absmax-int8        LLM.int8() paper's "int8 absmax" baseline (per-tensor X and W)
  vectorwise-int8    per-token X x per-channel W, no outlier decomposition
  llm-int8           vector-wise + outlier columns (|x| >= 6.0) in fp32
Every int8 x int8 product runs on torch._int_mm (int32 accumulation).
SmoothQuant statistics: per-channel max |x| of each linear's input over --calib-samples random
windows of --calib-seqlen tokens of WikiText-2 wiki.valid.tokens (seed 0), with forward hooks.

Per configuration: WikiText-2 raw test PPL over --max-windows windows of --seqlen tokens (BOS per
window), with KL(fp32 || config) and top-1 agreement in the same pass (kvserve.tools.eval.ppl); weight MB.

Round trip (--roundtrip): RTN int4 asym g128 of the blocks, save_quantized to a folder, load it in
a fresh process (timed), compare its logits on a prompt with the in-memory model's, bitwise.

    OMP_NUM_THREADS=1 python benchmarks/quant_w8a8.py [--seqlen 512] [--max-windows 20]
        [--configs naive-w8a8,sq-w8a8,...] [--alpha 0.5] [--no-kl] [--roundtrip] [--json-dir DIR]
"""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import ROOT, machine, save_json

from kvserve.compress.quant import model_weight_bytes, quantize_model
from kvserve.compress.quant.llm_int8 import llm_int8_model, outlier_report
from kvserve.compress.quant.smoothquant import (
    collect_act_absmax,
    smoothquant_model,
    w8a8_model,
)
from kvserve.loading import load_model
from kvserve.tools.eval.ppl import dataset_path, evaluate, tokenize_file

CONFIGS = ["naive-w8a8", "sq-w8a8", "sq-w8a8-tensor", "w8a8-token", "absmax-int8", "vectorwise-int8", "llm-int8"]
PROMPT_IDS = [2, 818, 5279, 529, 506, 11617, 20635, 563, 236764, 1041, 532, 1603]

_FRESH = """
import sys, time, torch
t = time.perf_counter()
from kvserve.loading import load_model
loaded = load_model(sys.argv[1])
load_s = time.perf_counter() - t
sys.path.insert(0, sys.argv[4])
from tests.logits import all_position_logits
torch.save({"logits": all_position_logits(loaded, [int(i) for i in sys.argv[3].split(',')]), "load_s": load_s},
           sys.argv[2])
"""


def calibration(tokenizer, bos: int | None, n: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    path = dataset_path().parent / "wiki.valid.tokens"
    ids = tokenize_file(tokenizer, path)
    step = seqlen - 1 if bos is not None else seqlen
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.shape[0] - step, (n,), generator=g).tolist()
    w = torch.stack([ids[s:s + step] for s in starts])
    return w if bos is None else torch.cat([torch.full((n, 1), bos), w], dim=1)


def apply(name: str, m, amax, alpha: float) -> None:
    if name == "naive-w8a8":
        w8a8_model(m, "tensor", "tensor")
    elif name == "sq-w8a8":
        smoothquant_model(m, amax, alpha, "channel", "token")
    elif name == "sq-w8a8-tensor":
        smoothquant_model(m, amax, alpha, "tensor", "tensor")
    elif name == "w8a8-token":
        w8a8_model(m, "channel", "token")
    elif name == "absmax-int8":
        llm_int8_model(m, "absmax")
    elif name == "vectorwise-int8":
        llm_int8_model(m, "vectorwise")
    elif name == "llm-int8":
        llm_int8_model(m, "llm.int8", threshold=6.0)
    else:
        raise ValueError(name)


def roundtrip(base) -> dict:
    emb = base.model.embed_tokens.weight
    m = copy.deepcopy(base.model, memo={id(emb): emb})
    quantize_model(m, "rtn", bits=4, group_size=128, progress=False)
    from kvserve.loading import LoadedModel
    from kvserve.loading.quantized import save_quantized

    sys.path.insert(0, str(ROOT))
    from tests.logits import all_position_logits

    loaded = LoadedModel(m, base.config, base.tokenizer, base.source)
    want = all_position_logits(loaded, PROMPT_IDS)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gemma-270m-rtn-int4-g128"
        t = time.perf_counter()
        save_quantized(loaded, out)
        save_s = time.perf_counter() - t
        files = {f.name: f.stat().st_size for f in out.iterdir()}
        res = Path(tmp) / "logits.pt"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _FRESH, str(out), str(res), ",".join(map(str, PROMPT_IDS)),
                               str(ROOT)], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        got = torch.load(res)
    from kvserve.loading.cache import entry_dir
    from kvserve.loading.loader import (
        default_model_path,  # the fp32 cache folder, for comparison
    )
    fp32_file = entry_dir("gguf", default_model_path()) / "model.safetensors"
    return {"save_s": save_s, "files": files, "weights_bytes": files.get("model.safetensors"),
            "fp32_weights_bytes": fp32_file.stat().st_size if fp32_file.exists() else None,
            "fresh_process_s": wall, "load_model_s": got["load_s"],
            "logits_equal": bool(torch.equal(got["logits"], want)),
            "logits_max_abs_diff": float((got["logits"] - want).abs().max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--no-kl", action="store_true", help="PPL only (half the time)")
    ap.add_argument("--roundtrip", action="store_true")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: choose from {', '.join(CONFIGS)}, got {bad}")
    print(machine(), flush=True)
    base = load_model()
    emb = base.model.embed_tokens.weight
    rows: dict[str, dict] = {}
    bos = base.config.bos_token_id
    if names:
        tokens = tokenize_file(base.tokenizer, dataset_path())
        t = time.perf_counter()
        amax = collect_act_absmax(base.model, calibration(base.tokenizer, bos, args.calib_samples, args.calib_seqlen))
        calib_s = time.perf_counter() - t
        peak = {k: float(v.max()) for k, v in amax.items()}
        top = sorted(peak.items(), key=lambda kv: -kv[1])[:5]
        print(f"calibration {calib_s:.0f} s; largest input absmax: "
              + ", ".join(f"{k} {v:.0f}" for k, v in top), flush=True)
    for name in names:
        m = copy.deepcopy(base.model, memo={id(emb): emb})
        apply(name, m, amax, args.alpha)
        t = time.perf_counter()
        r = evaluate(m, tokens, args.seqlen, reference=None if args.no_kl else base.model, bos_token_id=bos,
                     max_windows=args.max_windows, batch_size=args.batch_size, progress=False)
        row = {"ppl": r.ppl, "kl": r.kl_mean, "top1_agree": r.top1_agree, "windows": r.num_windows,
               "tokens": r.num_tokens, "seconds": time.perf_counter() - t, "weight_bytes": model_weight_bytes(m)}
        if name == "llm-int8":
            cols = outlier_report(m)
            row["outlier_columns_last_batch"] = {"mean": sum(cols.values()) / len(cols), "max": max(cols.values())}
        rows[name] = row
        print(f"{name}: PPL {r.ppl:.3f}" + ("" if args.no_kl else f" KL {r.kl_mean:.4f} top-1 {r.top1_agree:.1%}")
              + f" ({row['seconds']:.0f} s, {row['weight_bytes'] / 1e6:.1f} MB)", flush=True)
        del m
    if names:
        print(f"\nGemma 3 270M, WikiText-2 test, seqlen {args.seqlen}, {args.max_windows} windows (BOS per window), "
              f"alpha {args.alpha}, calibration {args.calib_samples} x {args.calib_seqlen} wiki.valid.tokens\n")
        print("| config | PPL | KL(fp32||q) | top-1 agree | weights MB |\n|---|---|---|---|---|")
        for n, r in rows.items():
            kl = "—" if r["kl"] is None else f"{r['kl']:.4f}"
            t1 = "—" if r["top1_agree"] is None else f"{r['top1_agree']:.1%}"
            print(f"| {n} | {r['ppl']:.3f} | {kl} | {t1} | {r['weight_bytes'] / 1e6:.1f} |")
    doc = {"seqlen": args.seqlen, "max_windows": args.max_windows, "alpha": args.alpha, "configs": rows,
           "threads": torch.get_num_threads()}
    if args.roundtrip:
        rt = roundtrip(base)
        doc["roundtrip"] = rt
        print(f"\nRTN int4 g128 folder: model.safetensors {rt['weights_bytes'] / 1e6:.1f} MB "
              f"(fp32 cache {rt['fp32_weights_bytes'] / 1e6 if rt['fp32_weights_bytes'] else float('nan'):.1f} MB), "
              f"save {rt['save_s']:.1f} s, fresh-process load_model {rt['load_model_s']:.1f} s "
              f"(whole process {rt['fresh_process_s']:.1f} s), logits equal: {rt['logits_equal']} "
              f"(max |diff| {rt['logits_max_abs_diff']:.3g})", flush=True)
    save_json("quant_w8a8", doc, args.json_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
