"""HF transformers adapter (runs in the repo's .venv): the same GGUF, loaded by transformers'
GGUF reader and dequantized to fp32 (`kvserve.tools.bench.throughput._hf_model`), eager PyTorch.

Batch-1: `model.generate` (greedy, EOS ignored) with a streamer that timestamps every new
token. Offline: `kvserve.tools.bench.throughput.run_hf`, padded static batches in submission order
(each batch runs to its longest output), swept over the spec's batch sizes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from _common import ThroughputRun, Timed, main, threads


class _Clock:
    """A generate() streamer that records when each new token arrives (the first put() is the
    prompt itself)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HfEngine:
    name = "hf"

    def __init__(self, spec: dict):
        from kvserve.tools.bench.throughput import _hf_model

        torch.set_num_threads(threads(spec))
        opts = spec.get("hf", {})
        self.path = Path(spec["model_path"])
        self.torch_dtype = getattr(torch, opts.get("dtype", "float32"))
        self.dtype = opts.get("dtype", "float32")
        self.model = _hf_model(self.path, self.torch_dtype)
        self.batch_sizes: list[int] = opts.get("batch_sizes", [8, 16, 32])
        self.pad_id = int(spec.get("pad_token_id") or 0)
        self.notes: list[str] = []

    def generate_timed(self, ids: list[int], new_tokens: int) -> Timed:
        x = torch.tensor([ids], dtype=torch.long)
        clock = _Clock()
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, streamer=clock,
                                      pad_token_id=self.pad_id)
        tokens = out[0, len(ids):].tolist()
        return Timed(tokens, clock.times[0] - start, clock.times[-1] - clock.times[0])

    def throughput_settings(self) -> list[str]:
        return [f"static batch {b}" for b in self.batch_sizes]

    def throughput(self, prompts: list[list[int]], output_lens: list[int], setting: str) -> ThroughputRun:
        from kvserve.tools.bench.throughput import Workload, run_hf

        b = int(setting.rsplit(" ", 1)[1])
        wl = Workload(prompts, output_lens)
        r = run_hf(self.path, wl, b, self.torch_dtype, self.pad_id)
        # run_hf counts the requested tokens (each batch generates its longest output for all rows).
        return ThroughputRun(setting, r.seconds, wl.output_tokens)


if __name__ == "__main__":
    sys.exit(main(HfEngine, "hf"))
