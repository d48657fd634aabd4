"""Peers benchmark: kvserve (fp32, int8, int4 weights), HF transformers, llama.cpp and vLLM (CPU)
side by side, one run.

    python benchmarks/peers/run.py [--engines kvserve,kvserve-int8,kvserve-int4,kvserve-gguf,hf,llamacpp,vllm]
                                   [--repeats 3] [--rounds 1] [--quick]
                                   [--json-dir DIR] [--plot PATH] [--threads N]

The prompts are built once here, as token ids with a fixed seed, and the same ids go to every
engine; each engine runs alone in its own subprocess (its own venv where it has one) and prints
one JSON line. With --rounds R every engine runs R times, the engines in turns (the order reversed
every other round), so a slow spell of a shared machine falls on all of them rather than on the one
running then; the medians are over all R x --repeats runs. Metrics (defined in `_common.py`):

- decode tok/s: batch-1 greedy, --decode-new-tokens after a short text prompt, first token excluded;
- prefill tok/s and TTFT: a fresh --prefill-len-token prompt per run (prefix caching off);
- throughput: --num-prompts requests, inputs/outputs uniform in --input-len/--output-len (random
  ids as `kvserve bench throughput`, EOS ignored), output tok/s.

Prints a markdown table with the raw runs and kvserve/peer ratios (kvserve = the fp32 engine), the
low-bit acceptance ratios (ACCEPTANCE), writes results.json and a bar chart. An engine whose venv
is missing or whose run fails is "not available: <reason>".
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import LLAMACPP_KV_MODES, RESULT_PREFIX

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KVSERVE_WEIGHTS = ["int8", "int4", "gguf"]  # kvserve-<w>: EngineConfig.weights int8 / int4 (RTN at start), gguf (the file's blocks)
# kvserve-compile: fp32 through torch.compile (EngineConfig.compile); kvserve-gguf-f32kv: the file's blocks
# with an fp32 KV pool (kvserve-gguf keeps its default fp16 pool, llama.cpp's default cache type).
KVSERVE_ENGINES = ["kvserve", *(f"kvserve-{w}" for w in KVSERVE_WEIGHTS), "kvserve-gguf-f32kv",
                   "kvserve-compile"]  # one adapter, a spec section each
ALL_ENGINES = [*KVSERVE_ENGINES, "hf", "llamacpp", "vllm"]
# Batch-1 decode tok/s: (engine, peer, minimum engine / peer), the low-bit engines' targets.
ACCEPTANCE = [("kvserve-int4", "llamacpp", 1.0), ("kvserve-int8", "hf", 4.0)]
DECODE_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
               "Gutenberg combined movable metal type, oil-based ink and a wooden press. Within fifty years")


@dataclass
class EngineSpec:
    """Where an engine's adapter runs."""
    name: str
    python: Path
    adapter: Path
    setup_hint: str = ""


def engine_specs() -> dict[str, EngineSpec]:
    main_py = REPO / ".venv" / "bin" / "python"
    main_py = main_py if main_py.exists() else Path(sys.executable)
    return {
        **{e: EngineSpec(e, main_py, HERE / "adapter_kvserve.py") for e in KVSERVE_ENGINES},
        "hf": EngineSpec("hf", main_py, HERE / "adapter_hf.py"),
        "llamacpp": EngineSpec("llamacpp", HERE / ".venv-llamacpp" / "bin" / "python", HERE / "adapter_llamacpp.py",
                               "benchmarks/peers/setup_peers.sh llamacpp"),
        "vllm": EngineSpec("vllm", HERE / ".venv-vllm" / "bin" / "python", HERE / "adapter_vllm.py",
                           "benchmarks/peers/setup_peers.sh vllm"),
    }


