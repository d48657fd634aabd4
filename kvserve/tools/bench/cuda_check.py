"""The GPU check: greedy tokens on CUDA against the CPU engine, then speed beside HF transformers.

Two models: the bundled Gemma 3 270M (its GGUF) and a synthetic Llama-3.2-1B-shaped model (seeded
random bf16 weights written as an HF folder on the spot: real timings, meaningless text).
For each:

1. Greedy equality, fp32 on the device (TF32 off, so cuBLAS computes true fp32), decode steps
   through the captured CUDA graphs, one request at a time and all in one batch, multi-step graph
   runs (--num-scheduler-steps) in one batch, plus the eager path in one batch, against the CPU
   engine's tokens (the exact reference). The two sum in other
   orders, so tokens may part where two logits are within rounding of each other: at the first
   differing position the CPU's log-probabilities of both tokens give the margin; a margin under
   --tie-margin is a near-tie, anything else a mismatch. The CPU reference comes from
   --reference (a file `--write-reference` made on another machine: the device's time is short)
   or is computed here.
2. Speed in bf16 (the CUDA default): batch-1 decode tok/s (graphs, and eager for the graphs' share;
   one graph's replay time; the engine's own Python a step, the replays left out), TTFT of a fresh
   512-token prompt, and the offline workload of `kvserve bench throughput` (64 requests, inputs
   32-512, outputs 32-256, seed 0; timed twice, with the Triton compiles inside each run counted,
   then once more under cProfile for where the host's time goes), all again with multi-step graph
   runs (--num-scheduler-steps); batch-1 decode again with cuBLAS for every matmul
   (pack_weights=False), beside the small-batch kernels the engine chose by timing and those
   timings; HF transformers on the same device and weights in bf16 (`generate`, greedy, its default
   cache and SDPA attention) for batch-1 decode and the 512-token prefill; and the bandwidth bound
   of batch-1 decode: bytes a step reads (weights + K/V at the mean context) over the device's
   measured read bandwidth.

With --json-dir the JSON is rewritten after every engine's figures, so a run cut off by a time
limit keeps what it measured. `--device cpu` runs it all on the CPU (the dry run the tests use).
Exit status: 0 when every request matches or parts at a near-tie; 1 on a mismatch; 2 on bad input
or no device.

    python -m kvserve.tools.bench.cuda_check --help
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.argtypes import positive_float, positive_int
from kvserve.config import MAX_SCHEDULER_STEPS
from kvserve.loading import load_model
from kvserve.loading.loader import default_model_path
from kvserve.loading.save import save_model
from kvserve.tools.bench.latency import decode_bytes_per_token, read_bandwidth_gbs
from kvserve.tools.bench.throughput import INPUT_RANGE, OUTPUT_RANGE, make_workload

# Llama 3.2 1B's shapes (tied embeddings), for the synthetic model.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
                rms_norm_eps=1e-5)
TOP_LOGPROBS = 20


class InputError(Exception):
    """A bad argument or input file, said in words (exit status 2)."""


@dataclass
class Reference:
    """The CPU engine's greedy run of one prompt, with the log-probabilities of its top tokens at
    every generated position (for the margin where a device run parts from it)."""
    prompt: list[int]
    tokens: list[int]
    top_logprobs: list[dict[int, float]]


@dataclass
class Comparison:
    """One request's greedy tokens on the device against the CPU reference."""
    prompt_tokens: int
    equal_tokens: int  # leading tokens that agree
    total_tokens: int
    margin: float | None = None  # CPU log p(CPU token) - log p(device token) where they part; inf if unranked
    verdict: str = "equal"  # "equal", "near-tie", "mismatch"


def compare(ref: Reference, got: list[int], tie_margin: float) -> Comparison:
    want = ref.tokens
    n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    c = Comparison(len(ref.prompt), n, len(want))
    if n == len(want) == len(got):
        return c
    if n >= min(len(want), len(got)):  # one is shorter: not a rounding question
        c.verdict = "mismatch"
        return c
    top = ref.top_logprobs[n]
    mine, theirs = top.get(want[n]), top.get(got[n])
    c.margin = float("inf") if mine is None or theirs is None else mine - theirs
    c.verdict = "near-tie" if c.margin <= tie_margin else "mismatch"
    return c


