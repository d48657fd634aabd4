"""`kvserve convert [MODEL] [--kv-heads K] [--share-kv-every N] --out DIR`: KV-cache-shrinking
transforms of a model (GQA / MQA by K/V head pooling, cross-layer KV sharing),
saved as an HF folder (kvserve.loading.save.save_model) that `LLM(DIR)`, `kvserve serve DIR` and
`kvserve distill --student DIR` take."""
from __future__ import annotations

import argparse


def add_convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="shrink the KV cache by a model transform (GQA/MQA head pooling, cross-layer KV sharing)")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="K/V heads of the result (mean-pooled groups; must divide the model's K/V heads)")
    p.add_argument("--share-kv-every", type=int, default=None, metavar="N",
                   help="cross-layer KV sharing: runs of N layers of the same attention type use the first "
                        "one's K/V (the KV cache keeps one layer per run)")
    p.add_argument("--kv-share-init", choices=("copy", "mean"), default="copy",
                   help="with --share-kv-every: the kept K/V projection is the first layer's own (copy) or "
                        "the run's mean")
    p.add_argument("--out", required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    from kvserve.compress.convert.cla import share_kv
    from kvserve.compress.convert.gqa import pool_kv_heads
    from kvserve.loading import load_model
    from kvserve.loading.save import save_model

    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    if args.kv_heads is None and args.share_kv_every is None:
        raise ValueError("kvserve convert: give --kv-heads K and/or --share-kv-every N")
    loaded = load_model(args.model_path or args.model)
    before = loaded.config.kv_bytes_per_token()
    if args.kv_heads is not None:
        heads = loaded.config.num_kv_heads
        loaded = pool_kv_heads(loaded, args.kv_heads)
        print(f"K/V heads {heads} -> {args.kv_heads}")
    if args.share_kv_every is not None:
        loaded = share_kv(loaded, args.share_kv_every, args.kv_share_init)
        print(f"cross-layer KV sharing every {args.share_kv_every} ({args.kv_share_init}): K/V stored for "
              f"layers {list(loaded.config.kv_layers)}")
    after = loaded.config.kv_bytes_per_token()
    out = save_model(loaded, args.out)
    print(f"KV bytes per token (fp32) {before} -> {after} ({before / after:.2f}x smaller), saved to {out}")
    return 0
