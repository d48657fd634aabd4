"""kvserve adapter (runs in the repo's .venv): the GGUF dequantized to fp32, prefix caching off.

Batch-1 numbers come from kvserve's own request metrics (TTFT = arrival -> first token, TPOT =
mean gap between output tokens), as `kvserve bench latency` reports them; the offline run is
`kvserve.tools.bench.throughput.run_kvserve` (continuous batching, --max-num-seqs from the spec).

One adapter, several engines (`adapter_kvserve.py SPEC OUT ENGINE`): the spec's ENGINE section
gives the options; `weights` there ("int8", "int4") goes to every LLM built, which quantizes its
copy of the fp32 model at construction (PyTorch's CPU int8 / int4 kernels); `compile` (true)
runs the forward pass through torch.compile (its compile happens in the warm-up runs).
"""
from __future__ import annotations

import sys
import time

import torch
from _common import ThroughputRun, Timed, engine_name, main, threads


class KvserveEngine:
    def __init__(self, spec: dict, name: str = "kvserve"):
        from kvserve import LLM
        from kvserve.loading import load_model

        torch.set_num_threads(threads(spec))
        self.name = name
        opts = spec.get(name, {})
        weights: str | None = opts.get("weights")  # None: the engine's default (float)
        self.loaded = load_model(spec.get("model"), opts.get("dtype", "float32"), gguf_blocks=weights == "gguf")
        self.dtype = weights or str(next(self.loaded.model.parameters()).dtype).removeprefix("torch.")
        self.dtype += ", torch.compile" if opts.get("compile") else ""
        self.max_num_seqs: list[int] = opts.get("max_num_seqs", [64])
        self.engine_args = dict(enable_prefix_caching=False,
                                max_num_batched_tokens=opts.get("max_num_batched_tokens", 2048),
                                kv_cache_gib=opts.get("kv_cache_gib"), **({"weights": weights} if weights else {}),
                                **({"compile": True} if opts.get("compile") else {}),
                                **({"kv_cache_dtype": opts["kv_cache_dtype"]} if opts.get("kv_cache_dtype") else {}))
        cfg = self.loaded.config
        t = time.perf_counter()
        self.llm = LLM(loaded=self.loaded, max_num_seqs=1,
                       max_model_len=min(cfg.max_position_embeddings, spec["max_model_len"]), **self.engine_args)
        kv = self.llm.engine.config.kv_cache_dtype  # as resolved: gguf blocks get an fp16 pool by default
        self.dtype += f", {kv} KV" if kv != "auto" else ""
        self.notes: list[str] = []
        if weights:
            self.notes.append(f"weights={weights}: LLM built in {time.perf_counter() - t:.1f} s (quantization "
                              "included; again for every throughput run, outside its timing)")

    def generate_timed(self, ids: list[int], new_tokens: int) -> Timed:
        from kvserve import SamplingParams

        out = self.llm.generate(ids, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
        tokens = list(out.outputs[0].token_ids)
        m = out.metrics
        return Timed(tokens, m.ttft, (m.tpot or 0.0) * (len(tokens) - 1))

    def throughput_settings(self) -> list[str]:
        return [f"max_num_seqs={n}" for n in self.max_num_seqs]

    def throughput(self, prompts: list[list[int]], output_lens: list[int], setting: str) -> ThroughputRun:
        from kvserve.tools.bench.throughput import Workload, run_kvserve

        n = int(setting.split("=")[1])
        r = run_kvserve(self.loaded, Workload(prompts, output_lens), max_num_seqs=n, **self.engine_args)
        return ThroughputRun(setting, r.seconds, round(r.output_tok_s * r.seconds))


if __name__ == "__main__":
    engine = engine_name("kvserve")
    sys.exit(main(lambda spec: KvserveEngine(spec, engine), engine))
