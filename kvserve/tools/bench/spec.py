"""`kvserve bench spec`: speculative decoding against plain decoding, side by side in one run.

For each proposer (ngram, self, and draft when a draft model is given) and each k, the same
prompts are generated at batch 1 (one request at a time) and at batch B (B requests at once),
with plain decoding measured in the same rounds. Configurations are interleaved round by round,
so machine noise hits them alike; medians over rounds are reported.

Workloads: `grounded` (repeat-the-document and summarize prompts: the output copies the input,
the case prompt lookup is made for) and `free` (open-ended continuation of a WikiText passage).
"""
from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.loading import load_model
from kvserve.tools.bench.serve import default_wikitext_path, load_wikitext_words

WORKLOADS = ("grounded", "free")


def make_prompts(words: list[str], workload: str, n: int, doc_words: int, seed: int) -> list[str]:
    """n prompts built from random WikiText passages of doc_words words."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        start = rng.randrange(0, len(words) - doc_words)
        doc = " ".join(words[start:start + doc_words])
        if workload == "free":
            prompts.append(doc)
        elif i % 2 == 0:
            prompts.append(f"Repeat the following document word for word.\n\nDocument:\n{doc}\n\nRepeated document:\n")
        else:
            prompts.append(f"Document:\n{doc}\n\nSummarize the document above, quoting its key sentences.\n\nSummary:\n")
    return prompts


@dataclass
class SpecRun:
    proposer: str  # "plain" for the baseline
    k: int
    batch: int
    output_tokens: int
    seconds: list[float] = field(default_factory=list)  # one per round
    acceptance_rate: float | None = None  # accepted / drafted tokens
    tokens_per_step: float | None = None  # tokens emitted per verification step (accepted + 1)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / statistics.median(self.seconds)


PROPOSERS = ("ngram", "self", "self-int4", "self-int8", "self-exitN", "draft")
HEURISTIC = "+heuristic"  # a proposer's suffix: k as the most of each sequence's heuristic draft length
VOCAB = "+vocab"  # a model draft's suffix: its head over the --draft-vocab subset


def _base(proposer: str) -> str:
    """The proposer without its suffixes ("self-exit6+vocab+heuristic" -> "self-exit6")."""
    return proposer.removesuffix(HEURISTIC).removesuffix(VOCAB)


def check_proposer(proposer: str) -> None:
    """ValueError unless proposer is one of PROPOSERS (self-exitN: N a layer count) with suffixes."""
    base = _base(proposer)
    exit_layers = base.removeprefix("self-exit")
    if base not in PROPOSERS and not (base.startswith("self-exit") and exit_layers.isdigit() and int(exit_layers)):
        raise ValueError(f"--proposers: unknown proposer {proposer!r} ({', '.join(PROPOSERS)}, each optionally "
                         f"with {VOCAB} for a model draft, then {HEURISTIC})")
    if proposer.removesuffix(HEURISTIC).endswith(VOCAB) and base == "ngram":
        raise ValueError(f"--proposers: {proposer!r}: {VOCAB} is for a model draft, not ngram")


def _engine_args(proposer: str, k: int, draft_model: str | None, draft_vocab: str | None = None,
                 dtype: str = "float32") -> dict:
    """EngineConfig fields for a proposer; `dtype`: the target's (an early exit runs on it, no copy)."""
    if proposer == "plain":
        return {}
    schedule = "heuristic" if proposer.endswith(HEURISTIC) else "constant"
    base = _base(proposer)
    args = dict(speculative=base, num_speculative_tokens=k, num_speculative_tokens_schedule=schedule)
    if base in ("self-int4", "self-int8"):  # the target's RTN copy as its draft
        args.update(speculative="self", self_draft_bits=int(base[-1]))
    if base.startswith("self-exit"):  # the target's first N layers, no copy
        args.update(speculative="self", self_draft_layers=int(base.removeprefix("self-exit")), self_draft_dtype=dtype)
    if base == "draft":
        args["speculative_model"] = draft_model
    if proposer.removesuffix(HEURISTIC).endswith(VOCAB):
        args["draft_vocab"] = draft_vocab
    return args


def _run_once(loaded, prompts: list[str], batch: int, params, engine_args: dict, max_model_len: int,
              kv_cache_gib: float, weights: str = "float"):
    """Generate every prompt (batch at a time); returns (seconds, output tokens, engine stats)."""
    llm = LLM(loaded=loaded, weights=weights, max_num_seqs=batch, enable_prefix_caching=False, max_model_len=max_model_len,
              kv_cache_gib=kv_cache_gib, **engine_args)
    llm.generate(prompts[0][:50], dataclasses.replace(params, max_tokens=2))  # warm-up (kernels, allocator)
    base = dict(llm.engine.spec_stats)
    n_out, t = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params)
        n_out += sum(len(c.token_ids) for o in outs for c in o.outputs)
    seconds = time.perf_counter() - t
    stats = {k: v - base[k] for k, v in llm.engine.spec_stats.items()}
    return seconds, n_out, stats