def reference(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Reference]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outs = llm.generate(prompts, params)
    return [Reference(p, o.token_ids, [dict(t) for t in o.outputs[0].top_logprobs]) for p, o in zip(prompts, outs)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, batched: bool) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if batched:
        return [o.token_ids for o in llm.generate(prompts, params)]
    return [llm.generate(p, params)[0].token_ids for p in prompts]


def text_prompts(tokenizer, path: Path, n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` token ids each, from consecutive stretches of a text file."""
    if not path.is_file():
        raise InputError(f"--text {path}: no such file")
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.encode(text[: 400 * tokens * n])
    if len(ids) < n * tokens:
        raise InputError(f"--text {path}: {len(ids)} tokens, fewer than --prompts x --prompt-tokens = {n * tokens}")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(n)]


def random_prompts(vocab: int, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (tokens,), generator=g).tolist() for _ in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- models
def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` tokens "<t0>".. (the synthetic model's text is meaningless)."""
    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def synthetic_llama(folder: Path, seed: int = 0) -> Path:
    """A Llama-3.2-1B-shaped HF folder with seeded random bf16 weights (initialised on the GPU
    when there is one: seconds instead of minutes)."""
    import transformers as tf  # optional (the [convert] extra): the HF oracle only

    cfg = tf.LlamaConfig(**LLAMA_1B)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    write_tokenizer(folder, cfg.vocab_size)
    del model
    free(device)
    return folder


def hf_model(folder: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM  # optional (the [convert] extra): the HF oracle only

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa").to(device).eval()


# ---------------------------------------------------------------- measurements
def kvserve_speed(llm: LLM, vocab: int, bos: int | None, device: str, repeats: int, offline_requests: int,
                  output_len: int) -> dict:
    """Batch-1 decode and fresh 512-token TTFT (medians of `repeats`), and the offline workload."""
    wl = make_workload(repeats + 1, (512, 512), (1, 1), vocab, bos, 0)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(wl.prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    ttft, decode = [], []
    for ids in wl.prompts[1:]:
        m = llm.generate(ids, params)[0].metrics
        ttft.append(m.ttft)
        decode.append(1 / m.tpot)
    out = {"ttft_512_ms": 1e3 * statistics.median(ttft), "prefill_512_tok_s": 512 / statistics.median(ttft),
           "decode_batch1_tok_s": statistics.median(decode), "decode_runs": decode}
    if offline_requests:
        off = make_workload(offline_requests, INPUT_RANGE, OUTPUT_RANGE, vocab, bos, 0)
        warm = make_workload(8, INPUT_RANGE, (8, 8), vocab, bos, 1)  # kernels of every step shape compiled
        llm.generate(warm.prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        runs, compiles = [], []
        for _ in range(2):  # a first run much slower than the second: one-time costs inside it
            with triton_compiles() as compiled:
                runs.append(offline_seconds(llm, off, device))
            compiles.append(compiled)
        out.update(offline_requests=offline_requests, offline_output_tok_s=off.output_tokens / min(runs),
                   offline_seconds=min(runs), offline_seconds_runs=runs, offline_triton_compiles=compiles)
    return out


@contextmanager
def triton_compiles():
    """Yields a dict that fills, per kernel name, with the Triton kernels compiled (or read from
    Triton's disk cache) inside the block: a kernel variant made in the middle of a measured run
    costs it seconds. None where Triton or its compile hook is missing."""
    try:
        from triton import knobs  # (CUDA builds of torch bring Triton; its knobs are Triton >= 3.4)
    except ImportError:
        knobs = None
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        yield None
        return
    counts: dict[str, int] = {}

    def hook(**kw) -> None:  # (returns None: a true value would skip the compile)
        name = getattr(kw.get("fn"), "name", None) or str(kw.get("repr", "?")).split("[")[0]
        counts[name] = counts.get(name, 0) + 1

    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield counts
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def offline_seconds(llm: LLM, off, device: str) -> float:
    """Wall time of the offline workload `off`, every request submitted at once."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in off.output_lens]
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(off.prompts, params)
    sync(device)
    dt = time.perf_counter() - t
    assert sum(len(o.token_ids) for o in outs) == off.output_tokens
    return dt


def offline_host_profile(llm: LLM, vocab: int, bos: int | None, device: str, requests: int, top: int = 20) -> dict:
    """The offline workload once more under cProfile: engine steps, and the functions that take
    the host's time (by own time), to show where a host-bound run spends it. Profiling slows the
    Python side, so the times rank, they do not measure."""
    off = make_workload(requests, INPUT_RANGE, OUTPUT_RANGE, vocab, bos, 0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in off.output_lens]
    prof = cProfile.Profile()
    sync(device)
    t = time.perf_counter()
    prof.runcall(llm.generate, off.prompts, params)
    sync(device)
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    steps = next((v[1] for (f, _, name), v in stats.items() if name == "step" and f.endswith("llm_engine.py")), 0)
    return {"wall_s": wall, "engine_steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1),
            "top_own_time": [{"function": f"{Path(f).name}:{line}({name})", "calls": v[1], "own_s": round(v[2], 4),
                              "cumulative_s": round(v[3], 4)} for (f, line, name), v in rows]}


def graph_replay_ms(llm: LLM, device: str, replays: int = 200) -> float | None:
    """GPU time of one captured batch-1 decode step (replays back to back, inputs as last
    filled): the engine's decode step time less this is the host's share."""
    graphs = llm.engine.runner.graphs
    if graphs is None or device != "cuda":
        return None
    g = graphs.graphs[1].graph
    g.replay()
    sync(device)
    t = time.perf_counter()
    for _ in range(replays):
        g.replay()
    sync(device)
    return 1e3 * (time.perf_counter() - t) / replays


def host_step_ms(llm: LLM, vocab: int, bos: int | None, steps: int = 256) -> float | None:
    """The engine's own work in a batch-1 decode step through the graphs, the replay left out:
    every replay after the first hands back the first one's outputs, so the time between tokens
    is the host's Python alone (scheduling, the step's buffers, appending and detokenizing the
    token). Beside `graph_replay_ms` and the engine's step it splits the host's share into this
    and the CUDA calls (copies, launch, the wait for the token). None without graphs."""
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    run, first = graphs.run, []

    def replayed(inputs):
        if not first:
            first.append(run(inputs))
        return first[0]

    graphs.run = replayed  # (an instance attribute over the method, removed below)
    try:
        ids = make_workload(1, (8, 8), (1, 1), vocab, bos, 2).prompts[0]
        m = llm.generate(ids, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))[0].metrics
    finally:
        del graphs.run
    return 1e3 * m.tpot


def graph_kernels(llm: LLM, device: str, multi: bool = False) -> dict | None:
    """Kernels one replay of the batch-1 graph launches (the K-step graph's per step with
    `multi`) and their summed GPU time, from the profiler; None off CUDA or where the profiler
    sees no kernels inside graphs. Each fusion shows here as kernels fewer a step."""
    graphs = llm.engine.runner.graphs
    if graphs is None or device != "cuda":
        return None
    g = (graphs.multi if multi else graphs.graphs)[1].graph
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
    except Exception as exc:  # a profiler without CUPTI: the figure is missing, the check goes on
        print(f"  (graph kernels not counted: {exc!r})", flush=True)
        return None
    if not kernels:
        return None
    steps = graphs.num_steps if multi else 1
    return {"kernels_per_step": len(kernels) / steps,
            "kernel_us_per_step": sum(e.time_range.elapsed_us() for e in kernels) / steps,
            "by_kernel": kernel_table(kernels, steps)}


def kernel_table(kernels, steps: int, top: int = 30) -> list[dict]:
    """Per kernel name (cut to 80 characters), launches and summed GPU time a step, the longest
    first: where the step's time goes, and how much of it is small kernels."""
    rows: dict[str, list[float]] = {}
    for e in kernels:
        row = rows.setdefault(e.name[:80], [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us()
    ranked = sorted(rows.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return [{"kernel": name, "launches_per_step": n / steps, "us_per_step": round(us / steps, 2),
             "us_each": round(us / n, 2)} for name, (n, us) in ranked]


def decode_only_speed(llm: LLM, vocab: int, bos: int | None, repeats: int, output_len: int) -> dict:
    wl = make_workload(repeats + 1, (512, 512), (1, 1), vocab, bos, 1)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(wl.prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    runs = [1 / llm.generate(ids, params)[0].metrics.tpot for ids in wl.prompts[1:]]
    return {"decode_batch1_tok_s": statistics.median(runs), "decode_runs": runs}


@torch.inference_mode()
def hf_speed(model, vocab: int, device: str, repeats: int, output_len: int) -> dict:
    """HF transformers on fresh 512-token prompts (medians of `repeats`): TTFT as the time of
    `generate` for one new token, batch-1 greedy decode from the time `output_len` more tokens
    add to that."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, vocab, (1, 512), generator=g).to(device) for _ in range(repeats + 1)]
    gen = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed_generate(ids, n: int) -> float:
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
        sync(device)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t

    timed_generate(prompts[0], 32)  # warm-up
    ttft, decode = [], []
    for ids in prompts[1:]:
        ttft.append(timed_generate(ids, 1))
        decode.append((output_len - 1) / max(timed_generate(ids, output_len) - ttft[-1], 1e-9))
    return {"ttft_512_ms": 1e3 * statistics.median(ttft), "prefill_512_tok_s": 512 / statistics.median(ttft),
            "decode_batch1_tok_s": statistics.median(decode), "decode_runs": decode}


# ---------------------------------------------------------------- one model
@dataclass
class ModelReport:
    name: str
    greedy: dict = field(default_factory=dict)  # "graphs, one at a time" / "graphs, one batch" / "eager, one batch"
    speed: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(c.verdict != "mismatch" for rows in self.greedy.values() for c in rows)


def check_greedy(source, refs: list[Reference], args, report: ModelReport) -> None:
    """fp32 on the device, graphs (one at a time, one batch), multi-step graph runs (one batch,
    where graphs are captured) and eager (one batch), against refs."""
    loaded = load_model(source, "float32", args.device)
    prompts = [r.prompt for r in refs]
    n = len(refs[0].tokens)
    for eager in (False, True):
        llm = LLM(loaded=loaded, device=args.device, dtype="float32", enable_prefix_caching=False,
                  kv_cache_gib=args.kv_cache_gib, enforce_eager=eager)
        modes = [True] if eager else [False, True]
        for batched in modes:
            label = f"{'eager' if eager else 'graphs'}, {'one batch' if batched else 'one at a time'}"
            got = greedy(llm, prompts, n, batched)
            report.greedy[label] = [compare(r, g, args.tie_margin) for r, g in zip(refs, got)]
            print_greedy(label, report.greedy[label])
        graphs = llm.engine.runner.graphs is not None
        del llm
        if graphs and args.num_scheduler_steps > 1:
            llm = LLM(loaded=loaded, device=args.device, dtype="float32", enable_prefix_caching=False,
                      kv_cache_gib=args.kv_cache_gib, max_num_seqs=len(prompts),
                      num_scheduler_steps=args.num_scheduler_steps)
            label = f"graphs, {args.num_scheduler_steps}-step runs, one batch"
            got = greedy(llm, prompts, n, True)
            report.greedy[label] = [compare(r, g, args.tie_margin) for r, g in zip(refs, got)]
            print_greedy(label, report.greedy[label])
            del llm
    del loaded
    free(args.device)


def measure_speed(source, hf_folder: Path | None, args, report: ModelReport, offline: int,
                  progress: Callable[[], None] = lambda: None) -> None:
    """Batch-1 decode against the bandwidth bound first, then what explains it (graph replay,
    kernels, multi-step, cuBLAS only, eager), HF last; `progress()` saves what is done after each
    engine (a run cut off by the device's time limit keeps its figures)."""
    loaded = load_model(source, args.speed_dtype, args.device)
    cfg = loaded.config
    llm = LLM(loaded=loaded, device=args.device, dtype=args.speed_dtype, kv_cache_gib=args.kv_cache_gib)
    sp = report.speed
    sp["kvserve"] = kvserve_speed(llm, cfg.vocab_size, cfg.bos_token_id, args.device, args.repeats, offline,
                                  args.output_len)
    context = 512 + args.output_len // 2
    step_bytes = decode_bytes_per_token(loaded, context)
    bw = args.bandwidth_gbs
    sp["bound"] = {"bytes_per_token": step_bytes, "mean_context": context, "read_bandwidth_gbs": bw,
                   "decode_tok_s": bw * 1e9 / step_bytes}
    sp["kvserve_share_of_bound"] = sp["kvserve"]["decode_batch1_tok_s"] / sp["bound"]["decode_tok_s"]
    print(f"  bound: {step_bytes / 1e6:.1f} MB a step at {bw:.0f} GB/s -> {sp['bound']['decode_tok_s']:.0f} tok/s; "
          f"kvserve at {100 * sp['kvserve_share_of_bound']:.0f}%", flush=True)
    progress()
    sp["kvserve"]["graph_step_ms"] = graph_replay_ms(llm, args.device)
    sp["kvserve"]["host_step_ms"] = host_step_ms(llm, cfg.vocab_size, cfg.bos_token_id)
    sp["kvserve"]["graph_kernels"] = graph_kernels(llm, args.device)
    # cuBLAS or a Triton tiling per projection, with the times that chose it (accel/cuda_gemv.py)
    sp["kvserve"]["small_batch_tuning"] = getattr(loaded.model, "small_batch_tuning", None)
    if offline:
        sp["kvserve"]["offline_host_profile"] = offline_host_profile(llm, cfg.vocab_size, cfg.bos_token_id,
                                                                     args.device, offline)
    print(f"  kvserve {args.speed_dtype}: {fmt(sp['kvserve'])}", flush=True)
    progress()
    graphs = llm.engine.runner.graphs is not None
    del llm
    free(args.device)
    if graphs and args.num_scheduler_steps > 1:
        multi = LLM(loaded=loaded, device=args.device, dtype=args.speed_dtype, kv_cache_gib=args.kv_cache_gib,
                    num_scheduler_steps=args.num_scheduler_steps)
        sp["kvserve_multi_step"] = kvserve_speed(multi, cfg.vocab_size, cfg.bos_token_id, args.device, args.repeats,
                                                 offline, args.output_len)
        sp["kvserve_multi_step"]["num_scheduler_steps"] = args.num_scheduler_steps
        sp["kvserve_multi_step"]["graph_kernels"] = graph_kernels(multi, args.device, multi=True)
        sp["multi_step_share_of_bound"] = sp["kvserve_multi_step"]["decode_batch1_tok_s"] / sp["bound"]["decode_tok_s"]
        print(f"  kvserve, {args.num_scheduler_steps}-step runs: {fmt(sp['kvserve_multi_step'])}; "
              f"{100 * sp['multi_step_share_of_bound']:.0f}% of the bound", flush=True)
        progress()
        del multi
        free(args.device)
    if graphs:  # the same graphs with cuBLAS for every matmul: what the chosen Triton kernels gain
        plain = LLM(loaded=loaded, device=args.device, dtype=args.speed_dtype, kv_cache_gib=args.kv_cache_gib,
                    pack_weights=False)
        sp["kvserve_cublas"] = decode_only_speed(plain, cfg.vocab_size, cfg.bos_token_id, args.repeats,
                                                 args.output_len)
        sp["kvserve_cublas"]["graph_step_ms"] = graph_replay_ms(plain, args.device)
        sp["small_batch_kernels_speedup"] = (sp["kvserve"]["decode_batch1_tok_s"]
                                             / sp["kvserve_cublas"]["decode_batch1_tok_s"])
        print(f"  kvserve, cuBLAS only: {fmt(sp['kvserve_cublas'])}; the chosen kernels "
              f"{sp['small_batch_kernels_speedup']:.2f}x", flush=True)
        progress()
        del plain
        free(args.device)
    eager = LLM(loaded=loaded, device=args.device, dtype=args.speed_dtype, kv_cache_gib=args.kv_cache_gib,
                enforce_eager=True)
    sp["kvserve_eager"] = decode_only_speed(eager, cfg.vocab_size, cfg.bos_token_id, args.repeats, args.output_len)
    print(f"  kvserve eager: {fmt(sp['kvserve_eager'])}", flush=True)
    progress()
    del eager
    del loaded
    free(args.device)
    if hf_folder is not None:
        model = hf_model(hf_folder, args.device, getattr(torch, args.speed_dtype))
        sp["hf"] = hf_speed(model, cfg.vocab_size, args.device, args.repeats, args.output_len)
        sp["decode_vs_hf"] = sp["kvserve"]["decode_batch1_tok_s"] / sp["hf"]["decode_batch1_tok_s"]
        sp["prefill_vs_hf"] = sp["kvserve"]["prefill_512_tok_s"] / sp["hf"]["prefill_512_tok_s"]
        print(f"  HF {args.speed_dtype}: {fmt(sp['hf'])}; kvserve decode {sp['decode_vs_hf']:.2f}x, "
              f"prefill {sp['prefill_vs_hf']:.2f}x", flush=True)
        del model
        free(args.device)


def attempt(report: ModelReport, step: str, fn, device: str) -> None:
    """Run one step of a model's checks; an exception is reported and the run goes on (the
    device's minutes are few). Bad input still stops everything."""
    try:
        fn()
    except InputError:
        raise
    except Exception:
        report.errors.append(f"{step}: {traceback.format_exc()}")
        print(report.errors[-1], flush=True)
        free(device)


# ---------------------------------------------------------------- references
def gemma_references(args) -> list[Reference]:
    if args.reference is not None:
        return load_references(args.reference, "gemma")
    if not args.text:
        raise InputError("the bundled model's prompts come from --text (or from --reference)")
    llm = LLM(loaded=load_model(args.model, "float32", "cpu"), enable_prefix_caching=False, kv_cache_gib=0.5)
    refs = reference(llm, text_prompts(llm.tokenizer, args.text, args.prompts, args.prompt_tokens), args.max_tokens)
    del llm
    return refs


def cpu_references(folder: Path, args, prompts: list[list[int]]) -> list[Reference]:
    llm = LLM(loaded=load_model(folder, "float32", "cpu"), enable_prefix_caching=False, kv_cache_gib=0.5,
              pack_weights=False)
    refs = reference(llm, prompts, args.synthetic_max_tokens)
    del llm
    gc.collect()
    return refs


def load_references(path: Path, key: str) -> list[Reference]:
    try:
        data = json.loads(path.read_text())[key]
        return [Reference(r["prompt"], r["tokens"], [{int(k): v for k, v in top.items()} for top in r["top_logprobs"]])
                for r in data]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"--reference {path}: not a reference file with {key!r} ({e})") from None


# ---------------------------------------------------------------- output
def fmt(d: dict) -> str:
    """The float figures of d, and of the dicts inside it."""
    flat = {f"{k}.{k2}": v2 for k, v in d.items() if isinstance(v, dict) for k2, v2 in v.items()}
    return ", ".join(f"{k} {v:.2f}" for k, v in {**d, **flat}.items() if isinstance(v, float))


def print_greedy(label: str, rows: list[Comparison]) -> None:
    equal = sum(c.verdict == "equal" for c in rows)
    ties = [round(c.margin, 5) for c in rows if c.verdict == "near-tie"]
    bad = [(c.equal_tokens, c.margin) for c in rows if c.verdict == "mismatch"]
    print(f"  {label}: {equal}/{len(rows)} equal to the CPU, {len(ties)} part at a near-tie {ties}, "
          f"{len(bad)} mismatch {bad}", flush=True)


def save(out: dict, json_dir: str | None, device: str) -> None:
    if json_dir is None:
        return
    path = Path(json_dir) / f"cuda_check_{device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__")
                               else str(o)))


def environment(device: str) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version(), "device": device}
    if device == "cuda":
        import triton  # CUDA builds of torch bring it

        env.update(device_name=torch.cuda.get_device_name(), triton=triton.__version__,
                   sms=torch.cuda.get_device_properties(0).multi_processor_count)
    return env


def gemma_hf_folder(args, tmp: Path) -> Path | None:
    """The bundled model written as an HF folder (bf16), for HF transformers to read."""
    if args.skip_hf:
        return None

    return save_model(load_model(args.model, "float32", "cpu"), tmp / "gemma_hf", dtype=torch.bfloat16)


# ---------------------------------------------------------------- main
def write_reference(args) -> int:
    """On a CPU machine: the bundled model's reference run, for --reference on the device."""
    refs = gemma_references(args)
    args.write_reference.write_text(json.dumps({"gemma": [asdict(r) for r in refs]}))
    print(f"wrote {len(refs)} references of {len(refs[0].tokens)} tokens to {args.write_reference}")
    return 0


def run(args) -> dict:
    started = time.perf_counter()
    out = {"environment": environment(args.device), "models": {}}

    def checkpoint() -> None:
        """Save what is done so far, with the seconds it took (a lent device's minutes are few)."""
        out["environment"]["wall_s"] = round(time.perf_counter() - started, 1)
        save(out, args.json_dir, args.device)

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 matmuls: the CPU's numbers, other order
        torch.backends.cudnn.allow_tf32 = False
    args.bandwidth_gbs = read_bandwidth_gbs(args.bandwidth_gib, repeats=10, device=args.device)
    out["environment"]["read_bandwidth_gbs"] = args.bandwidth_gbs
    print(f"{out['environment']}", flush=True)
    models = out["models"]
    # Order: what the acceptance needs first (the bundled model's tokens, then the synthetic
    # model's tokens and speed), the bundled model's speed last.
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_gemma:
            gemma = models["gemma"] = ModelReport("Gemma 3 270M (bundled GGUF)")
            print(f"\n== {gemma.name}", flush=True)
            attempt(gemma, "greedy", lambda: check_greedy(args.model, gemma_references(args), args, gemma),
                    args.device)
            checkpoint()
        if not args.skip_synthetic:
            llama = models["llama_1b"] = ModelReport("synthetic Llama 3.2 1B shapes, bf16 random weights")
            print(f"\n== {llama.name}", flush=True)
            folder = synthetic_llama(Path(tmp) / "llama1b")
            prompts = random_prompts(LLAMA_1B["vocab_size"], args.synthetic_prompts, args.prompt_tokens)
            attempt(llama, "greedy", lambda: check_greedy(folder, cpu_references(folder, args, prompts), args, llama),
                    args.device)
            checkpoint()
            if not args.skip_speed:
                attempt(llama, "speed", lambda: measure_speed(folder, None if args.skip_hf else folder, args, llama,
                                                              args.offline_requests, checkpoint),
                        args.device)
            checkpoint()
        if not args.skip_gemma and not args.skip_speed:
            print(f"\n== {gemma.name}: speed", flush=True)
            attempt(gemma, "speed", lambda: measure_speed(args.model, gemma_hf_folder(args, Path(tmp)), args, gemma,
                                                          args.offline_requests, checkpoint), args.device)
    out["ok"] = all(m.ok for m in models.values())
    checkpoint()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, help="the bundled model's GGUF (default: the installed one)")
    p.add_argument("--text", type=Path, default=None, help="text the bundled model's prompts come from")
    p.add_argument("--reference", type=Path, default=None, help="the bundled model's CPU reference (--write-reference)")
    p.add_argument("--write-reference", type=Path, default=None,
                   help="write the bundled model's CPU reference to this file and stop")
    p.add_argument("--prompts", type=positive_int, default=8)
    p.add_argument("--prompt-tokens", type=positive_int, default=64)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--synthetic-prompts", type=positive_int, default=4)
    p.add_argument("--synthetic-max-tokens", type=positive_int, default=32)
    p.add_argument("--tie-margin", type=float, default=1e-2,
                   help="log-prob margin under which parting tokens count as a near-tie (default 0.01)")
    p.add_argument("--speed-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--offline-requests", type=positive_int, default=64)
    p.add_argument("--kv-cache-gib", type=positive_float, default=4.0)
    p.add_argument("--num-scheduler-steps", type=positive_int, default=8,
                   help="multi-step graph runs checked and timed beside single steps (1: not at all)")
    p.add_argument("--bandwidth-gib", type=positive_float, default=4.0)
    p.add_argument("--skip-speed", action="store_true", help="the greedy checks only")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-gemma", action="store_true")
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--json-dir", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_scheduler_steps > MAX_SCHEDULER_STEPS:  # before the device's minutes are spent
        parser.error(f"--num-scheduler-steps must be at most {MAX_SCHEDULER_STEPS}, got {args.num_scheduler_steps}")
    if args.model is None:
        args.model = default_model_path()
    args.model = Path(args.model)
    try:
        if args.write_reference is not None:
            return write_reference(args)
        if args.device == "cuda" and not torch.cuda.is_available():
            print("cuda_check: --device cuda, but torch.cuda.is_available() is False (a CPU build of torch, "
                  "or no GPU): nothing to check", file=sys.stderr)
            return 2
        out = run(args)
    except InputError as e:
        print(f"cuda_check: {e}", file=sys.stderr)
        return 2
    print("OK" if out["ok"] else "MISMATCH OR ERROR")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
