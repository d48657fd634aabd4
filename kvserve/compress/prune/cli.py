"""`kvserve prune [MODEL] --method magnitude|wanda|sparsegpt --sparsity 0.5 | --pattern 2:4 --out DIR`:
prune a model's transformer-block linears (Wanda / SparseGPT calibrate on WikiText-2
`wiki.valid.tokens`, block by block through the already-pruned blocks) and save the folder.

Unstructured results are saved dense (zeros) with save_model; an N:M result with --compress is
saved N:M-compressed (kvserve.loading.sparse_nm). --steps S prunes iteratively (S passes, sparsity
raised step by step); with --heal-steps N every step is followed by N steps of logit distillation
from the unpruned model that keep the zeros (kvserve.compress.prune.heal; `prune_model(heal_fn=...)` is the
Python hook).

Structured pruning (--prune-heads / --ffn-keep / --hidden-keep / --drop-layers) is delegated to
kvserve.compress.prune.structured.structured_prune; --method is then optional (both may be combined:
structured first, then unstructured / N:M).
"""
from __future__ import annotations

import argparse
import json
import time

STRUCTURED_FLAGS = ("prune_heads", "ffn_keep", "hidden_keep", "drop_layers")


def add_prune_parser(sub) -> None:
    """Register `kvserve prune` on the top-level subparsers `sub`."""
    p = sub.add_parser("prune", help="prune a model (magnitude, Wanda, SparseGPT; unstructured or N:M) "
                                     "and save it to a folder")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    p.add_argument("--method", default=None, choices=["magnitude", "wanda", "sparsegpt"])
    p.add_argument("--sparsity", type=float, default=None, help="unstructured fraction of zeros, e.g. 0.5")
    p.add_argument("--pattern", default=None, help="N:M semi-structured pattern, e.g. 2:4 or 4:8")
    p.add_argument("--per", default=None, choices=["row", "layer"],
                   help="unstructured comparison group of magnitude / wanda (default: layer / row)")
    p.add_argument("--steps", type=int, default=1,
                   help="iterative pruning in this many steps (healing between steps is a Python hook)")
    p.add_argument("--heal-steps", type=int, default=0,
                   help="after every pruning step, this many distillation steps from the unpruned model "
                        "(zeros kept; 0 = no healing)")
    p.add_argument("--heal-lr", type=float, default=1e-4, help="healing: AdamW peak learning rate")
    p.add_argument("--heal-alpha", type=float, default=0.5,
                   help="healing: weight of the KL term (1 - alpha weighs the CE), as `kvserve distill --alpha`")
    p.add_argument("--heal-seqlen", type=int, default=256, help="healing: tokens per training window")
    p.add_argument("--heal-batch-size", type=int, default=4, help="healing: windows per step")
    p.add_argument("--heal-text-file", default=None,
                   help="healing text (default: WikiText-2 wiki.valid.tokens)")
    p.add_argument("--damp", type=float, default=0.01, help="sparsegpt: dampening, fraction of mean diag(H)")
    p.add_argument("--blocksize", type=int, default=128, help="sparsegpt: columns per block")
    p.add_argument("--skip", default="", help="comma-separated substrings of layer names left dense")
    p.add_argument("--nsamples", type=int, default=128, help="calibration windows")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration window, BOS included")
    p.add_argument("--seed", type=int, default=0, help="calibration window sampling seed")
    p.add_argument("--calib-file", default=None, help="calibration text (default: WikiText-2 wiki.valid.tokens)")
    p.add_argument("--compress", action="store_true", help="with --pattern: save N:M-compressed (values + indices)")
    p.add_argument("--prune-heads", type=int, default=None, help="structured: attention heads to remove")
    p.add_argument("--ffn-keep", type=float, default=None, help="structured: fraction of MLP channels kept")
    p.add_argument("--hidden-keep", type=float, default=None, help="structured: fraction of hidden channels kept")
    p.add_argument("--drop-layers", type=int, default=None, help="structured: decoder layers to drop")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--json", default=None, help="write the pruning report here")