def measure(loaded, proposers: list[str], ks: list[int], batches: list[int], prompts: list[str], output_len: int,
            rounds: int, temperature: float = 0.0, draft_model: str | None = None, kv_cache_gib: float = 0.5,
            progress=print, sampling: dict | None = None, draft_vocab: str | None = None,
            weights: str = "float") -> list[SpecRun]:
    """`sampling`: further SamplingParams fields (top_p, top_k, repetition_penalty, ...); `draft_vocab`:
    the file the +vocab proposers' heads read; `weights`: the target's (`loaded` as that engine
    option computes with it: "gguf" wants it loaded with gguf_blocks)."""
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=0,
                            **(sampling or {}))
    lens = [len(loaded.tokenizer.encode(p)) for p in prompts]
    max_model_len = max(lens) + output_len + max(ks) + 16
    configs = [("plain", 0)] + [(p, k) for p in proposers for k in ks]
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    runs = {(p, k, b): SpecRun(p, k, b, 0) for p, k in configs for b in batches}
    for r in range(rounds):
        for b in batches:
            for p, k in configs:
                run = runs[(p, k, b)]
                sec, n_out, st = _run_once(loaded, prompts, b, params, _engine_args(p, k, draft_model, draft_vocab, dtype), max_model_len,
                                           kv_cache_gib, weights)
                run.seconds.append(sec)
                run.output_tokens = n_out
                if st.get("num_drafts"):
                    run.acceptance_rate = st["num_accepted_tokens"] / max(1, st["num_draft_tokens"])
                    run.tokens_per_step = (st["num_accepted_tokens"] + st["num_drafts"]) / st["num_drafts"]
                progress(f"round {r + 1}/{rounds} batch {b} {p} k={k}: {n_out / sec:.1f} tok/s")
    return list(runs.values())


def speedups(runs: list[SpecRun]) -> dict[tuple[str, int, int], float]:
    """tok/s relative to plain decoding at the same batch size."""
    plain = {r.batch: r.tok_s for r in runs if r.proposer == "plain"}
    return {(r.proposer, r.k, r.batch): r.tok_s / plain[r.batch] for r in runs}


def print_table(runs: list[SpecRun]) -> None:
    sp = speedups(runs)
    print("| batch | proposer | k | acceptance | tokens/step | tok/s (median) | speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r.batch, r.proposer != "plain", r.proposer, r.k)):
        acc = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}"
        tps = "-" if r.tokens_per_step is None else f"{r.tokens_per_step:.2f}"
        print(f"| {r.batch} | {r.proposer} | {r.k or '-'} | {acc} | {tps} | {r.tok_s:.1f} | "
              f"{sp[(r.proposer, r.k, r.batch)]:.2f}x |")


def plot(runs: list[SpecRun], path: Path, title: str) -> None:
    import matplotlib  # optional (the [bench] extra): only a chart needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the Agg backend)

    sp = speedups(runs)
    batches = sorted({r.batch for r in runs})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for p in sorted({r.proposer for r in runs} - {"plain"}):
            pts = sorted((r.k, sp[(p, r.k, b)]) for r in runs if r.proposer == p and r.batch == b)
            ax.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=p)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("speculative tokens k")
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"batch {b}")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    if args.workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {WORKLOADS}, got {args.workload!r}")
    proposers = [p.strip() for p in args.proposers.split(",") if p.strip()]
    for p in proposers:
        check_proposer(p)
    if any(_base(p) == "draft" for p in proposers) and not args.speculative_model:
        raise ValueError("--proposers draft needs --speculative-model")
    if any(p.removesuffix(HEURISTIC).endswith(VOCAB) for p in proposers) and not args.draft_vocab:
        raise ValueError(f"--proposers NAME{VOCAB} needs --draft-vocab (a file from `kvserve draft-vocab`)")
    path = Path(args.dataset_path) if args.dataset_path else default_wikitext_path()
    if not path.is_file():
        raise ValueError(f"--dataset-path: {path} is not a file")
    sampling = dict(top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty)
    SamplingParams(temperature=args.temperature, **sampling)  # a bad setting fails here, naming the field
    prompts = make_prompts(load_wikitext_words(path), args.workload, args.num_prompts, args.doc_words, args.seed)
    loaded = load_model(args.model, args.dtype, gguf_blocks=args.weights == "gguf")
    runs = measure(loaded, proposers, args.k, args.batch, prompts, args.output_len, args.rounds,
                   args.temperature, args.speculative_model, args.kv_cache_gib, sampling=sampling,
                   draft_vocab=args.draft_vocab, weights=args.weights)
    what = args.dtype if args.weights == "float" else f"weights {args.weights}"
    print(f"\n{args.workload} workload, {what}, {len(prompts)} prompts x {args.output_len} tokens, "
          f"temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}, repetition penalty "
          f"{args.repetition_penalty}, median of {args.rounds} rounds")
    print_table(runs)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([asdict(r) | {"tok_s": r.tok_s} for r in runs], indent=1))
        print(f"wrote {out}")
    if args.plot:
        plot(runs, Path(args.plot), f"speculative decoding, {args.workload} workload ({args.dtype})")
        print(f"wrote {args.plot}")
    return 0
