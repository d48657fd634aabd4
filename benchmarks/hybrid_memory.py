"""KV + recurrent state memory per sequence: a hybrid (Bamba-9B's shape) against an
all-attention model of the same shape, at 1K, 4K and 16K tokens.

A hybrid keeps K/V only for its attention layers (3 of Bamba-9B's 32) and, for each Mamba layer,
a conv state and an SSM state whose size does not depend on the sequence's length. Per sequence
the engine holds `blocks x page bytes` of its KV pool plus one slot of its state pool.

Three parts:
  1. Bamba-9B's shape (32 layers, attention at 9, 18, 27: 32 heads, 8 KV heads of 128; Mamba2
     elsewhere: 128 heads of 64, one group, d_state 128, conv 4; hidden 4096), bf16 K/V and conv
     state, fp32 SSM state (the engine's), 16-token pages. No weights are needed: the blocks one
     sequence holds come from the engine's block manager driven as the scheduler drives it
     (prefill chunks of the 2048-token budget, then decode steps), the page and state-slot bytes
     from the engine's own functions (`builder.kv_page_bytes`, `footprint.state_pool_bytes`). The
     same config with every layer attention is the comparison. Written as a plot to --plot.
  2. A real engine on a tiny random Bamba (transformers' save_pretrained) runs one sequence to
     --real-tokens tokens; the blocks it holds x the engine's page bytes + the engine's state slot
     bytes is checked against part 1's arithmetic for that model.
  3. The decode step's SSM update of one Mamba layer at Bamba-9B's shape (128 heads x 64 x 128
     fp32 state, 4 MiB per sequence): kernels/ssm_decode.c against the torch ops it replaces,
     batch 1 and 8 (median of --reps calls).

    python benchmarks/hybrid_memory.py [--plot docs/images/hybrid_memory.png] [--json-dir results]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import machine, save_json

BUDGET = 2048  # max_num_batched_tokens (EngineConfig default): the prefill chunk
LENGTHS = (1024, 4096, 16384)
MIB = 2**20


def bamba_9b(all_attention: bool = False):
    """Bamba-9B's architecture as a ModelConfig (values of its config.json: BambaConfig's
    defaults with attn_layer_indices [9, 18, 27] and mamba_d_state 128)."""
    from kvserve.model.config import FULL, MAMBA, ModelConfig, RopeConfig

    layers = 32
    types = [FULL if all_attention or i in (9, 18, 27) else MAMBA for i in range(layers)]
    return ModelConfig(family="bamba", model_type="bamba", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, max_position_embeddings=262144, layer_types=types,
                       rope={FULL: RopeConfig(10000.0)}, attn_scale=128**-0.5, partial_rotary_factor=0.5,
                       mamba_n_heads=128, mamba_head_dim=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4)


def blocks_held(num_tokens: int, block_size: int, groups) -> int:
    """Blocks one sequence holds once its num_tokens tokens are computed: the prompt in chunks of
    BUDGET, the last token alone (a decode), through the engine's block manager."""
    from kvserve.engine.block_manager import BlockManager
    from kvserve.sampling_params import SamplingParams
    from kvserve.sequence import Sequence

    bm = BlockManager(10**6, block_size, enable_prefix_caching=False, group_windows=[g.window for g in groups],
                      num_state_slots=1)
    seq = Sequence(0, "r", list(range(num_tokens)), SamplingParams(max_tokens=1), 0.0)
    while seq.num_computed_tokens < num_tokens:
        n = min(BUDGET, num_tokens - seq.num_computed_tokens - 1) or 1
        bm.allocate(seq, n)
        seq.num_computed_tokens += n
        bm.mark_computed(seq)
    assert seq.state_slot == 0
    return bm.seq_blocks(seq)


def per_sequence(mc, num_tokens: int, kv_dtype, cache_cfg) -> dict:
    """KV bytes (blocks held x page bytes) and state bytes (one slot) of one sequence."""
    from kvserve.engine import builder
    from kvserve.loading.footprint import state_pool_bytes
    from kvserve.model.config import kv_layer_groups

    groups = kv_layer_groups(mc)
    page = builder.kv_page_bytes(cache_cfg, mc, groups, kv_dtype)
    blocks = blocks_held(num_tokens, cache_cfg.block_size, groups)
    state = state_pool_bytes(mc, 1, kv_dtype)
    return {"tokens": num_tokens, "blocks": blocks, "page_bytes": page, "kv_bytes": blocks * page,
            "state_bytes": state, "total_bytes": blocks * page + state}


def shape_table(kv_dtype) -> dict:
    from kvserve.config import CacheConfig

    cache_cfg = CacheConfig()
    out = {}
    for name, mc in (("bamba-9b (hybrid)", bamba_9b()), ("all-attention, same shape", bamba_9b(True))):
        out[name] = [per_sequence(mc, n, kv_dtype, cache_cfg) for n in LENGTHS]
    return out


