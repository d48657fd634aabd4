"""`kvserve quantize [MODEL] --method rtn|gptq|awq ... --out DIR`: quantize a model's transformer
blocks (calibrating on WikiText-2 `wiki.valid.tokens` for GPTQ / AWQ, layer by layer) and save
the folder with kvserve.loading.quantized.save_quantized."""
from __future__ import annotations

import argparse
import json
import time


def add_quantize_parser(sub) -> None:
    """Register `kvserve quantize` on the top-level subparsers `sub`."""
    p = sub.add_parser("quantize", help="quantize a model (RTN, GPTQ, AWQ) and save it to a folder")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq", "qat"])
    p.add_argument("--bits", type=int, default=4, help="bits per weight, 2..8")
    p.add_argument("--group-size", type=int, default=128, help="inputs per scale (granularity group)")
    p.add_argument("--granularity", default="group", help="tensor, channel or group")
    p.add_argument("--sym", action="store_true", help="symmetric grid (default asymmetric)")
    p.add_argument("--act-order", action="store_true",
                   help="gptq: columns by decreasing Hessian diagonal (with groups: g_idx, dequant kernel "
                        "unless --static-groups)")
    p.add_argument("--static-groups", action="store_true", help="gptq: group grids fixed from the original weights")
    p.add_argument("--damp", type=float, default=0.01, help="gptq: dampening, fraction of mean diag(H)")
    p.add_argument("--nsamples", type=int, default=None, help="calibration windows (default 128; 16 for qat block)")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration window, BOS included")
    p.add_argument("--seed", type=int, default=0, help="calibration window sampling seed")
    p.add_argument("--awq-search-windows", type=int, default=8,
                   help="awq: calibration windows the scale search runs on (CPU time grows with it)")
    p.add_argument("--calib-file", default=None, help="calibration text (default: WikiText-2 wiki.valid.tokens)")
    q = p.add_argument_group("qat (fake quantization + straight-through fine-tune, then packed like RTN)")
    q.add_argument("--qat-mode", choices=["block", "e2e"], default="block",
                   help="block: each block trained to match the float block (MSE) on the calibration windows, "
                        "in order (CPU-friendly); e2e: the whole model, logit distillation or CE")
    q.add_argument("--qat-epochs", type=int, default=2, help="qat block: passes over the calibration windows")
    q.add_argument("--qat-steps", type=int, default=100, help="qat e2e: optimizer steps")
    q.add_argument("--qat-lr", type=float, default=None, help="qat: learning rate (default 3e-6 block, 1e-5 e2e)")
    q.add_argument("--qat-batch-size", type=int, default=None, help="qat: windows per step (default 1 block, 4 e2e)")
    q.add_argument("--qat-seqlen", type=int, default=256, help="qat e2e: tokens per training window, BOS included")
    q.add_argument("--qat-loss", choices=["kd", "ce"], default="kd",
                   help="qat e2e: kd = distill from the unquantized model (KL), ce = next-token cross-entropy")
    q.add_argument("--qat-text-file", default=None, help="qat e2e: training text (default: WikiText-2 wiki.valid.tokens)")
    q.add_argument("--qat-checkpoint", default=None, help="qat e2e: checkpoint file (resumed when it exists)")
    p.add_argument("--quant-lm-head", action="store_true", help="quantize the LM head too")
    p.add_argument("--quant-embedding", action="store_true",
                   help="the embedding lookup reads low-bit codes too (a tied table shares the quantized head's: needs --quant-lm-head)")
    p.add_argument("--kernel", default="auto", help="auto, int4, int8 or dequant")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--json", default=None, help="write the quantization report here")


def run(args: argparse.Namespace) -> int:
    from kvserve.compress.quant.apply import quantize_model
    from kvserve.compress.quant.calibrate import load_calibration
    from kvserve.loading import load_model

    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    try:
        from kvserve.loading.quantized import save_quantized  # noqa: F401  (checked here, used by _save)
    except ImportError:
        raise ValueError("saving needs kvserve.loading.quantized (save_quantized), which this checkout does not have") from None
    if args.method == "rtn":  # read and quantized block by block: no fp32 copy of the model
        streamed = _rtn_streamed(args)
        if streamed is not None:
            return _save(args, *streamed, None, None)
    loaded = load_model(args.model_path or args.model)
    options, calibration = {}, None
    if args.nsamples is None:
        args.nsamples = 16 if args.method == "qat" and args.qat_mode == "block" else 128
    if args.method in ("gptq", "awq") or (args.method == "qat" and args.qat_mode == "block"):
        calibration = load_calibration(loaded.tokenizer, args.nsamples, args.calib_seqlen, args.seed,
                                       loaded.config.bos_token_id, args.calib_file)
    if args.method == "gptq":
        options = {"percdamp": args.damp, "act_order": args.act_order, "static_groups": args.static_groups}
    elif args.method == "awq":
        options = {"search_windows": args.awq_search_windows}
    t0 = time.perf_counter()
    trained = None
    if args.method == "qat":
        report, trained = _run_qat(loaded, args, calibration)
    else:
        report = quantize_model(loaded.model, args.method, bits=args.bits, group_size=args.group_size, sym=args.sym,
                                granularity=args.granularity, kernel=args.kernel, lm_head=args.quant_lm_head,
                                embedding=args.quant_embedding,
                                calibration=calibration, method_options=options)
    return _save(args, loaded, report, time.perf_counter() - t0, calibration, trained)


