"""StreamingLLM in the paged engine: a stream longer than Gemma 3 270M's 32K context with
constant KV memory (`--attention-sinks 4 --streaming-window 1020`).

One request: a WikiText-2 prompt of `--prompt-tokens` tokens (default 33,000 > 32,768, the
model's trained context) prefilled in chunks of `--chunk`, then `--gen` greedy tokens. After
every engine step the script records the KV pages the sequence holds, the pool's pages in use
and the process RSS; it prints them at a few positions and the peak, and compares with what the
same sequence would hold without streaming (every page of every layer). Optionally a plot of
pages held over the stream position.

    python benchmarks/streaming_engine.py [--prompt-tokens 33000] [--gen 64] [--plot docs/images/streaming_engine_memory.png]
"""
from __future__ import annotations

import argparse
import resource
import time

from _common import machine, save_json, wikitext2_test


def rss_mib() -> float:
    """Current resident set size (MiB) from /proc (ru_maxrss would only give the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=33000)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from kvserve import LLM, SamplingParams
    from kvserve.loading import load_model
    from kvserve.tools.eval.stream import load_token_stream

    loaded = load_model(None)
    mc = loaded.config
    ids = load_token_stream(loaded.tokenizer, wikitext2_test(), args.prompt_tokens,
                            mc.bos_token_id).tolist()
    llm = LLM(loaded=loaded, attention_sinks=args.sinks, streaming_window=args.window, kv_cache_gib=0.25,
              max_num_batched_tokens=args.chunk, enable_prefix_caching=False)
    eng, bm = llm.engine, llm.engine.block_manager
    eng.add_request(ids, SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True))
    # Pages in use right after each allocation: a step's peak (its chunk is allocated before the
    # window's old blocks are released at the end of the step).
    in_use_after_alloc: list[int] = []
    allocate = bm.allocate

    def allocate_and_record(seq, n):
        hit = allocate(seq, n)
        in_use_after_alloc.append(bm.num_blocks - bm.num_free_blocks)
        return hit

    bm.allocate = allocate_and_record
    trace, t0 = [], time.perf_counter()
    out = None
    while eng.has_unfinished():
        outs = eng.step()
        out = outs[-1] if outs else out
        for s in eng.scheduler.running:
            trace.append((s.num_computed_tokens, bm.seq_blocks(s), bm.num_blocks - bm.num_free_blocks, rss_mib()))
    elapsed = time.perf_counter() - t0
    page_bytes = eng.page_bytes
    full_pages = bm.blocks_for(args.prompt_tokens + args.gen)  # one group of every layer, nothing released
    peak = max(in_use_after_alloc)
    late = [t for t in trace if t[0] >= 4096]
    text = llm.tokenizer.decode(out.outputs[0].token_ids) if out else ""
    print(f"machine: {machine()}")
    print(f"stream: {args.prompt_tokens} prompt tokens + {len(out.outputs[0].token_ids)} generated "
          f"(context of the model: {mc.max_position_embeddings}); sinks {args.sinks}, window {args.window}; "
          f"{elapsed:.1f} s")
    print(f"{'position':>9} {'pages held':>11} {'pool pages in use':>18} {'RSS MiB':>8}")
    marks = {1024, 4096, 8192, 16384, 20480, 32768}
    shown = set()
    for pos, held, used, rss in trace:
        m = next((x for x in sorted(marks) if pos >= x and x not in shown), None)
        if m is not None or pos == trace[-1][0]:
            shown.add(m)
            print(f"{pos:>9} {held:>11} {used:>18} {rss:>8.0f}")
    print(f"peak pool pages in use (right after a step's allocation): {peak} = {peak * page_bytes / 2**20:.1f} MiB "
          f"(pages from position 4096 on: min {min(t[2] for t in late)}, max {max(t[2] for t in late)})")
    print(f"without streaming the sequence would need {full_pages} pages = {full_pages * page_bytes / 2**20:.1f} MiB "
          f"(and could not pass {mc.max_position_embeddings} tokens)")
    print(f"generated: {text[:200]!r}")
    save_json("streaming_engine", dict(args=vars(args), elapsed_s=elapsed, page_bytes=page_bytes, peak_pages=peak,
                                       pages_without_streaming=full_pages,
                                       trace=trace), args.json_dir)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        xs = [t[0] for t in trace]
        ax.plot(xs, [t[2] * page_bytes / 2**20 for t in trace], label="streaming (4 sinks + 1020): KV pages in use")
        ax.plot(xs, [bm.blocks_for(x) * page_bytes / 2**20 for x in xs], "--", label="full attention: every page kept")
        ax.axvline(mc.max_position_embeddings, color="grey", lw=0.8)
        ax.text(mc.max_position_embeddings, ax.get_ylim()[1] * 0.9, "trained context ", color="grey", ha="right")
        ax.set_xlabel("stream position (tokens)")
        ax.set_ylabel("KV cache (MiB)")
        ax.set_title("Gemma 3 270M in the kvserve engine: StreamingLLM keeps KV memory flat")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
