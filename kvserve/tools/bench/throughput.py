"""`kvserve bench throughput`: offline throughput on a fixed random workload.

N requests with input lengths uniform in [a, b] and output lengths uniform in [c, d] (fixed
seed, ignore_eos, random token ids as vLLM's "random" dataset), all submitted at once; greedy,
or sampled under one temperature / top-p / top-k / min-p setting.
Optionally, side by side in the same run: HF transformers generating the same requests in
padded static batches (left padding, each batch runs to its longest output), and a sweep of
kvserve's --max-num-seqs.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvserve import LLM, SamplingParams
from kvserve.loading import load_model
from kvserve.loading.loader import resolve_dtype

# The offline workload (vLLM's "random" dataset style): what `kvserve bench throughput` and the
# benchmarks that reproduce its run use by default.
INPUT_RANGE = (32, 512)
OUTPUT_RANGE = (32, 256)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    engine: str
    setting: str
    seconds: float
    output_tok_s: float
    total_tok_s: float
    requests_s: float
    extra: dict


def make_workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                  bos: int | None, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    lo_id = 3 if vocab_size > 1000 else 0  # skip pad/eos/bos-like ids at the bottom of the vocabulary
    hi_id = min(vocab_size, 200_000) - 1  # Gemma's top ids are unused/special; keep to ordinary tokens
    for _ in range(n):
        length = rng.randint(*input_range)
        ids = [rng.randint(lo_id, hi_id) for _ in range(length)]
        if bos is not None:
            ids[0] = bos
        prompts.append(ids)
        outs.append(rng.randint(*output_range))
    return Workload(prompts, outs)


@dataclass(frozen=True)
class Sampling:
    """How every request of the workload picks its tokens (temperature 0: greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __str__(self) -> str:
        changed = [f"{k}={v}" for k, v in asdict(self).items() if v != getattr(Sampling, k) and k != "temperature"]
        if self.temperature == 0.0:
            return ", ".join(["greedy", *changed])
        return ", ".join([f"temperature={self.temperature}", *changed])

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, max_tokens=max_tokens, ignore_eos=True)

    def hf_generate_kwargs(self) -> dict:
        """The same setting for HF generate (whose top_k defaults to 50: 0 turns it off)."""
        penalty = {"repetition_penalty": self.repetition_penalty} if self.repetition_penalty != 1.0 else {}
        if self.temperature == 0.0:
            return {"do_sample": False, **penalty}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p or None, **penalty}


def run_kvserve(loaded, wl: Workload, sampling: Sampling = Sampling(), **engine_args) -> Result:
    llm = LLM(loaded=loaded, **engine_args)
    params = [sampling.params(n) for n in wl.output_lens]
    t = time.perf_counter()
    llm.generate(wl.prompts[:2], [SamplingParams(temperature=0, max_tokens=2)] * 2)  # warm-up
    llm.generate(wl.prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # and a one-row step (compile)
    warmup = time.perf_counter() - t
    llm.engine.block_manager.reset_prefix_cache()
    peak = {"blocks": 0}
    engine = llm.engine

    # Sample the pool after every step to report peak usage (cheap: a few integer reads).
    step = engine.step

    def counting_step():
        outs = step()
        peak["blocks"] = max(peak["blocks"], engine.num_blocks - engine.block_manager.num_free_blocks)
        return outs

    engine.step = counting_step
    t = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t
    engine.step = step
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == wl.output_tokens, f"expected {wl.output_tokens} output tokens, got {produced}"
    stats = engine.stats()
    setting = (f"max_num_seqs={engine.config.max_num_seqs}, max_num_batched_tokens={engine.config.max_num_batched_tokens}"
               f", {sampling}")
    return Result("kvserve", setting, dt, produced / dt, (produced + wl.input_tokens) / dt, len(outs) / dt,
                  {"peak_kv_blocks": peak["blocks"], "kv_blocks_total": engine.num_blocks,
                   "num_preemptions": stats["num_preemptions"],
                   "mean_ttft_s": sum(o.metrics.ttft for o in outs) / len(outs), "warmup_s": warmup})


def run_hf(model_path: Path, wl: Workload, batch_size: int, dtype: torch.dtype, pad_id: int,
           sampling: Sampling = Sampling()) -> Result:
    """HF transformers, static batches in submission order, left-padded, each batch generating
    its longest requested output (the shorter requests' extra tokens are wasted work)."""
    model = _hf_model(model_path, dtype)
    t = time.perf_counter()
    for i in tqdm(range(0, len(wl.prompts), batch_size), desc=f"HF batch {batch_size}"):
        batch = wl.prompts[i:i + batch_size]
        n_new = max(wl.output_lens[i:i + batch_size])
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=pad_id,
                           **sampling.hf_generate_kwargs())
    dt = time.perf_counter() - t
    return Result("hf", f"static batch {batch_size}, {sampling}", dt, wl.output_tokens / dt,
                  (wl.output_tokens + wl.input_tokens) / dt, len(wl.prompts) / dt, {})