@dataclass
class Outcome:
    """One engine's result as the driver sees it: the adapter's JSON, or why there is none."""
    engine: str
    result: dict = field(default_factory=dict)
    unavailable: str | None = None
    wall_s: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ALL_ENGINES), help="comma list of " + ", ".join(ALL_ENGINES))
    p.add_argument("--repeats", type=int, default=3, help="runs per metric; medians are reported (>= 3 for reports)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, in turns; medians over rounds x repeats runs")
    p.add_argument("--quick", action="store_true", help="tiny settings: smoke-test every adapter in a minute or two")
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled Gemma 3 270M Q4_K_M)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per engine (torch, llama.cpp, vLLM)")
    p.add_argument("--decode-new-tokens", type=int, default=128)
    p.add_argument("--decode-context", type=int, default=0,
                   help="decode after a random prompt of this many tokens instead of the short text (0: the text): "
                        "batch-1 decode at a long context, where the steps read the KV cache too")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--hf-batch-sizes", default="8,16,32", help="HF static batch sizes swept for throughput")
    p.add_argument("--kvserve-max-num-seqs", default="64", help="kvserve --max-num-seqs for throughput (comma list: sweep)")
    p.add_argument("--llamacpp-parallel", default="16,32",
                   help="llama.cpp sequences decoded together for throughput, comma list swept (1 = one request "
                        "at a time)")
    p.add_argument("--llamacpp-kv", default="unified,per-sequence",
                   help="llama.cpp KV layouts swept for throughput: unified (one buffer, mixed batches) and/or "
                        "per-sequence (kv_unified off, prompts decoded apart)")
    p.add_argument("--llamacpp-flash-attn", default="off,on", help="llama.cpp flash attention swept for throughput")
    p.add_argument("--metrics", default="decode,prefill,throughput")
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    p.add_argument("--json-dir", default=None, help="folder for spec.json, per-engine logs and results.json "
                                                   "(default benchmarks/peers/results/<time>)")
    p.add_argument("--plot", default=None, help="bar chart PNG (default <json-dir>/peers.png)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.threads < 1 or args.rounds < 1:
        p.error("--repeats, --rounds and --threads must be >= 1")
    if not all(x.strip().isdigit() and int(x) >= 1 for x in args.llamacpp_parallel.split(",")):
        p.error(f"--llamacpp-parallel: expected a comma list of integers >= 1, got {args.llamacpp_parallel!r}")
    for flag, value, allowed in (("--llamacpp-kv", args.llamacpp_kv, LLAMACPP_KV_MODES),
                                 ("--llamacpp-flash-attn", args.llamacpp_flash_attn, ("off", "on"))):
        if not all(x.strip() in allowed for x in value.split(",")):
            p.error(f"{flag}: expected a comma list of {', '.join(allowed)}, got {value!r}")
    if args.quick:
        args.decode_new_tokens, args.prefill_len, args.num_prompts = 16, 64, 4  # 16: the full token check
        args.input_len, args.output_len = [16, 64], [8, 16]
        args.hf_batch_sizes, args.kvserve_max_num_seqs, args.llamacpp_parallel = "2,4", "4", "4"
    return args


def build_spec(args: argparse.Namespace) -> dict:
    """The prompts every engine gets (token ids, fixed seed) and the per-engine options."""
    from kvserve.loading import load_model
    from kvserve.loading.loader import default_model_path
    from kvserve.tools.bench.throughput import make_workload

    model_path = Path(args.model) if args.model else default_model_path()
    # Config and tokenizer only: a GGUF's blocks are memory-mapped, never dequantized (an 8B file in
    # fp32 would not fit beside the engines).
    loaded = load_model(str(model_path), gguf_blocks=model_path.suffix == ".gguf")
    cfg, tok = loaded.config, loaded.tokenizer
    decode_prompt = tok.encode(DECODE_TEXT)
    del loaded
    vocab, bos = cfg.vocab_size, cfg.bos_token_id
    if args.decode_context < 0:
        raise SystemExit(f"--decode-context must be >= 0, got {args.decode_context}")
    if args.decode_context:
        decode_prompt = make_workload(1, (args.decode_context, args.decode_context), (1, 1), vocab, bos,
                                      args.seed + 2).prompts[0]
    # repeats + 1 distinct prefill prompts: the first one is the warm-up.
    prefill = make_workload(args.repeats + 1, (args.prefill_len, args.prefill_len), (1, 1), vocab, bos,
                            args.seed + 1).prompts
    wl = make_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, bos, args.seed)
    longest = max(args.prefill_len + 1, len(decode_prompt) + args.decode_new_tokens,
                  max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens)))
    return {
        "model_path": str(model_path),
        "model": str(model_path),
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "check_tokens": args.check_tokens,
        "metrics": args.metrics.split(","),
        "max_model_len": longest + 16,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "pad_token_id": cfg.pad_token_id or 0,
        "decode_text": DECODE_TEXT,
        "decode_prompt": decode_prompt,
        "decode_new_tokens": args.decode_new_tokens,
        "prefill_prompts": prefill,
        "throughput_prompts": wl.prompts,
        "throughput_output_lens": wl.output_lens,
        **_kvserve_sections({"dtype": "float32", "max_num_seqs": _ints(args.kvserve_max_num_seqs)}),
        "hf": {"dtype": "float32", "batch_sizes": _ints(args.hf_batch_sizes)},
        "llamacpp": {"parallel": _ints(args.llamacpp_parallel), "kv": _names(args.llamacpp_kv),
                     "flash_attn_batched": [x == "on" for x in _names(args.llamacpp_flash_attn)]},
        "vllm": {"dtype": "float32", "hf_dir": str(HERE / ".cache" / (model_path.stem + "-hf-fp32"))},
    }


