"""`kvserve convert [MODEL] --kv-heads K --out DIR`: a KV-cache-shrinking transform of a model,
saved as an HF folder (kvserve.loading.save.save_model) that `LLM(DIR)`, `kvserve serve DIR` and
`kvserve distill --student DIR` take."""
from __future__ import annotations

import argparse


def add_convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="shrink the KV cache by a model transform (GQA/MQA by K/V head pooling)")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    p.add_argument("--kv-heads", type=int, required=True,
                   help="K/V heads of the result (mean-pooled groups; must divide the model's K/V heads)")
    p.add_argument("--out", required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    from kvserve.convert.gqa import pool_kv_heads
    from kvserve.loading import load_model
    from kvserve.loading.save import save_model

    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    loaded = load_model(args.model_path or args.model)
    before = loaded.config.num_kv_heads
    converted = pool_kv_heads(loaded, args.kv_heads)
    out = save_model(converted, args.out)
    print(f"K/V heads {before} -> {args.kv_heads} (KV cache / {before // args.kv_heads}), saved to {out}")
    return 0
