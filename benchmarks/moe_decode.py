"""Batch-1 decode of a mixture-of-experts model vs a dense model of the same total parameters.

Two synthetic checkpoints (random weights, written by transformers' save_pretrained): a
Qwen2-MoE-like model (routed experts, top-k, a gated shared expert) and a Llama-shaped dense
model with the same attention, embedding and head and an MLP as wide as the MoE layer's total
(router + every expert + shared expert). Both decode in kvserve (fp32, CPU, one request); the
two models take turns, --repeats turns each, and the medians are reported with the bytes of
weights one decode step reads: the dense model all of its weights, the MoE model attention,
router, top_k experts and the shared expert per layer (plus the head and one embedding row each).

    python benchmarks/moe_decode.py --repeats 5 [--threads 1] [--json-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine, median, save_json  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.loading.hf import read_hf_config  # noqa: E402
from kvserve.model.config import ModelConfig  # noqa: E402
from tests.tiny_models import VOCAB, write_tokenizer  # noqa: E402

COMMON = dict(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=1024, bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
MOE = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=1024,
           norm_topk_prob=False)


def dense_width(moe: ModelConfig) -> int:
    """The dense MLP width whose 3 * hidden * width parameters match the MoE block's."""
    return round(moe.moe.params_per_layer(moe.hidden_size) / (3 * moe.hidden_size))


def write_models(root: Path) -> tuple[Path, Path]:
    import transformers as tf

    torch.manual_seed(0)
    moe_dir, dense_dir = root / "moe", root / "dense"
    moe_cfg = tf.Qwen2MoeConfig(**COMMON, **MOE, intermediate_size=1024, qkv_bias=False)
    tf.Qwen2MoeForCausalLM(moe_cfg).save_pretrained(moe_dir)
    write_tokenizer(moe_dir)
    width = dense_width(read_hf_config(moe_dir))
    tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, intermediate_size=width)).save_pretrained(dense_dir)
    write_tokenizer(dense_dir)
    return moe_dir, dense_dir


def weight_bytes_per_token(cfg: ModelConfig, elem: int = 4) -> int:
    """Bytes of weights one batch-1 decode step reads: active parameters (MoE: top_k of the
    routed experts) less the embedding table, of which one row is read."""
    return (cfg.active_params - cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * elem


def decode_tok_s(llm: LLM, prompt: list[int], tokens: int) -> float:
    """One request: prefill (first step), then tokens - 1 decode steps timed."""
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    eng.step()
    steps, t = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = list(range(3, 19))
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, dense_dir = write_models(Path(tmp))
        llms = {"moe": LLM(str(moe_dir), kv_cache_gib=0.05), "dense": LLM(str(dense_dir), kv_cache_gib=0.05)}
        cfgs = {k: v.engine.model_config for k, v in llms.items()}
        for llm in llms.values():  # warm-up
            decode_tok_s(llm, prompt, 8)
        runs: dict[str, list[float]] = {k: [] for k in llms}
        for _ in range(args.repeats):  # in turns, so drift hits both alike
            for name, llm in llms.items():
                runs[name].append(decode_tok_s(llm, prompt, args.tokens))
    result = {"tokens": args.tokens, "repeats": args.repeats, "threads": torch.get_num_threads()}
    print(f"{machine()}; fp32, batch 1, {args.tokens} tokens, {args.repeats} turns each")
    print(f"{'model':6} {'params':>11} {'active':>11} {'MB read/token':>14} {'tok/s (median)':>15}  runs")
    for name in llms:
        cfg = cfgs[name]
        mb = weight_bytes_per_token(cfg) / 1e6
        tps = median(runs[name])
        result[name] = {"params": cfg.num_params, "active_params": cfg.active_params, "mb_read_per_token": mb,
                        "tok_s_median": tps, "tok_s_runs": runs[name]}
        print(f"{name:6} {cfg.num_params:>11,} {cfg.active_params:>11,} {mb:>14.1f} {tps:>15.1f}  "
              + " ".join(f"{r:.1f}" for r in runs[name]))
    speedup = result["moe"]["tok_s_median"] / result["dense"]["tok_s_median"]
    read_ratio = result["dense"]["mb_read_per_token"] / result["moe"]["mb_read_per_token"]
    result.update(speedup=speedup, read_ratio=read_ratio)
    print(f"MoE / dense decode speed: {speedup:.2f}x (weights read per token: {read_ratio:.2f}x fewer)")
    save_json("moe_decode", result, args.json_dir)


if __name__ == "__main__":
    main()
