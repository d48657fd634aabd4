"""Peak RSS and start-up time on a GGUF file: kvserve on the file's own blocks (`weights="gguf"`)
beside llama.cpp (llama-cpp-python from the peers' venv), each in a fresh process under
`/usr/bin/time -v`: import, load, build (start_s), then 16 greedy tokens (tokens_16_s), with the
resident set after each of those stages (rss_gb: where the peak comes from). Both hold
2,048 tokens of KV cache (kvserve's pool sized to exactly that, llama.cpp `n_ctx=2048`); kvserve
runs twice, with its default fp16 pool (llama.cpp's default cache type: the same bytes) and with an
fp32 one.

    .venv/bin/python benchmarks/gguf_memory.py --model FILE [--model FILE2 ...] [--cold] --out results.json

`--cold` drops the page cache before every run (`/proc/sys/vm/drop_caches`, root only), so the
load reads the file from disk; without it the file is warm from a first, discarded run.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_PYTHON = ROOT / "benchmarks" / "peers" / ".venv-llamacpp" / "bin" / "python"
TOKENS = 2048

# The resident set now (VmRSS, GB), read by both scripts after each stage.
RSS = """
import re
def rss():
    status = open("/proc/self/status").read()
    return round(int(re.search(r"VmRSS:\\s+(\\d+)", status).group(1)) * 1024 / 1e9, 3)
stages = {{"python": rss()}}
"""

KVSERVE = RSS + """
import json, sys, time
t0 = time.perf_counter()
import torch
stages["import torch"] = rss()
from kvserve import LLM, SamplingParams
from kvserve.loading import load_model
stages["import kvserve"] = rss()
loaded = load_model(sys.argv[1], gguf_blocks=True)
stages["load (tokenizer, weights)"] = rss()
cfg = loaded.config
from kvserve.config import EngineConfig
from kvserve.model.attention import kv_storage_dtype
kv_dtype = sys.argv[2]
width = kv_storage_dtype(EngineConfig(weights="gguf", kv_cache_dtype=kv_dtype).kv_cache_dtype, torch.float32).itemsize
kv_bytes = {tokens} * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * width
llm = LLM(loaded=loaded, weights="gguf", kv_cache_gib=kv_bytes / 2**30, max_model_len={tokens}, max_num_seqs=1,
          kv_cache_dtype=kv_dtype)
stages["engine (KV pool)"] = rss()
t1 = time.perf_counter()
llm.generate([2, 651, 6037], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
t2 = time.perf_counter()
stages["16 tokens"] = rss()
print(json.dumps({{"start_s": t1 - t0, "tokens_16_s": t2 - t1, "rss_gb": stages}}))
"""

LLAMACPP = RSS + """
import json, sys, time
t0 = time.perf_counter()
import llama_cpp
stages["import llama_cpp"] = rss()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx={tokens}, n_threads=2, verbose=False)
stages["load (tokenizer, weights, KV)"] = rss()
t1 = time.perf_counter()
llm.eval([2, 651, 6037])
for _ in range(16):
    llm.eval([llm.sample(temp=0.0)])
t2 = time.perf_counter()
stages["16 tokens"] = rss()
print(json.dumps({{"start_s": t1 - t0, "tokens_16_s": t2 - t1, "rss_gb": stages}}))
"""


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"--cold needs to write /proc/sys/vm/drop_caches (root): {e}") from None


def run(python: Path, code: str, model: Path, *args: str) -> dict:
    """One fresh process under /usr/bin/time -v -> start_s, tokens_16_s, rss_gb (by stage), peak_rss_gb."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code.format(tokens=TOKENS))
    proc = subprocess.run(["/usr/bin/time", "-v", str(python), f.name, str(model), *args], capture_output=True,
                          text=True, cwd=ROOT)
    Path(f.name).unlink()
    if proc.returncode != 0:
        raise RuntimeError(f"{python} on {model} failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    times = {k: round(out[k], 2) for k in ("start_s", "tokens_16_s")}
    return {**times, "rss_gb": out["rss_gb"], "peak_rss_gb": round(rss_kb * 1024 / 1e9, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, type=Path, help="a .gguf file (repeatable)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not LLAMACPP_PYTHON.exists():
        raise SystemExit(f"{LLAMACPP_PYTHON} not found: run benchmarks/peers/setup_peers.sh llamacpp first")
    engines = {"kvserve": (Path(sys.executable), KVSERVE, "auto"),  # an fp16 pool, the default with gguf blocks
               "kvserve-fp32-kv": (Path(sys.executable), KVSERVE, "fp32"),
               "llamacpp": (LLAMACPP_PYTHON, LLAMACPP)}
    results = {}
    for model in args.model:
        if not model.is_file():
            raise SystemExit(f"--model {model}: no such file")
        results[model.stem] = {}
        for name, (python, code, *extra) in engines.items():
            if args.cold:
                drop_page_cache()
            else:
                run(python, code, model, *extra)  # warms the page cache (and the kernel build)
            results[model.stem][name] = run(python, code, model, *extra)
            print(model.stem, name, results[model.stem][name], flush=True)
    args.out.write_text(json.dumps({"tokens_of_kv": TOKENS, "cold": args.cold, "files": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