def _kvserve_sections(opts: dict) -> dict[str, dict]:
    """The spec sections of kvserve, its low-bit variants (same options plus `weights`, and
    `kv_cache_dtype` for the fp32 pool) and its torch.compile variant (plus `compile`)."""
    return {"kvserve": opts, **{f"kvserve-{w}": dict(opts, weights=w) for w in KVSERVE_WEIGHTS},
            "kvserve-gguf-f32kv": dict(opts, weights="gguf", kv_cache_dtype="fp32"),
            "kvserve-compile": dict(opts, compile=True)}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",")]


def engine_env(name: str, threads: int) -> dict[str, str]:
    """The subprocess environment: thread counts pinned to --threads, nothing shared."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(HERE))
    if name == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
        preload = vllm_preload()
        if preload:
            env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
    return env


def vllm_preload() -> list[str]:
    """What vLLM's CPU guide preloads: tcmalloc (libtcmalloc-minimal4; setup_peers.sh installs
    it) and the Intel OpenMP runtime its venv ships (libiomp5.so); those found on this machine."""
    tcmalloc = sorted(Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4"))[:1]
    iomp = [p for p in [HERE / ".venv-vllm" / "lib" / "libiomp5.so"] if p.exists()]
    return [str(p) for p in tcmalloc + iomp]


def run_engine(spec: EngineSpec, spec_path: Path, out_dir: Path, threads: int, timeout: float,
               tag: str = "") -> Outcome:
    """Run one adapter in its own process; its stderr goes to <out_dir>/<engine><tag>.log."""
    if not spec.python.exists():
        return Outcome(spec.name, unavailable=f"venv missing ({spec.python.parent.parent.name}; run {spec.setup_hint})")
    out_json, log_path = out_dir / f"{spec.name}{tag}.json", out_dir / f"{spec.name}{tag}.log"
    cmd = [str(spec.python), str(spec.adapter), str(spec_path), str(out_json), spec.name]
    print(f"== {spec.name}: {' '.join(cmd)} (log {log_path})", flush=True)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout,
                                  env=engine_env(spec.name, threads), cwd=str(REPO))
        except subprocess.TimeoutExpired:
            return Outcome(spec.name, unavailable=f"timed out after {timeout:.0f} s (see {log_path})",
                           wall_s=time.perf_counter() - t)
    wall = time.perf_counter() - t
    with open(log_path, "a") as log:  # the engine's own stdout logging (vLLM logs there)
        log.write(proc.stdout)
    lines = [ln[len(RESULT_PREFIX):] for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        tail = log_path.read_text().strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return Outcome(spec.name, unavailable=f"no result, exit {proc.returncode}: {tail[0][:200]}", wall_s=wall)
    result = json.loads(lines[-1])
    out = Outcome(spec.name, result, wall_s=wall)
    if result.get("error") and not (result.get("decode_runs") or result.get("prefill_runs")):
        out.unavailable = result["error"][:300]
    return out


RUN_KEYS = ("decode_runs", "ttft_runs", "prefill_runs", "throughput_runs")


def merge_rounds(rounds: list[Outcome]) -> Outcome:
    """One engine's outcomes of several rounds -> one: the runs of every round that gave a result
    (in round order), the first such round's other fields, notes without repeats, total wall time."""
    got = [o for o in rounds if not o.unavailable]
    wall = sum(o.wall_s for o in rounds)
    if not got:
        return Outcome(rounds[0].engine, unavailable=rounds[0].unavailable, wall_s=wall)
    result = dict(got[0].result)
    for key in RUN_KEYS:
        result[key] = [x for o in got for x in o.result.get(key, [])]
    result["notes"] = list(dict.fromkeys(n for o in got for n in o.result.get("notes", [])))
    if len(rounds) > 1:
        result["rounds"] = len(got)
        result["load_s"] = [o.result.get("load_s") for o in got]
    return Outcome(rounds[0].engine, result, wall_s=wall)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(o: Outcome) -> dict:
    """Medians of one engine's runs."""
    r = o.result
    tp = [x["output_tok_s"] for x in r.get("throughput_runs", [])]
    return {"decode_tok_s": med(r.get("decode_runs", [])), "prefill_tok_s": med(r.get("prefill_runs", [])),
            "ttft_ms": (med(r.get("ttft_runs", [])) or 0) * 1e3 or None, "throughput_tok_s": med(tp)}


