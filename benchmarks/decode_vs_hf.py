"""Batch-1 decode tokens/s: kvserve vs HF transformers generate, same GGUF, same dtype.

Both are timed the same way, interleaved, median of --repeats runs:
decode tok/s = (N - 1) / (time(generate N tokens) - time(generate 1 token)),
which removes prefill and start-up from both. Also reports the memory-bandwidth bound:
bytes read per decode step / measured read bandwidth.

    python benchmarks/decode_vs_hf.py --tokens 64 --repeats 3 [--dtype bfloat16] [--json-dir results]
"""
from __future__ import annotations

import argparse

import torch
from _common import machine, median, read_bandwidth_gbs, save_json, timed

PROMPT = "The history of the printing press begins"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from kvserve import LLM, SamplingParams
    from kvserve.loading.loader import default_model_path, resolve_dtype

    path = default_model_path()
    dtype = resolve_dtype(args.dtype)
    llm = LLM(dtype=args.dtype, kv_cache_gib=0.5)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    ids = llm.tokenizer.encode(PROMPT)
    hf_ids = torch.tensor([ids])
    mask = torch.ones_like(hf_ids)

    def ours(n: int) -> None:
        llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    def theirs(n: int) -> None:
        with torch.no_grad():
            hf.generate(hf_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    ours(4), theirs(4)  # warm-up
    rates = {"kvserve": [], "hf": []}
    n = args.tokens
    for _ in range(args.repeats):
        for name, fn in (("kvserve", ours), ("hf", theirs)):
            t1, tn = timed(lambda: fn(1)), timed(lambda: fn(n))
            rates[name].append((n - 1) / (tn - t1))
    bw = read_bandwidth_gbs()
    cfg = llm.engine.model_config
    bytes_per_token = cfg.num_params * dtype.itemsize  # every weight once (tied head = embedding)
    bound = bw * 1e9 / bytes_per_token
    k, h = median(rates["kvserve"]), median(rates["hf"])
    print(f"machine: {machine()}")
    print(f"| engine | dtype | decode tok/s (median of {args.repeats}) | runs |")
    print("|---|---|---|---|")
    print(f"| kvserve | {args.dtype} | {k:.2f} | {', '.join(f'{r:.2f}' for r in rates['kvserve'])} |")
    print(f"| HF transformers | {args.dtype} | {h:.2f} | {', '.join(f'{r:.2f}' for r in rates['hf'])} |")
    print(f"kvserve / HF = {k / h:.2f}x")
    print(f"read bandwidth {bw:.1f} GB/s; bytes per token {bytes_per_token / 1e9:.3f} GB -> bound {bound:.1f} tok/s; "
          f"kvserve at {k / bound:.0%} of it")
    save_json(f"decode_vs_hf_{args.dtype}", {"kvserve": rates["kvserve"], "hf": rates["hf"], "bandwidth_gbs": bw,
                                             "bytes_per_token": bytes_per_token, "bound_tok_s": bound}, args.json_dir)


if __name__ == "__main__":
    main()
