"""KV memory per sequence with and without sliding-window release (Gemma 3 270M).

Gemma 3's local layers (15 of 18, window 512) only read their last 512 positions. With release
(the default) the layers are split into KV layer groups (1 full + 5 sliding groups of 3 layers),
each with its own block table over one shared page pool, and a sliding group returns the blocks
that fell out of its window. Before (`sliding_window_release=False`) every layer keeps every
block.

Three parts:
  1. Per-sequence KV bytes at 1K/4K/8K tokens and the longest lone sequence, from the block
     manager alone (a sequence prefilled in chunks of the token budget, then decoding).
  2. How many 8K-token sequences (7680-token prompt + 512 generated) run at once in a 2 GiB pool:
     the real scheduler and block manager drive a fake model (no compute), as many requests as
     the pool could ever hold are queued at once; reported: the most sequences decoding together
     and the preemptions.
  3. A real run: one 8K-token prompt prefilled (chunks of 2048) and decoded a few tokens on the
     bundled model, before vs after: pool pages in use right after each step's allocation (the
     peak is reached during a prefill chunk, before that step's release) and at the last decode
     step; greedy tokens asserted equal.

    python benchmarks/sliding_window_memory.py [--real-tokens 8192] [--skip-real] [--json-dir results]
"""
from __future__ import annotations

import argparse
import time

from _common import machine, save_json, wikitext2_test

GIB = 2**30
BUDGET = 2048  # max_num_batched_tokens (EngineConfig default): the prefill chunk


def layouts(mc) -> dict[str, list]:
    from kvserve.model.config import kv_layer_groups

    return {"before": kv_layer_groups(mc, release_sliding=False), "after": kv_layer_groups(mc, release_sliding=True)}


def page_bytes(mc, groups, block_size: int, elem: int = 4) -> int:
    return 2 * len(groups[0].layers) * mc.num_kv_heads * mc.head_dim * elem * block_size


def held_after(mc, groups, num_tokens: int, block_size: int) -> tuple[int, int]:
    """(peak, final) blocks one sequence holds when its num_tokens tokens are computed in
    chunks of BUDGET (prefill), the last token alone (a decode)."""
    from kvserve.engine.block_manager import BlockManager
    from kvserve.sampling_params import SamplingParams
    from kvserve.sequence import Sequence

    bm = BlockManager(10**6, block_size, enable_prefix_caching=False, group_windows=[g.window for g in groups])
    seq = Sequence(0, "r", list(range(num_tokens)), SamplingParams(max_tokens=1), 0.0)
    peak = 0
    while seq.num_computed_tokens < num_tokens:
        n = min(BUDGET, num_tokens - seq.num_computed_tokens)
        bm.allocate(seq, n)
        peak = max(peak, bm.seq_blocks(seq))
        seq.num_computed_tokens += n
        bm.mark_computed(seq)
    return peak, bm.seq_blocks(seq)


def part1(mc, block_size: int) -> list[dict]:
    rows = []
    for name, groups in layouts(mc).items():
        pb = page_bytes(mc, groups, block_size)
        for n in (1024, 4096, 8192):
            peak, final = held_after(mc, groups, n, block_size)
            rows.append({"layout": name, "tokens": n, "kv_bytes": final * pb, "peak_kv_bytes": peak * pb,
                         "pages": final, "page_bytes": pb})
    print(f"\n### 1. KV bytes per sequence (block manager, prefill in chunks of {BUDGET}, fp32)\n")
    print("| tokens | before: KV bytes | after: KV bytes (peak during prefill) | after / before |")
    print("|---|---|---|---|")
    for n in (1024, 4096, 8192):
        b = next(r for r in rows if r["layout"] == "before" and r["tokens"] == n)
        a = next(r for r in rows if r["layout"] == "after" and r["tokens"] == n)
        print(f"| {n} | {b['kv_bytes'] / 2**20:.1f} MiB | {a['kv_bytes'] / 2**20:.1f} MiB "
              f"({a['peak_kv_bytes'] / 2**20:.1f} MiB) | {a['kv_bytes'] / b['kv_bytes']:.2f} |")
    return rows


