"""What random sampling costs: the sampler alone on real logits, and the offline workload sampled.

1. The sampler: 64 logits rows of the bundled Gemma 3 (262,144 tokens) at 64 positions of a
   WikiText-2 test window, one setting at a time, through the torch path (`filter_logits`, then
   the inverse-CDF draw) and through kvserve's C kernel (kernels/sampling.c) in turns, with the
   same uniform numbers: milliseconds a call (median) and how many tokens agree.
2. The engine: `kvserve bench throughput`'s offline workload (64 requests, inputs 32-512,
   outputs 32-256, random ids), greedy and under each setting, the sampled runs with the kernel
   and with the torch path in turns: output tok/s (median).

    cd benchmarks && KVSERVE_DATA=... ../.venv/bin/python sampling_cost.py --json-dir results
"""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager, nullcontext

import torch

from _common import machine, median, save_json, wikitext2_test
from kvserve import kernels
from kvserve.loading import load_model
from kvserve.sampling import sampler as sampler_module
from kvserve.tools.bench.throughput import INPUT_RANGE, OUTPUT_RANGE, Sampling, make_workload, run_kvserve
from kvserve.tools.eval.windows import make_windows, tokenize_file, window_hidden

SETTINGS = [Sampling(1.0), Sampling(0.8, top_p=0.95), Sampling(0.7, top_k=50), Sampling(1.0, min_p=0.1),
            Sampling(0.7, top_p=0.9, top_k=100, min_p=0.05)]


@contextmanager
def torch_path():
    """The sampler without its C kernel (what it does on CUDA)."""
    saved = kernels.sample_rows
    kernels.sample_rows = lambda *a, **k: None
    try:
        yield
    finally:
        kernels.sample_rows = saved


@torch.no_grad()
def real_logits(loaded, rows: int) -> torch.Tensor:
    """[rows, V] fp32: the model's logits at `rows` evenly spaced positions of the first 512-token
    window of WikiText-2's test split."""
    ids = tokenize_file(loaded.tokenizer, wikitext2_test())[:2048]
    window = make_windows(ids, 512, loaded.config.bos_token_id, max_windows=1)
    hidden = window_hidden(loaded.model, window)[0]  # [512, hidden]
    return loaded.model.compute_logits(hidden[torch.linspace(16, 511, rows).long()]).float().contiguous()


def time_sampler(logits: torch.Tensor, repeats: int) -> list[dict]:
    rows = list(range(logits.shape[0]))
    out = []
    for s in SETTINGS:
        params = [s.params(1)] * len(rows)
        gens = [torch.Generator().manual_seed(i) for i in rows]
        times: dict[str, list[float]] = {"torch": [], "kernel": []}
        tokens: dict[str, torch.Tensor] = {}
        for _ in range(repeats):
            for name in ("torch", "kernel"):
                for g, i in zip(gens, rows):
                    g.manual_seed(i)  # the same draws for both
                with torch_path() if name == "torch" else nullcontext():
                    t = time.perf_counter()
                    tokens[name] = sampler_module.sample_rows(logits, rows, params, gens)
                    times[name].append((time.perf_counter() - t) * 1e3)
        rec = {"setting": str(s), "torch_ms": round(median(times["torch"]), 2),
               "kernel_ms": round(median(times["kernel"]), 2),
               "speedup": round(median(times["torch"]) / median(times["kernel"]), 2),
               "tokens_equal": int((tokens["torch"] == tokens["kernel"]).sum()), "rows": len(rows)}
        print(rec, flush=True)
        out.append(rec)
    return out


def time_engine(loaded, settings: list[Sampling], repeats: int) -> list[dict]:
    cfg = loaded.config
    wl = make_workload(64, INPUT_RANGE, OUTPUT_RANGE, cfg.vocab_size, cfg.bos_token_id, 0)
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for s in [Sampling(), *settings]:
            for path in (("kernel", "torch") if s.temperature > 0 else ("greedy",)):
                with torch_path() if path == "torch" else nullcontext():
                    r = run_kvserve(loaded, wl, s, max_num_seqs=64, enable_prefix_caching=False)
                runs.setdefault((str(s), path), []).append(round(r.output_tok_s, 1))
                print(str(s), path, f"{r.output_tok_s:.1f} output tok/s", flush=True)
    return [{"setting": k[0], "sampler": k[1], "output_tok_s": round(median(v), 1), "runs": v} for k, v in runs.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="sampler calls per setting and path")
    ap.add_argument("--engine-repeats", type=int, default=2, help="offline runs per setting and path (0: skip)")
    ap.add_argument("--engine-settings", default="0,1,2", help="indices into the sampler's settings")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    print(machine())
    loaded = load_model(None, "float32")
    sampler = time_sampler(real_logits(loaded, 64), args.repeats)
    engine = []
    if args.engine_repeats:
        chosen = [SETTINGS[int(i)] for i in args.engine_settings.split(",")]
        engine = time_engine(loaded, chosen, args.engine_repeats)
    save_json("sampling_cost", {"sampler": sampler, "engine": engine}, args.json_dir)


if __name__ == "__main__":
    main()