def _fmt(x: float | None, runs: list[float] | None = None, digits: int = 1) -> str:
    if x is None:
        return "–"
    s = f"{x:.{digits}f}"
    if runs and len(runs) > 1:
        s += " (" + ", ".join(f"{v:.{digits}f}" for v in runs) + ")"
    return s


def _ratio(a: float | None, b: float | None, inverse: bool = False) -> str:
    if not a or not b:
        return "–"
    return f"{(b / a if inverse else a / b):.2f}x"


def print_table(outcomes: list[Outcome], spec: dict) -> str:
    """Markdown: medians with raw runs in parentheses, then ratios of the fp32 kvserve to every other
    engine (> 1: kvserve faster), then the ACCEPTANCE decode ratios of the low-bit engines."""
    lines = [f"decode: batch-1 greedy, {len(spec['decode_prompt'])}-token prompt + {spec['decode_new_tokens']} new tokens; "
             f"prefill/TTFT: fresh {len(spec['prefill_prompts'][0])}-token prompt; throughput: "
             f"{len(spec['throughput_prompts'])} requests; {spec['threads']} threads; median of "
             f"{_runs_text(spec)} (raw runs in parentheses)", "",
             "| engine | weights | decode tok/s | prefill tok/s | TTFT ms | throughput out tok/s | throughput setting "
             f"| first {spec['check_tokens']} tokens = kvserve |",
             "|---|---|---|---|---|---|---|---|"]
    ref = next((o for o in outcomes if o.engine == "kvserve" and not o.unavailable), None)
    ref_first = ref.result.get("first_tokens") if ref else None
    for o in outcomes:
        if o.unavailable:
            lines.append(f"| {o.engine} | not available: {o.unavailable} | | | | | | |")
            continue
        r, s = o.result, summarize(o)
        same = "–" if not ref_first or o is ref else _match(r.get("first_tokens", []), ref_first)
        tps = [x["output_tok_s"] for x in r.get("throughput_runs", [])]
        lines.append(f"| {o.engine} | {r.get('dtype', '?')} | {_fmt(s['decode_tok_s'], r.get('decode_runs'), 2)} | "
                     f"{_fmt(s['prefill_tok_s'], r.get('prefill_runs'))} | "
                     f"{_fmt(s['ttft_ms'], [t * 1e3 for t in r.get('ttft_runs', [])])} | {_fmt(s['throughput_tok_s'], tps)} | "
                     f"{r.get('throughput_setting', '')} | {same} |")
    if ref and any(o is not ref and not o.unavailable for o in outcomes):
        rs = summarize(ref)
        lines += ["", "| kvserve / peer | decode | prefill | TTFT (peer / kvserve) | throughput |", "|---|---|---|---|---|"]
        for o in outcomes:
            if o is ref or o.unavailable:
                continue
            s = summarize(o)
            lines.append(f"| kvserve / {o.engine} | {_ratio(rs['decode_tok_s'], s['decode_tok_s'])} | "
                         f"{_ratio(rs['prefill_tok_s'], s['prefill_tok_s'])} | {_ratio(rs['ttft_ms'], s['ttft_ms'], True)} | "
                         f"{_ratio(rs['throughput_tok_s'], s['throughput_tok_s'])} |")
    decode = {o.engine: summarize(o)["decode_tok_s"] for o in outcomes if not o.unavailable}
    accept = [(a, b, target) for a, b, target in ACCEPTANCE if decode.get(a) and decode.get(b)]
    if accept:
        lines += ["", "| batch-1 decode tok/s | ratio | target | met |", "|---|---|---|---|"]
        for a, b, target in accept:
            met = "yes" if decode[a] / decode[b] >= target else "no"
            lines.append(f"| {a} / {b} | {_ratio(decode[a], decode[b])} | >= {target:g}x | {met} |")
    notes = [(o.engine, n) for o in outcomes for n in o.result.get("notes", [])]
    notes += [(o.engine, "error: " + o.result["error"]) for o in outcomes if o.result.get("error") and not o.unavailable]
    if notes:
        lines += [""] + [f"- {e}: {n}" for e, n in notes]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _runs_text(spec: dict) -> str:
    rounds = spec.get("rounds", 1)
    if rounds == 1:
        return str(spec["repeats"])
    return f"{rounds} rounds x {spec['repeats']} (engines in turns, the order reversed every other round)"