def _check_args(args: argparse.Namespace) -> bool:
    """Validate flag combinations -> whether structured pruning was asked for."""
    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    structured = any(getattr(args, f) is not None for f in STRUCTURED_FLAGS)
    if args.method is None:
        if not structured:
            raise ValueError("--method is required (magnitude, wanda or sparsegpt) unless structured flags "
                             "(--prune-heads, --ffn-keep, --hidden-keep, --drop-layers) are given")
        if args.sparsity is not None or args.pattern is not None:
            raise ValueError("--sparsity / --pattern need --method")
    elif (args.sparsity is None) == (args.pattern is None):
        raise ValueError("give exactly one of --sparsity (e.g. 0.5) and --pattern (e.g. 2:4)")
    if args.compress and args.pattern is None:
        raise ValueError("--compress needs an N:M --pattern (unstructured models are saved dense)")
    if args.nsamples < 1:
        raise ValueError(f"--nsamples must be >= 1, got {args.nsamples}")
    if args.heal_steps < 0:
        raise ValueError(f"--heal-steps must be >= 0, got {args.heal_steps}")
    if args.heal_steps and args.method is None:
        raise ValueError("--heal-steps heals between unstructured pruning steps: it needs --method "
                         "(heal a structured model with `kvserve distill`)")
    return structured


def _heal_fn(args, loaded):
    """The distillation hook of --heal-steps, the unpruned model (loaded again) as the teacher."""
    from kvserve.compress.prune.heal import distill_heal_fn
    from kvserve.compress.train.distill import DistillOptions, share_frozen_embedding
    from kvserve.loading import load_model

    opts = DistillOptions(steps=args.heal_steps, lr=args.heal_lr, alpha=args.heal_alpha, seqlen=args.heal_seqlen,
                          batch_size=args.heal_batch_size, text_file=args.heal_text_file, eval_windows=0,
                          warmup_steps=0, log_every=0)
    teacher = load_model(args.model_path or args.model)
    share_frozen_embedding(teacher.model, loaded.model)  # the same table: held once
    return distill_heal_fn(teacher, loaded, opts, progress=False)


def _structured(loaded, args, windows):
    try:
        from kvserve.compress.prune.structured import structured_prune
    except ImportError:
        raise ValueError("structured pruning flags need kvserve.compress.prune.structured, which this checkout does not "
                         "have") from None
    return structured_prune(loaded, calibration=windows, prune_heads=args.prune_heads, ffn_keep=args.ffn_keep,
                            hidden_keep=args.hidden_keep, drop_layers=args.drop_layers)


def run(args: argparse.Namespace) -> int:
    from kvserve.compress.prune.apply import prune_model
    from kvserve.compress.prune.masks import parse_pattern
    from kvserve.compress.quant.calibrate import load_calibration
    from kvserve.loading import load_model
    from kvserve.loading.save import save_model
    from kvserve.loading.sparse_nm import save_compressed

    structured = _check_args(args)
    pattern = parse_pattern(args.pattern) if args.pattern is not None else None
    loaded = load_model(args.model_path or args.model)
    windows = None
    if structured or args.method in ("wanda", "sparsegpt"):
        windows = load_calibration(loaded.tokenizer, args.nsamples, args.calib_seqlen, args.seed,
                                   loaded.config.bos_token_id, args.calib_file)
    t0 = time.perf_counter()
    info: dict = {"calibration": None if windows is None else
                  {"nsamples": args.nsamples, "seqlen": args.calib_seqlen, "seed": args.seed}}
    if structured:
        loaded = _structured(loaded, args, windows)
        info["structured"] = {f: getattr(args, f) for f in STRUCTURED_FLAGS if getattr(args, f) is not None}
    if args.method is not None:
        skip = tuple(s for s in args.skip.split(",") if s)
        heal = _heal_fn(args, loaded) if args.heal_steps else None
        report = prune_model(loaded.model, args.method, sparsity=args.sparsity, pattern=pattern, calibration=windows,
                             skip=skip, steps=args.steps, per=args.per, percdamp=args.damp, blocksize=args.blocksize,
                             heal_fn=heal)
        if heal is not None:
            heal(loaded.model, args.steps)  # the last step is healed too
            info["healing"] = heal.history
            print(f"healed {len(heal.history)} times x {args.heal_steps} steps "
                  f"({sum(h['seconds'] for h in heal.history):.0f} s)")
        info.update(report.to_dict())
        print(f"{args.method} {report.label()}: {len(report.layers)} layers, sparsity "
              f"{report.achieved_sparsity:.4f}")
    if args.compress:
        out = save_compressed(loaded, args.out, pattern, config=loaded.config)
    else:
        out = save_model(loaded, args.out, config=loaded.config)
    info.update({"seconds": time.perf_counter() - t0, "out": str(out), "compressed": bool(args.compress)})
    print(f"saved to {out} ({info['seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0
