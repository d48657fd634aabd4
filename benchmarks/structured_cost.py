"""What a JSON schema costs: output tok/s of one request and of 16 at once, with and without a
structured-output constraint, on the bundled Gemma 3 270M (offline API, the engine's defaults),
and what prompt-lookup drafts (`--speculative ngram`) give the constrained requests back.

Plain requests run to the same number of tokens as the constrained ones produced (ignore_eos), so
every column generates alike; the schema asks for a list of --items records (10: about 200 tokens).
Greedy and temperature-1 sampling are reported apart (greedy rows take the head's screen under the
grammar's mask, sampled rows full logits). The three engines share one loaded model and run in
turns; medians of --repeats runs. Also: the schema's first compilation (then cached).

    .venv/bin/python benchmarks/structured_cost.py [--repeats 3] [--items 10] [--batch 1,16]
        [--temperature 0,1] [--speculative-k 4] [--out results/structured_cost.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

from kvserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from kvserve.loading import load_model  # noqa: E402
from kvserve.loading.loader import default_model_path  # noqa: E402

PROMPT = "<bos><start_of_turn>user\nList products of a hardware store as JSON.<end_of_turn>\n<start_of_turn>model\n"


def schema(items: int) -> dict:
    """A list of `items` records (about 20 tokens each)."""
    record = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                               "price": {"type": "number", "minimum": 0, "maximum": 1000},
                                               "in_stock": {"type": "boolean"}},
              "required": ["name", "price", "in_stock"], "additionalProperties": False}
    return {"type": "object", "properties": {"products": {"type": "array", "minItems": items, "maxItems": items,
                                                          "items": record}},
            "required": ["products"], "additionalProperties": False}


def run(llm: LLM, batch: int, temperature: float, so: StructuredOutputsParams | None,
        max_tokens: int | list[int]) -> tuple[float, list[int]]:
    """(output tok/s, tokens of each request) of `batch` requests run together (so None: plain)."""
    constrained = so is not None
    caps = max_tokens if isinstance(max_tokens, list) else [max_tokens] * batch
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=caps[i], ignore_eos=not constrained,
                             structured_outputs=so) for i in range(batch)]
    t = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params)
    dt = time.perf_counter() - t
    counts = [len(o.outputs[0].token_ids) for o in outs]
    return sum(counts) / dt, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--items", type=int, default=10, help="records in the schema's list (~20 tokens each)")
    p.add_argument("--batch", default="1,16", help="comma list of request counts run together")
    p.add_argument("--temperature", default="0,1", help="comma list")
    p.add_argument("--speculative-k", type=int, default=4,
                   help="n-gram draft tokens for the third engine (0: no speculative column)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    so = StructuredOutputsParams(json=schema(args.items))
    loaded = load_model(default_model_path())
    llm = LLM(loaded=loaded, kv_cache_gib=1.0)
    spec = LLM(loaded=loaded, kv_cache_gib=1.0, speculative="ngram",
               num_speculative_tokens=args.speculative_k) if args.speculative_k else None
    backend = llm.engine.grammars.backend
    t = time.perf_counter()
    backend.compile(so)  # the vocabulary's xgrammar view, then the schema
    first_compile_s = time.perf_counter() - t
    t = time.perf_counter()
    backend.compile(StructuredOutputsParams(json=schema(args.items + 1)))
    compile_s = time.perf_counter() - t
    for engine in (llm, spec) if spec else (llm,):
        run(engine, 2, 1.0, so, 40 * args.items)  # warm-up (and the schema compiled for each engine)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for temperature in (float(x) for x in args.temperature.split(",")):
            with_s, without_s, spec_s = [], [], []
            for _ in range(args.repeats):
                tps, counts = run(llm, batch, temperature, so, 40 * args.items)
                with_s.append(tps)
                if spec is not None:
                    spec_s.append(run(spec, batch, temperature, so, 40 * args.items)[0])
                without_s.append(run(llm, batch, temperature, None, counts)[0])
            row = {"batch": batch, "temperature": temperature, "tok_s_plain": statistics.median(without_s),
                   "tok_s_json_schema": statistics.median(with_s),
                   "ratio": statistics.median(with_s) / statistics.median(without_s)}
            if spec is not None:
                row["tok_s_json_schema_ngram"] = statistics.median(spec_s)
                row["ngram_vs_schema"] = statistics.median(spec_s) / statistics.median(with_s)
            rows.append(row)
            print(rows[-1], file=sys.stderr, flush=True)
    result = {"machine": machine(), "model": "gemma-3-270m (bundled, fp32)", "repeats": args.repeats,
              "items": args.items, "speculative_k": args.speculative_k,
              "spec_stats": {k: v for k, v in spec.engine.stats().items() if k.startswith("spec")} if spec else None,
              "first_compile_s": first_compile_s, "compile_s": compile_s, "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