def simulate(mc, groups, pool_gib: float, prompt_len: int, out_len: int, block_size: int) -> dict:
    """The real scheduler + block manager over a fake model: the most sequences decoding at once."""
    from kvserve.engine.block_manager import BlockManager
    from kvserve.engine.scheduler import Scheduler
    from kvserve.sampling_params import SamplingParams
    from kvserve.sequence import Sequence, SequenceStatus

    pb = page_bytes(mc, groups, block_size)
    num_pages = int(pool_gib * GIB // pb)
    bm = BlockManager(num_pages, block_size, enable_prefix_caching=False, group_windows=[g.window for g in groups])
    sched = Scheduler(bm, max_num_seqs=256, max_num_batched_tokens=BUDGET, max_model_len=32768)
    per_seq = bm.peak_blocks(prompt_len + out_len, 1)  # steady state: decoding at full length
    num_requests = num_pages // per_seq + 4
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    seqs = [Sequence(i, str(i), [i % 1000] * prompt_len, params, 0.0) for i in range(num_requests)]
    for s in seqs:
        sched.add(s)
    most_decoding = steps = 0
    while sched.has_unfinished:
        out = sched.schedule()
        for x in out.scheduled:  # the "model": append a token when the chunk reaches the end
            if x.needs_logits:
                x.seq.append_token(0, 0.0)
        sched.update(out)
        most_decoding = max(most_decoding, sum(1 for s in sched.running if s.num_uncomputed_tokens == 1
                                               and len(s.output_token_ids) > 0))
        for x in out.scheduled:
            s = x.seq
            if s.status is SequenceStatus.RUNNING and len(s.output_token_ids) >= out_len:
                s.finish(SequenceStatus.FINISHED_LENGTH, 0.0)
                sched.finish(s)
        steps += 1
    return {"pool_pages": num_pages, "page_bytes": pb, "pages_per_seq": per_seq, "most_decoding_at_once": most_decoding,
            "capacity_at_8k": num_pages // per_seq, "preemptions": sched.num_preemptions, "steps": steps,
            "requests": num_requests}


def part2(mc, block_size: int, pool_gib: float) -> dict:
    # Long enough outputs that every admitted sequence is still decoding when the last is prefilled.
    res = {name: simulate(mc, groups, pool_gib, 7680, 512, block_size) for name, groups in layouts(mc).items()}
    print(f"\n### 2. 8K-token sequences (7680-token prompt + 512 generated) in a {pool_gib:g} GiB pool\n")
    print("| layout | pool pages | pages per 8K sequence | max sequences at 8K (pool / per sequence) "
          "| most decoding at once (scheduler) | preemptions |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['pool_pages']} x {r['page_bytes'] // 1024} KiB | {r['pages_per_seq']} "
              f"({r['pages_per_seq'] * r['page_bytes'] / 2**20:.0f} MiB) | {r['capacity_at_8k']} "
              f"| {r['most_decoding_at_once']} | {r['preemptions']} |")
    return res


def part3(tokens: int, decode: int) -> dict:
    from kvserve import LLM, SamplingParams
    from kvserve.loading import load_model

    loaded = load_model()
    text = (wikitext2_test()).read_text(encoding="utf-8")
    ids = loaded.tokenizer.encode(text[:tokens * 6])[:tokens]
    assert len(ids) == tokens, len(ids)
    params = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
    res = {}
    for name, release in (("before", False), ("after", True)):
        llm = LLM(loaded=loaded, kv_cache_gib=2.0, enable_prefix_caching=False, sliding_window_release=release)
        eng = llm.engine
        bm, schedule = eng.block_manager, eng.scheduler.schedule
        usage = {"peak": 0, "last": 0}

        def schedule_and_measure():
            """Pages in use right after scheduling: this step's chunk allocated, nothing released
            yet (release follows the forward pass), so the true peak of the step."""
            out = schedule()
            used = eng.num_blocks - bm.num_free_blocks
            usage["peak"], usage["last"] = max(usage["peak"], used), used
            return out

        eng.scheduler.schedule = schedule_and_measure
        eng.add_request(ids, params)
        t0, out = time.perf_counter(), None
        while eng.has_unfinished():
            for o in eng.step():
                out = o
        wall = time.perf_counter() - t0
        peak, last = usage["peak"], usage["last"]
        res[name] = {"peak_pages": peak, "pages_at_end": last, "page_bytes": eng.page_bytes,
                     "peak_bytes": peak * eng.page_bytes, "end_bytes": last * eng.page_bytes,
                     "token_ids": out.outputs[0].token_ids, "wall_s": wall, "pool_pages": eng.num_blocks}
        del llm, eng
    assert res["before"]["token_ids"] == res["after"]["token_ids"], "release changed the greedy tokens"
    print(f"\n### 3. Real run: one {tokens}-token prompt, chunks of {BUDGET}, {decode} greedy tokens "
          "(identical before/after)\n")
    print("| layout | pool | pages in use, peak (a prefill chunk) | KV bytes, peak | pages in use at the last decode "
          "| KV bytes then | wall |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['pool_pages']} x {r['page_bytes'] // 1024} KiB | {r['peak_pages']} "
              f"| {r['peak_bytes'] / 2**20:.1f} MiB | {r['pages_at_end']} | {r['end_bytes'] / 2**20:.1f} MiB "
              f"| {r['wall_s']:.0f} s |")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--real-tokens", type=int, default=8192)
    ap.add_argument("--real-decode", type=int, default=4)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from kvserve.loading import load_model

    mc = load_model().config
    lay = layouts(mc)
    print(f"machine: {machine()}")
    print(f"Gemma 3 270M: {mc.num_layers} layers ({sum(g.window is None for g in lay['after'])} full + "
          f"{sum(g.window is not None for g in lay['after'])} sliding groups of {len(lay['after'][0].layers)} layers "
          f"after; 1 group of {mc.num_layers} before), window {mc.sliding_window}, block size {args.block_size}")
    rows = part1(mc, args.block_size)
    sim = part2(mc, args.block_size, args.pool_gib)
    real = None if args.skip_real else part3(args.real_tokens, args.real_decode)
    if real:
        for r in real.values():
            r.pop("token_ids")
    save_json("sliding_window_memory", {"per_sequence": rows, "pool": sim, "real": real}, args.json_dir)


if __name__ == "__main__":
    main()