def real_engine(num_tokens: int) -> dict:
    """A tiny random Bamba through the engine: what one sequence holds after num_tokens tokens."""
    import torch
    import transformers as tf

    from kvserve import LLM, SamplingParams
    from kvserve.config import CacheConfig

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = tf.BambaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
                             mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=64,
                             max_position_embeddings=num_tokens + 64, pad_token_id=0, bos_token_id=2, eos_token_id=1)
        tf.BambaForCausalLM(cfg).float().save_pretrained(tmp)
        _tokenizer(Path(tmp))
        llm = LLM(tmp, kv_cache_gib=0.05, max_num_seqs=4)
        engine = llm.engine
        prompt = torch.randint(3, 320, (num_tokens - 1,), generator=torch.Generator().manual_seed(1)).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        engine.step()  # ... prefill chunks until the first token
        while engine.scheduler.running and not engine.scheduler.running[0].output_token_ids:
            engine.step()
        seq = engine.scheduler.running[0]
        engine.step()  # one decode: num_tokens computed
        held = engine.block_manager.seq_blocks(seq)
        measured = held * engine.page_bytes + engine.state_cache.slot_nbytes
        predicted = per_sequence(engine.model_config, seq.num_computed_tokens, torch.float32, CacheConfig())
        assert measured == predicted["total_bytes"], (measured, predicted)
        return {"tokens": seq.num_computed_tokens, "blocks": held, "page_bytes": engine.page_bytes,
                "state_slot_bytes": engine.state_cache.slot_nbytes, "measured_bytes": measured,
                "predicted_bytes": predicted["total_bytes"]}


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["a small tokenizer for a random model"], trainer)
    tok.save(str(folder / "tokenizer.json"))


def decode_kernel_times(reps: int) -> list[dict]:
    """Median seconds of one layer's SSM decode update, C kernel vs torch, at Bamba-9B's shape."""
    import statistics
    import time

    import torch

    from kvserve.kernels import ssm_decode
    from kvserve.model.config import MAMBA
    from kvserve.model.mamba import Mamba2Mixer

    mc = bamba_9b()
    layer = mc.layer_types.index(MAMBA)
    mixer = Mamba2Mixer.__new__(Mamba2Mixer)  # the torch update needs only D: no 9B weights
    torch.nn.Module.__init__(mixer)
    mixer.D = torch.nn.Parameter(torch.ones(mc.mamba_n_heads), requires_grad=False)
    H, P, N = mc.mamba_n_heads, mc.mamba_head_dim, mc.mamba_d_state
    out = []
    g = torch.Generator().manual_seed(0)
    for batch in (1, 8):
        pool = torch.randn(batch, H, P, N, generator=g) * 0.1
        slots, has = torch.arange(batch), torch.ones(batch, dtype=torch.bool)
        x, B, C = (torch.randn(batch, H, k, generator=g) for k in (P, N, N))
        dt, A = torch.rand(batch, H, generator=g) * 0.1, -torch.rand(H, generator=g)
        times = {}
        for name, fn in (("c_kernel", lambda: ssm_decode(pool, slots, has, x, dt, A, B, C, mixer.D)),
                         ("torch", lambda: mixer._decode_ssm(pool, slots, has, x, dt, A, B, C))):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            times[name] = statistics.median(ts)
        out.append({"batch": batch, "layer": layer, **times, "speedup": times["torch"] / times["c_kernel"]})
    return out


def plot(table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    xs = range(len(LENGTHS))
    for k, (name, rows) in enumerate(table.items()):
        kv = [r["kv_bytes"] / MIB for r in rows]
        state = [r["state_bytes"] / MIB for r in rows]
        pos = [x + (k - 0.5) * width for x in xs]
        ax.bar(pos, kv, width, label=f"{name}: KV pages", color=("tab:blue", "tab:orange")[k])
        if any(state):
            ax.bar(pos, state, width, bottom=kv, label=f"{name}: recurrent state slot", color="tab:green")
        for p, r in zip(pos, rows):
            ax.text(p, r["total_bytes"] / MIB, f"{r['total_bytes'] / MIB:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{n // 1024}K tokens" for n in LENGTHS])
    ax.set_ylabel("MiB per sequence")
    ax.set_title("Bamba-9B shape: KV + state per sequence (bf16 K/V, fp32 SSM state)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", default="docs/images/hybrid_memory.png")
    ap.add_argument("--real-tokens", type=int, default=1024)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    import torch

    table = shape_table(torch.bfloat16)
    print(f"machine: {machine()}")
    print("| model | tokens | KV blocks | KV MiB | state MiB | total MiB |")
    print("|---|---|---|---|---|---|")
    for name, rows in table.items():
        for r in rows:
            print(f"| {name} | {r['tokens']:,} | {r['blocks']:,} | {r['kv_bytes'] / MIB:,.1f} | "
                  f"{r['state_bytes'] / MIB:,.1f} | {r['total_bytes'] / MIB:,.1f} |")
    hybrid, dense = table.values()
    for h, d in zip(hybrid, dense):
        print(f"{h['tokens']:,} tokens: hybrid / all-attention = {h['total_bytes'] / d['total_bytes']:.3f}")
    plot(table, args.plot)
    print(f"plot: {args.plot}")
    result = {"machine": machine(), "shape": table}
    if not args.skip_real:
        real = real_engine(args.real_tokens)
        print(f"real engine (tiny random Bamba, fp32): {real}")
        result["real_engine"] = real
    kernel = decode_kernel_times(args.reps)
    for k in kernel:
        print(f"SSM decode update, one layer, batch {k['batch']}: C {k['c_kernel'] * 1e3:.2f} ms, "
              f"torch {k['torch'] * 1e3:.2f} ms ({k['speedup']:.2f}x)")
    result["ssm_decode"] = kernel
    save_json("hybrid_memory", result, args.json_dir)


if __name__ == "__main__":
    main()
