"""KV-cache formats on Gemma 3 270M: accuracy, pool capacity and batching throughput for
fp32 / fp16 / bf16 / int8 / fp8 (e4m3) K/V (`--kv-cache-dtype`).

1. Accuracy: `--windows` WikiText-2 test windows of 1024 tokens through the paged runner, a
   512-token prefill then chunks of 64 (every token's attention reads the pool format): NLL,
   PPL, KL(fp32 pool || this pool) and top-1 agreement.
2. Capacity for a fixed `--kv-cache-gib`: pages, tokens per layer, and how many 2048-token
   sequences fit at their peak.
3. Throughput: the same random workload through the engine (`kvserve bench throughput`'s
   generator and runner) with a small pool (`--throughput-gib`) so memory limits the batch,
   the formats interleaved for `--rounds`.

    python benchmarks/kv_cache_dtype.py [--windows 4] [--num-prompts 32] [--rounds 2] [--json-dir results]
"""
from __future__ import annotations

import argparse
import statistics

import torch
from _common import machine, save_json, wikitext2_test

DTYPES = ("auto", "fp16", "bf16", "int8", "fp8")


def window_logits(loaded, ids: list[int], kv_dtype: str) -> torch.Tensor:
    from kvserve.engine.model_runner import ModelRunner, StepInput
    from kvserve.model.attention import KVCache

    cfg, bs = loaded.config, 16
    blocks = -(-len(ids) // bs)
    kv = KVCache(cfg.num_layers, blocks * bs, cfg.num_kv_heads, cfg.head_dim, torch.float32, kv_dtype=kv_dtype)
    runner = ModelRunner(loaded.model, kv, bs)
    out, pos = [], 0
    for n in [512] + [64] * ((len(ids) - 512) // 64):
        out.append(runner.execute([StepInput(ids[pos:pos + n], pos, list(range(blocks)), num_logits=n)]).float())
        pos += n
    return torch.cat(out)


def accuracy(loaded, windows: int) -> dict:
    from kvserve.tools.eval.stream import load_token_stream

    stream = load_token_stream(loaded.tokenizer, wikitext2_test(), 1024 * windows, None).tolist()
    bos = loaded.config.bos_token_id
    res = {d: {"nll": [], "kl": [], "agree": []} for d in DTYPES}
    for w in range(windows):
        ids = [bos] + stream[w * 1024:(w + 1) * 1024 - 1]
        target = torch.tensor(ids[1:])
        ref = None
        for d in DTYPES:
            lp = window_logits(loaded, ids, d).log_softmax(-1)
            res[d]["nll"].append(torch.nn.functional.nll_loss(lp[:-1], target).item())
            if ref is None:
                ref = lp
            res[d]["kl"].append((ref.exp() * (ref - lp)).sum(-1).mean().item())
            res[d]["agree"].append((ref.argmax(-1) == lp.argmax(-1)).float().mean().item())
    return {d: {k: statistics.fmean(v) for k, v in r.items()} for d, r in res.items()}


def capacity(loaded, gib: float) -> dict:
    from kvserve import LLM

    out = {}
    for d in DTYPES:
        eng = LLM(loaded=loaded, kv_cache_gib=gib, kv_cache_dtype=d).engine
        bm = eng.block_manager
        per_seq = bm.peak_blocks(2048, eng.config.max_num_batched_tokens)
        out[d] = {"pages": eng.num_blocks, "page_bytes": eng.page_bytes,
                  "tokens_all_layers": eng.num_blocks // len(eng.layer_groups) * bm.block_size,
                  "seqs_2048_at_peak": eng.num_blocks // per_seq}
    return out


def throughput(loaded, num_prompts: int, gib: float, rounds: int) -> dict:
    from kvserve.tools.bench.throughput import make_workload, run_kvserve

    wl = make_workload(num_prompts, (256, 512), (64, 128), loaded.config.vocab_size, loaded.config.bos_token_id, 0)
    runs = {d: [] for d in DTYPES}
    for _ in range(rounds):
        for d in DTYPES:
            r = run_kvserve(loaded, wl, kv_cache_gib=gib, kv_cache_dtype=d, max_num_seqs=64)
            runs[d].append((r.output_tok_s, r.extra["peak_kv_blocks"], r.extra["num_preemptions"]))
            print(f"  {d}: {r.output_tok_s:.1f} output tok/s, preemptions {r.extra['num_preemptions']}")
    return {d: {"output_tok_s": [x[0] for x in v], "median_output_tok_s": statistics.median(x[0] for x in v),
                "num_preemptions": [x[2] for x in v]} for d, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--capacity-gib", type=float, default=1.0)
    ap.add_argument("--throughput-gib", type=float, default=0.1)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from kvserve.loading import load_model

    loaded = load_model(None)
    print(f"machine: {machine()}")
    acc = accuracy(loaded, args.windows)
    print(f"\naccuracy ({args.windows} x 1024 WikiText-2 test tokens):")
    print("| KV | PPL | KL vs fp32 KV | top-1 agreement |\n|---|---|---|---|")
    for d, r in acc.items():
        print(f"| {d} | {torch.tensor(r['nll']).exp().item():.3f} | {r['kl']:.4f} | {100 * r['agree']:.1f}% |")
    cap = capacity(loaded, args.capacity_gib)
    print(f"\ncapacity ({args.capacity_gib} GiB):")
    print("| KV | page bytes | pages | tokens (all layers) | 2048-token sequences at peak |\n|---|---|---|---|---|")
    for d, r in cap.items():
        print(f"| {d} | {r['page_bytes']} | {r['pages']} | {r['tokens_all_layers']} | {r['seqs_2048_at_peak']} |")
    print(f"\nthroughput ({args.num_prompts} prompts, 256-512 in, 64-128 out, pool {args.throughput_gib} GiB):")
    thr = throughput(loaded, args.num_prompts, args.throughput_gib, args.rounds)
    for d, r in thr.items():
        print(f"| {d} | {r['median_output_tok_s']:.1f} ({', '.join(f'{x:.1f}' for x in r['output_tok_s'])}) | "
              f"preemptions {r['num_preemptions']} |")
    save_json("kv_cache_dtype", dict(args=vars(args), accuracy=acc, capacity=cap, throughput=thr), args.json_dir)


if __name__ == "__main__":
    main()
