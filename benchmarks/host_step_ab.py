"""A/B of the host's per-sequence work (the scheduler's in-place check, SequenceStatus.finished,
LLM.generate's final-only outputs) and of the GGUF header reader. Run once per checkout, in turns:

    ROOT=/path/to/old/checkout python benchmarks/host_step_ab.py
    ROOT=/path/to/new/checkout python benchmarks/host_step_ab.py

64 requests on a tiny Llama (tests/tiny_models.py), one thread: schedule() of a 64-sequence
decode step (median of 100), a whole step (median of 150), the offline workload through
LLM.generate (median of 3); the bundled GGUF opened by the checkout's reader."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("ROOT", str(Path(__file__).resolve().parents[1])))

import torch  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.loading import load_model  # noqa: E402
from kvserve.loading.gguf import open_gguf  # noqa: E402
from kvserve.loading.loader import default_model_path  # noqa: E402
from kvserve.tools.bench.throughput import INPUT_RANGE, OUTPUT_RANGE, make_workload  # noqa: E402
from tests.tiny_models import make_model  # noqa: E402


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def decode_steps(loaded) -> tuple[float, float]:
    wl = make_workload(64, (32, 128), (400, 400), loaded.config.vocab_size, None, 0)
    eng = LLM(loaded=loaded, kv_cache_gib=0.2, max_num_seqs=64).engine
    for i, p in enumerate(wl.prompts):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), request_id=f"r{i}")
    for _ in range(10):
        eng.step()
    sched, orig, ts = eng.scheduler, eng.scheduler.schedule, []

    def timed():
        t = time.perf_counter()
        out = orig()
        ts.append(time.perf_counter() - t)
        return out

    sched.schedule = timed
    steps = []
    for _ in range(150):
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    return median(ts), median(steps)


def offline(loaded) -> float:
    wl = make_workload(64, INPUT_RANGE, OUTPUT_RANGE, loaded.config.vocab_size, None, 0)
    llm = LLM(loaded=loaded, kv_cache_gib=0.5, max_num_seqs=64)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    llm.generate(wl.prompts[:4], params[:4])
    runs = []
    for _ in range(3):
        llm.engine.block_manager.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(wl.prompts, params)
        runs.append(time.perf_counter() - t)
    return median(runs)


def main() -> None:
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp())
    make_model("llama", folder)
    loaded = load_model(folder)
    sched_s, step_s = decode_steps(loaded)
    gen_s = offline(loaded)
    t = time.perf_counter()
    open_gguf(default_model_path())
    header_s = time.perf_counter() - t
    print(f"{os.environ.get('ROOT', 'this checkout')}: schedule {sched_s * 1e6:.0f} us, step {step_s * 1e3:.2f} ms, "
          f"offline {gen_s:.3f} s, GGUF header {header_s:.2f} s")


if __name__ == "__main__":
    main()
