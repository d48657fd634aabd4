"""A fresh prompt's prefill with the last layer carried through for the logit row only
(`ModelRunner.keep_logit_rows`, the default) and for every row, in turns in one process, so a slow
spell of the host lands on both; plus the last layer's own time (a forward hook) each way.

    python benchmarks/kept_rows_ab.py [--prompt-len 512] [--rounds 8] [--json-dir results]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from _common import machine, median, save_json
from kvserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of one prompt each way (order alternating)")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    llm = LLM(enable_prefix_caching=False)
    runner, model = llm.engine.runner, llm.engine.loaded.model
    vocab, rng = model.config.vocab_size, random.Random(0)
    last = model.layers[-1]
    started: list[float] = []
    layer_ms: list[float] = []
    last.register_forward_pre_hook(lambda m, a, k=None: started.append(time.perf_counter()))
    last.register_forward_hook(lambda m, a, o: layer_ms.append((time.perf_counter() - started[-1]) * 1e3))
    params = SamplingParams(temperature=0, max_tokens=1)

    def prefill(keep: bool) -> tuple[float, float]:
        """(prefill ms, last layer ms) of one fresh random prompt."""
        runner.keep_logit_rows = keep
        ids = [rng.randrange(1000, vocab) for _ in range(args.prompt_len)]
        layer_ms.clear()
        t = time.perf_counter()
        llm.generate([ids], params)
        return (time.perf_counter() - t) * 1e3, layer_ms[0]

    prefill(True), prefill(False)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {"kept rows": [], "every row": []}
    for r in range(args.rounds):
        for name in (("kept rows", "every row") if r % 2 == 0 else ("every row", "kept rows")):
            runs[name].append(prefill(name == "kept rows"))
    summary = {}
    for name, got in runs.items():
        total, layer = median([t for t, _ in got]), median([x for _, x in got])
        summary[name] = {"prefill_ms": total, "prefill_tok_s": args.prompt_len / total * 1e3, "last_layer_ms": layer,
                         "runs_ms": [round(t, 1) for t, _ in got]}
        print(f"{name:10s} prefill {total:7.1f} ms ({args.prompt_len / total * 1e3:6.1f} tok/s), "
              f"last layer {layer:5.1f} ms, runs {summary[name]['runs_ms']}")
    ratio = summary["every row"]["prefill_ms"] / summary["kept rows"]["prefill_ms"]
    print(f"speed-up {ratio:.3f}x  ({machine()}, {torch.get_num_threads()} threads)")
    save_json("kept_rows_ab", {"machine": machine(), "args": vars(args), "summary": summary, "speedup": ratio},
              args.json_dir)


if __name__ == "__main__":
    main()