def _rtn_quantize(model, args: argparse.Namespace, place_block=None):
    from kvserve.compress.quant.apply import quantize_model

    return quantize_model(model, "rtn", bits=args.bits, group_size=args.group_size, sym=args.sym,
                          granularity=args.granularity, kernel=args.kernel, lm_head=args.quant_lm_head,
                          embedding=args.quant_embedding, place_block=place_block)


def _rtn_streamed(args: argparse.Namespace):
    """(model, report, seconds) of RTN applied block by block as the checkpoint is read
    (kvserve/loading/streamed.py; the same folder as loading in fp32 first), or None where the
    source cannot be streamed."""
    from kvserve.loading.loader import resolve_model_path
    from kvserve.loading.streamed import stream_quantize

    path = resolve_model_path(args.model_path or args.model)  # a path, or a name in the HF cache
    t0 = time.perf_counter()
    out = stream_quantize(path, lambda model, place: _rtn_quantize(model, args, place))
    return None if out is None else (*out, time.perf_counter() - t0)


def _save(args: argparse.Namespace, loaded, report, seconds: float, calibration, trained) -> int:
    """Write the quantized folder (and --json's report), print the summary."""
    from kvserve.loading.quantized import save_quantized

    out = save_quantized(loaded, args.out)
    info = {**report.to_dict(), "calibration": None if calibration is None else
            {"nsamples": args.nsamples, "seqlen": args.calib_seqlen, "seed": args.seed}, "seconds": seconds,
            "out": str(out)}
    if trained is not None:
        info["qat"] = {"mode": args.qat_mode, **trained}
    print(f"{args.method} {report.spec.label()}: {len(report.layers)} layers in {seconds:.1f} s, "
          f"{report.bytes_before / 1e6:.1f} MB -> {report.bytes_after / 1e6:.1f} MB, saved to {out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0


def _run_qat(loaded, args: argparse.Namespace, calibration):
    """QAT of the blocks (kvserve/compress/quant/qat.py), then the head / embedding as asked, by RTN.
    -> (QuantizeReport, training record)."""
    from kvserve.compress.quant.apply import quantize_model
    from kvserve.compress.quant.qat import qat_spec

    spec = qat_spec(args.bits, args.group_size, args.sym, args.granularity, args.kernel)
    if args.qat_mode == "block":
        from kvserve.compress.quant.qat import qat_blockwise

        report, record = qat_blockwise(loaded.model, calibration, spec, epochs=args.qat_epochs,
                                       lr=args.qat_lr or 3e-6, batch_size=args.qat_batch_size or 1, kernel=args.kernel)
        gain = [b["mse_rtn"] / max(b["mse_qat"], 1e-30) for b in record["blocks"]]
        print(f"qat block: {record['tokens']} tokens x {args.qat_epochs} epochs, {record['seconds']:.0f} s; block output "
              f"MSE vs RTN {min(gain):.2f}x-{max(gain):.2f}x lower")
    else:
        report, record = _run_qat_e2e(loaded, args, spec)
    if args.quant_lm_head or args.quant_embedding:
        extra = quantize_model(loaded.model, "rtn", bits=args.bits, group_size=args.group_size, sym=args.sym,
                               granularity=args.granularity, kernel=args.kernel, skip=["layers."],
                               lm_head=args.quant_lm_head, embedding=args.quant_embedding)
        report.layers.extend(extra.layers)
    return report, record


def _run_qat_e2e(loaded, args: argparse.Namespace, spec):
    import copy

    from kvserve.compress.quant.qat import qat
    from kvserve.compress.train import TrainConfig, training_windows

    if args.qat_seqlen < 2:
        raise ValueError(f"--qat-seqlen must be >= 2, got {args.qat_seqlen}")
    batch = args.qat_batch_size or 4
    try:
        cfg = TrainConfig(steps=args.qat_steps, batch_size=batch, lr=args.qat_lr or 1e-5, seed=args.seed,
                          warmup_steps=min(10, max(args.qat_steps, 0) // 10))
    except ValueError as e:  # TrainConfig names the distill flags; these are the --qat-* ones
        msg = str(e)
        for flag in ("--steps", "--batch-size", "--lr"):
            msg = msg.replace(flag, "--qat-" + flag[2:])
        raise ValueError(msg) from None
    windows = training_windows(loaded.tokenizer, args.qat_seqlen, path=args.qat_text_file,
                               bos_token_id=loaded.config.bos_token_id, seed=args.seed,
                               max_windows=args.qat_steps * batch)
    teacher = None
    if args.qat_loss == "kd":  # a frozen float copy; the embedding table is shared, not copied
        emb = loaded.model.embed_tokens.weight
        teacher = copy.deepcopy(loaded.model, memo={id(emb): emb})
    report, trained = qat(loaded.model, windows, spec, cfg, teacher=teacher, checkpoint=args.qat_checkpoint,
                          kernel=args.kernel)
    print(f"qat e2e: {trained.steps} steps, {trained.tokens} tokens, {trained.seconds:.0f} s, loss "
          f"{trained.losses[0]:.4f} -> {trained.losses[-1]:.4f}")
    return report, {"loss": args.qat_loss, "seqlen": args.qat_seqlen, "batch_size": batch, **trained.to_dict()}
