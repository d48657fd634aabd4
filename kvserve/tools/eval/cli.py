"""`kvserve eval` flags and dispatch. Values are validated by the evaluation's config, so an
error names the flag whichever way (CLI or Python) the evaluation is started."""
from __future__ import annotations

import argparse


def add_eval_parser(sub) -> None:
    """Register `kvserve eval stream` and `kvserve eval ppl` on the top-level subparsers `sub`."""
    ev = sub.add_parser("eval", help="evaluations").add_subparsers(dest="eval", required=True)
    st = ev.add_parser("stream", help="StreamingLLM: NLL over a long WikiText-2 stream with a bounded KV cache")
    st.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    st.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    st.add_argument("--num-tokens", type=int, default=16384, help="stream length, BOS included (BOS once)")
    st.add_argument("--sinks", type=int, default=4, help="attention-sink tokens S of method `sinks`")
    st.add_argument("--window", type=int, default=1020,
                    help="recent tokens W of method `sinks`; `window` and `recompute` get the same budget "
                         "S + W (the paper's 0+1024 vs 4+1020)")
    st.add_argument("--methods", default="full,window,sinks,recompute",
                    help="comma list of full, window, sinks, recompute, recompute-bos (opt-in: recompute "
                         "with BOS in place of the oldest context token)")
    st.add_argument("--recompute-positions", type=int, default=128,
                    help="evenly spaced positions scored by `recompute` (and by every method, for a "
                         "like-for-like column)")
    st.add_argument("--chunk", type=int, default=256,
                    help="tokens per forward pass (exactly token-by-token streaming; the cache holds at "
                         "most S + W + chunk tokens per layer)")
    st.add_argument("--data", default=None,
                    help="WikiText-2 raw test file (default: $KVSERVE_DATA/wikitext2/wiki.test.raw)")
    st.add_argument("--json", default=None, help="write the results here")
    st.add_argument("--plot", default=None, help="PNG of NLL over position (moving average) and cache size")
    _add_ppl_parser(ev.add_parser("ppl", help="perplexity over non-overlapping windows (WikiText-2 by default) "
                                            "and KL divergence to a reference"))


def _add_ppl_parser(p: argparse.ArgumentParser) -> None:
    """Flags of `kvserve eval ppl` (kvserve/tools/eval/ppl.py)."""
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--dataset", default="wikitext2", help="wikitext2 (raw test split)")
    p.add_argument("--text-file", default=None, help="score this text file instead of the dataset")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per window, BOS included")
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    p.add_argument("--no-bos", action="store_true", help="no BOS at the start of each window")
    p.add_argument("--kl-to", default=None,
                   help="reference for KL: 'baseline' (this model unquantized in float32) or a model path")
    p.add_argument("--quant", default="none", choices=["none", "rtn"],
                   help="quantize the model's transformer blocks in-process before scoring")
    p.add_argument("--bits", type=int, default=4, help="--quant: bits per weight, 2..8")
    p.add_argument("--group-size", type=int, default=128, help="--quant: inputs per scale (granularity group)")
    p.add_argument("--granularity", default="group", help="--quant: tensor, channel or group")
    p.add_argument("--sym", action="store_true", help="--quant: symmetric grid (default asymmetric)")
    p.add_argument("--quant-lm-head", action="store_true", help="--quant: quantize the LM head too")
    p.add_argument("--quant-embedding", action="store_true",
                   help="--quant: the embedding lookup reads the quantized codes too (a tied table shares the head's; needs --quant-lm-head)")
    p.add_argument("--json", default=None, help="write the result here")


def run(args: argparse.Namespace) -> int:
    if args.eval == "stream":
        from kvserve.tools.eval.stream import main

        return main(args)
    if args.eval == "ppl":
        from kvserve.tools.eval.ppl import main as ppl_main

        return ppl_main(args)
    raise ValueError(f"unknown evaluation {args.eval!r}")
