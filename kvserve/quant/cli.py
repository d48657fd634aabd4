"""`kvserve quantize [MODEL] --method rtn|gptq|awq ... --out DIR`: quantize a model's transformer
blocks (calibrating on WikiText-2 `wiki.valid.tokens` for GPTQ / AWQ, layer by layer) and save
the folder with kvserve.quant.io.save_quantized."""
from __future__ import annotations

import argparse
import json
import time


def add_quantize_parser(sub) -> None:
    """Register `kvserve quantize` on the top-level subparsers `sub`."""
    p = sub.add_parser("quantize", help="quantize a model (RTN, GPTQ, AWQ) and save it to a folder")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq"])
    p.add_argument("--bits", type=int, default=4, help="bits per weight, 2..8")
    p.add_argument("--group-size", type=int, default=128, help="inputs per scale (granularity group)")
    p.add_argument("--granularity", default="group", help="tensor, channel or group")
    p.add_argument("--sym", action="store_true", help="symmetric grid (default asymmetric)")
    p.add_argument("--act-order", action="store_true",
                   help="gptq: columns by decreasing Hessian diagonal (with groups: g_idx, dequant kernel "
                        "unless --static-groups)")
    p.add_argument("--static-groups", action="store_true", help="gptq: group grids fixed from the original weights")
    p.add_argument("--damp", type=float, default=0.01, help="gptq: dampening, fraction of mean diag(H)")
    p.add_argument("--nsamples", type=int, default=128, help="calibration windows")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration window, BOS included")
    p.add_argument("--seed", type=int, default=0, help="calibration window sampling seed")
    p.add_argument("--awq-search-windows", type=int, default=8,
                   help="awq: calibration windows the scale search runs on (CPU time grows with it)")
    p.add_argument("--calib-file", default=None, help="calibration text (default: WikiText-2 wiki.valid.tokens)")
    p.add_argument("--quant-lm-head", action="store_true", help="quantize the LM head too")
    p.add_argument("--kernel", default="auto", help="auto, int4, int8 or dequant")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--json", default=None, help="write the quantization report here")


def run(args: argparse.Namespace) -> int:
    from kvserve.loading import load_model
    from kvserve.quant.apply import quantize_model
    from kvserve.quant.calibrate import load_calibration

    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    try:
        from kvserve.quant.io import save_quantized
    except ImportError:
        raise ValueError("saving needs kvserve.quant.io (save_quantized), which this checkout does not have") from None
    loaded = load_model(args.model_path or args.model)
    options, calibration = {}, None
    if args.method in ("gptq", "awq"):
        calibration = load_calibration(loaded.tokenizer, args.nsamples, args.calib_seqlen, args.seed,
                                       loaded.config.bos_token_id, args.calib_file)
    if args.method == "gptq":
        options = {"percdamp": args.damp, "act_order": args.act_order, "static_groups": args.static_groups}
    elif args.method == "awq":
        options = {"search_windows": args.awq_search_windows}
    t0 = time.perf_counter()
    report = quantize_model(loaded.model, args.method, bits=args.bits, group_size=args.group_size, sym=args.sym,
                            granularity=args.granularity, kernel=args.kernel, lm_head=args.quant_lm_head,
                            calibration=calibration, method_options=options)
    seconds = time.perf_counter() - t0
    out = save_quantized(loaded, args.out)
    info = {**report.to_dict(), "calibration": None if calibration is None else
            {"nsamples": args.nsamples, "seqlen": args.calib_seqlen, "seed": args.seed}, "seconds": seconds,
            "out": str(out)}
    print(f"{args.method} {report.spec.label()}: {len(report.layers)} layers in {seconds:.1f} s, "
          f"{report.bytes_before / 1e6:.1f} MB -> {report.bytes_after / 1e6:.1f} MB, saved to {out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0
