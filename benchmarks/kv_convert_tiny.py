"""KV-cache conversions on a tiny random MHA Llama (tests/tiny_models.py, 3 layers, 4 query and
4 K/V heads): GQA / MQA by K/V head pooling (`--kv-heads`) and cross-layer sharing
(`--share-kv-every`), KV bytes per token measured in the engine's pool, and the function change
of each training-free conversion: KL(original || converted) and top-1 agreement of next-token
distributions over random token sequences (a random model has no meaningful perplexity).

    OMP_NUM_THREADS=1 python benchmarks/kv_convert_tiny.py [--json-dir results]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from _common import machine, save_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from kvserve import LLM
    from kvserve.compress.convert import pool_kv_heads
    from kvserve.compress.convert.cla import share_kv
    from kvserve.loading import load_model
    from kvserve.loading.save import save_model
    from tests.logits import all_position_logits
    from tests.tiny_models import VOCAB, make_model

    print(f"machine: {machine()}")
    root = Path(tempfile.mkdtemp())
    make_model("llama", root / "mha", num_key_value_heads=4)
    base = load_model(root / "mha")
    variants = {"MHA (original)": base, "GQA --kv-heads 2": pool_kv_heads(base, 2),
                "MQA --kv-heads 1": pool_kv_heads(base, 1), "CLA --share-kv-every 2": share_kv(base, 2),
                "CLA --share-kv-every 2 --kv-share-init mean": share_kv(base, 2, "mean"),
                "MQA + CLA (--kv-heads 1 --share-kv-every 3)": share_kv(pool_kv_heads(base, 1), 3)}
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (args.length,), generator=g).tolist() for _ in range(args.sequences)]
    ref = [all_position_logits(base, s).log_softmax(-1) for s in seqs]
    rows = {}
    for i, (name, m) in enumerate(variants.items()):
        folder = save_model(m, root / f"v{i}")
        pool = LLM(str(folder), kv_cache_gib=0.01).engine.kv_cache
        kl, agree, n = 0.0, 0, 0
        for s, r in zip(seqs, ref):
            lp = all_position_logits(m, s).log_softmax(-1)
            kl += float((r.exp() * (r - lp)).sum())
            agree += int((lp.argmax(-1) == r.argmax(-1)).sum())
            n += len(s)
        rows[name] = {"bytes_per_token": pool.nbytes / pool.num_slots, "kl": kl / n, "top1_agree": agree / n}
    b0 = rows["MHA (original)"]["bytes_per_token"]
    print("\n| model | KV bytes / token (pool) | vs MHA | KL(original ‖ converted) | top-1 agree |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['bytes_per_token']:.0f} | {b0 / r['bytes_per_token']:.1f}x smaller | {r['kl']:.4f} | "
              f"{100 * r['top1_agree']:.1f}% |")
    save_json("kv_convert_tiny", dict(args=vars(args), rows=rows), args.json_dir)


if __name__ == "__main__":
    main()
