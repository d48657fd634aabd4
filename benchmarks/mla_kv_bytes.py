"""MLA KV-cache footprint: bytes per token measured in the engine's pool, sequences a 1 GiB pool
holds, vs the same model with per-head K/V (MHA), plus DeepSeek-V2-Lite / V3 arithmetic and the
decode step time of the absorbed vs materialized forms on the tiny model.

    OMP_NUM_THREADS=1 python benchmarks/mla_kv_bytes.py
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve import LLM  # noqa: E402
from kvserve.engine.model_runner import ModelRunner, StepInput  # noqa: E402
from kvserve.model.attention import KVCache  # noqa: E402
from kvserve.tools.analysis import roofline as rl  # noqa: E402
from kvserve.tools.analysis.presets import MODELS, shape_from_hf_config  # noqa: E402
from tests.tiny_models import make_model  # noqa: E402

SEQ = 2048
GIB = 2**30
# DeepSeek-V3 (671B) attention shapes from its config.json (MoE is irrelevant to the KV cache).
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "intermediate_size": 18432, "vocab_size": 129280, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
               "moe_intermediate_size": 2048, "first_k_dense_replace": 3}


def mha_bytes_per_token(layers: int, heads: int, nope: int, rope: int, v: int, elem: float) -> float:
    """The same attention with per-head K (nope + rope wide) and V cached."""
    return layers * heads * (nope + rope + v) * elem


def tiny_pool(folder: Path) -> dict:
    llm = LLM(str(folder), kv_cache_gib=1.0)
    eng, mc = llm.engine, llm.engine.model_config
    pool = eng.kv_cache
    mla_tok = pool.nbytes / pool.num_slots
    # The MHA twin's pool, measured the same way (a small one: bytes per slot do not depend on size).
    mha = KVCache(mc.num_layers, 64, mc.num_heads, mc.qk_nope_head_dim + mc.qk_rope_head_dim, torch.float32,
                  v_head_dim=mc.v_head_dim)
    mha_tok = mha.nbytes / mha.num_slots
    blocks_per_seq = SEQ // eng.config.block_size
    return {"layers": mc.num_layers, "heads": mc.num_heads, "d_c": mc.kv_lora_rank, "d_rope": mc.qk_rope_head_dim,
            "d_nope": mc.qk_nope_head_dim, "d_v": mc.v_head_dim, "dtype": "float32",
            "mla_bytes_per_token": mla_tok, "mha_bytes_per_token": mha_tok, "ratio": mha_tok / mla_tok,
            "pool_gib": pool.nbytes / GIB, "mla_max_seqs_2048": eng.num_blocks // blocks_per_seq,
            "mha_max_seqs_2048": int(GIB // (mha_tok * SEQ))}


def decode_timing(folder: Path, batch: int = 8, context: int = 1024, reps: int = 5) -> dict:
    """One decode step of `batch` sequences at `context` tokens, absorbed vs materialized."""
    llm = LLM(str(folder), kv_cache_gib=0.05)
    model, bs = llm.engine.loaded.model, 16
    mc = model.config
    heads, k_dim, v_dim = mc.kv_cache_layout
    per_seq = -(-(context + 1) // bs)
    kv = KVCache(mc.num_layers, batch * per_seq * bs, heads, k_dim, torch.float32, v_head_dim=v_dim)
    runner = ModelRunner(model, kv, bs)
    g = torch.Generator().manual_seed(0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    for t in tables:
        runner.execute([StepInput(torch.randint(3, mc.vocab_size, (context,), generator=g).tolist(), 0, t)])
    step = [StepInput([5], context, t) for t in tables]
    out = {}
    for absorb in (True, False):
        for layer in model.layers:
            layer.self_attn.absorb = absorb
        runner.execute(step)  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.execute(step)
        out["absorbed_ms" if absorb else "materialized_ms"] = (time.perf_counter() - t0) / reps * 1e3
    return {"batch": batch, "context": context, **out}


def published() -> list[dict]:
    rows = []
    for name, shape in (("DeepSeek-V2-Lite", MODELS["deepseek-v2-lite"]),
                        ("DeepSeek-V3", shape_from_hf_config(DEEPSEEK_V3, "deepseek-v3"))):
        mla = rl.kv_bytes_per_token(shape)  # bf16
        mha = mha_bytes_per_token(shape.layers, shape.heads, shape.head_dim, shape.rope_dim, shape.head_dim, 2)
        rows.append({"model": name, "layers": shape.layers, "heads": shape.heads, "d_c": shape.kv_latent,
                     "d_rope": shape.rope_dim, "mla_bytes_per_token": mla, "mha_bytes_per_token": mha,
                     "ratio": mha / mla, "mla_tokens_per_gib": int(GIB // mla), "mha_tokens_per_gib": int(GIB // mha)})
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_model("deepseek_v3", folder)
        results = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "threads": torch.get_num_threads(),
                   "tiny": tiny_pool(folder), "decode": decode_timing(folder), "published": published()}
    out = Path(__file__).parent / "results" / "mla_kv_bytes.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
