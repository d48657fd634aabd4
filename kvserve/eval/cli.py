"""`kvserve eval` flags and dispatch. Values are validated by the evaluation's config, so an
error names the flag whichever way (CLI or Python) the evaluation is started."""
from __future__ import annotations

import argparse


def add_eval_parser(sub) -> None:
    """Register `kvserve eval stream` on the top-level subparsers `sub`."""
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
                    help="WikiText-2 raw test file (default: ../shared/data/wikitext2/wiki.test.raw beside "
                         "the checkout, or $KVSERVE_WIKITEXT)")
    st.add_argument("--json", default=None, help="write the results here")
    st.add_argument("--plot", default=None, help="PNG of NLL over position (moving average) and cache size")


def run(args: argparse.Namespace) -> int:
    if args.eval == "stream":
        from kvserve.eval.stream import main

        return main(args)
    raise ValueError(f"unknown evaluation {args.eval!r}")