_HF_CACHE: dict = {}


def _hf_model(path: Path, dtype: torch.dtype):
    key = (str(path), dtype)
    if key not in _HF_CACHE:
        from transformers import AutoModelForCausalLM  # optional (the [convert] extra): the HF peer only

        if path.is_dir():
            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        else:
            m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        _HF_CACHE[key] = m.eval()
    return _HF_CACHE[key]


def print_table(results: list[Result], wl: Workload) -> None:
    print(f"\n{len(wl.prompts)} requests, {wl.input_tokens} input + {wl.output_tokens} output tokens")
    print("| engine | setting | time (s) | output tok/s | total tok/s | req/s | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        notes = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
        print(f"| {r.engine} | {r.setting} | {r.seconds:.1f} | {r.output_tok_s:.1f} | {r.total_tok_s:.1f} | "
              f"{r.requests_s:.2f} | {notes} |")
    hf = [r for r in results if r.engine == "hf"]
    ours = [r for r in results if r.engine == "kvserve"]
    if hf and ours:
        best_hf = max(hf, key=lambda r: r.output_tok_s)
        best = max(ours, key=lambda r: r.output_tok_s)
        print(f"best kvserve / best HF output tok/s: {best.output_tok_s / best_hf.output_tok_s:.2f}x "
              f"({best.setting} vs {best_hf.setting})")


def plot_sweep(results: list[Result], path: Path) -> None:
    import matplotlib  # optional (the [bench] extra): only a chart needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the Agg backend)

    sweep = [r for r in results if r.engine == "kvserve" and "max_num_seqs" in r.extra]
    xs = [r.extra["max_num_seqs"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r.output_tok_s for r in sweep], "o-", label="kvserve output tok/s")
    hf = [r for r in results if r.engine == "hf"]
    for i, r in enumerate(hf):
        ax.axhline(r.output_tok_s, linestyle="--", color=f"C{i + 1}", label=f"HF {r.setting}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--max-num-seqs")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput vs max running sequences")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(args) -> int:
    loaded = load_model(args.model, args.dtype, gguf_blocks=args.weights == "gguf",
                        gguf_activations=args.gguf_activations, gguf_mmap=args.gguf_mmap)
    cfg = loaded.config
    wl = make_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), cfg.vocab_size,
                       cfg.bos_token_id, args.seed)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.min_p, args.repetition_penalty)
    sampling.params(1)  # a bad setting fails here, naming the field, before any engine starts
    results: list[Result] = []
    engine_args = dict(kv_cache_gib=args.kv_cache_gib, max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=False, weights=args.weights, pack_weights=args.pack_weights,
                       compile=args.compile, kv_cache_dtype=args.kv_cache_dtype)
    for n in args.max_num_seqs:
        r = run_kvserve(loaded, wl, sampling, max_num_seqs=n, **engine_args)
        r.extra["max_num_seqs"] = n
        results.append(r)
        print(f"kvserve max_num_seqs={n}: {r.output_tok_s:.1f} output tok/s")
    for b in args.hf_batch_sizes:
        r = run_hf(loaded.source, wl, b, resolve_dtype(args.dtype), cfg.pad_token_id or 0, sampling)
        results.append(r)
        print(f"HF static batch {b}: {r.output_tok_s:.1f} output tok/s")
    print_table(results, wl)
    if args.plot:
        plot_sweep(results, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0