def _match(tokens: list[int], ref: list[int]) -> str:
    n = len(ref)
    same = sum(1 for _ in _takewhile_equal(tokens, ref))
    return f"yes ({n}/{n})" if same == n and len(tokens) >= n else f"no (first {same} of {n} equal)"


def _takewhile_equal(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def plot(outcomes: list[Outcome], path: Path) -> None:
    """A panel per metric that ran (decode, prefill, throughput tok/s), one bar per engine: the
    median, with the spread of the raw runs as an error bar; an engine keeps its colour in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [o for o in outcomes if not o.unavailable]
    panels = [("batch-1 decode tok/s", "decode_runs", None), ("prefill tok/s", "prefill_runs", None),
              ("offline throughput, output tok/s", "throughput_runs", "output_tok_s")]
    panels = [p for p in panels if any(o.result.get(p[1]) for o in ok)]  # only the metrics that ran
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.4, 1.1 * len(ok)) * len(panels), 4), squeeze=False)
    axes = axes[0]
    colour = {o.engine: f"C{i}" for i, o in enumerate(ok)}
    for ax, (title, key, sub) in zip(axes, panels):
        names, meds, lo, hi, colours = [], [], [], [], []
        for o in ok:
            runs = [x[sub] if sub else x for x in o.result.get(key, [])]
            if not runs:
                continue
            m = statistics.median(runs)
            names.append(f"{o.engine}\n{o.result.get('dtype', '')}")
            colours.append(colour[o.engine])
            meds.append(m)
            lo.append(m - min(runs))
            hi.append(max(runs) - m)
        bars = ax.bar(names, meds, yerr=[lo, hi], capsize=4, color=colours)
        ax.bar_label(bars, fmt="%.1f", padding=2)
        ax.margins(y=0.1)  # room for the labels above the tallest bar
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("kvserve vs peers (median of runs; bars span min-max)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def export_hf_dir(spec: dict, out_dir: Path) -> str | None:
    """vLLM reads an HF folder: write the GGUF's dequantized fp32 weights and tokenizer once (HF
    transformers' GGUF reader, in the repo venv). Returns an error string, or None."""
    target = Path(spec["vllm"]["hf_dir"])
    if (target / "config.json").exists():
        return None
    py = engine_specs()["hf"].python
    proc = subprocess.run([str(py), str(HERE / "export_hf.py"), spec["model_path"], str(target)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=engine_env("hf", spec["threads"]))
    (out_dir / "export_hf.log").write_text(proc.stdout)
    return None if proc.returncode == 0 else f"HF export failed: {proc.stdout.strip().splitlines()[-1:]}"


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ALL_ENGINES)
    if unknown:
        raise SystemExit(f"unknown engine(s): {', '.join(sorted(unknown))}")
    out_dir = Path(args.json_dir) if args.json_dir else HERE / "results" / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = build_spec(args)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    specs = engine_specs()
    runs: dict[str, list[Outcome]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in engines if r % 2 == 0 else engines[::-1]:
            if name == "vllm" and specs[name].python.exists():
                err = export_hf_dir(spec, out_dir)
                if err:
                    runs[name].append(Outcome(name, unavailable=err))
                    continue
            tag = f".r{r + 1}" if args.rounds > 1 else ""
            o = run_engine(specs[name], spec_path, out_dir, args.threads, args.timeout, tag)
            print(f"== {name}{tag}: {'not available: ' + o.unavailable if o.unavailable else 'done'} "
                  f"({o.wall_s:.0f} s)", flush=True)
            runs[name].append(o)
    outcomes = [merge_rounds(runs[name]) for name in engines]
    print()
    table = print_table(outcomes, spec)
    (out_dir / "table.md").write_text(table + "\n")
    plot(outcomes, Path(args.plot) if args.plot else out_dir / "peers.png")
    summary = {
        "args": vars(args), "machine": machine_info(),
        "workload": {"decode_prompt_len": len(spec["decode_prompt"]), "decode_new_tokens": spec["decode_new_tokens"],
                     "prefill_len": len(spec["prefill_prompts"][0]), "num_prompts": len(spec["throughput_prompts"]),
                     "input_tokens": sum(map(len, spec["throughput_prompts"])),
                     "output_tokens": sum(spec["throughput_output_lens"])},
        "engines": {o.engine: {"unavailable": o.unavailable, "wall_s": o.wall_s, "medians": summarize(o)
                               if not o.unavailable else None, "result": o.result} for o in outcomes},
    }
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
