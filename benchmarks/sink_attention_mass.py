"""How much attention each layer puts on the first tokens of a stream (the would-be sinks).

StreamingLLM's window attention collapses when the evicted first tokens held a large share of
the softmax mass. This measures that share for the model's own (full) attention on the first
`--num-tokens` WikiText-2 tokens (BOS once at the start): per layer and head, the mean mass on
BOS and on the first `--sinks` tokens, over queries that can see them natively: global layers
at positions [--from, N), sliding layers at [64, window) (later queries no longer see BOS).

    python benchmarks/sink_attention_mass.py --num-tokens 2048 [--json-dir results]
"""
from __future__ import annotations

import argparse

import torch
from _common import save_json


class MassProbe:
    """An `AttentionMetadata.custom` callable: the model's own attention over one chunk starting
    at position 0 (stream positions, native windows), recording the softmax mass on the first
    `first` keys per layer as [H, T]."""

    def __init__(self, model, first: int):
        cfg = model.config
        self.rotary = [model.rotary[t] for t in cfg.layer_types]
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]
        self.first = first
        self.bos_mass: dict[int, torch.Tensor] = {}
        self.first_mass: dict[int, torch.Tensor] = {}

    def __call__(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from kvserve.model.layers import apply_rope

        T, H, D = q.shape
        g = H // k.shape[1]
        pos = torch.arange(T)
        cos, sin = self.rotary[layer.layer].cos_sin(pos, torch.float32)
        qr, kr = apply_rope(q.float(), cos, sin), apply_rope(k.float(), cos, sin).repeat_interleave(g, dim=1)
        scores = torch.einsum("thd,shd->hts", qr, kr) * layer.scale  # [H, T(query), T(key)]
        visible = pos[None, :] <= pos[:, None]
        if self.windows[layer.layer] is not None:
            visible &= pos[None, :] > pos[:, None] - self.windows[layer.layer]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        self.bos_mass[layer.layer] = p[:, :, 0]
        self.first_mass[layer.layer] = p[:, :, :self.first].sum(-1)
        out = torch.einsum("hts,shd->thd", p, v.float().repeat_interleave(g, dim=1))
        return out.to(q.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-tokens", type=int, default=2048)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--from", dest="start", type=int, default=1024, help="first query position for global layers")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()

    from kvserve.loading import load_model
    from kvserve.model.attention import AttentionMetadata
    from kvserve.tools.eval.stream import default_data_path, load_token_stream

    loaded = load_model()
    cfg = loaded.config
    tokens = load_token_stream(loaded.tokenizer, default_data_path(), args.num_tokens, cfg.bos_token_id)
    probe = MassProbe(loaded.model, args.sinks)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), seqs=[], custom=probe)
    with torch.inference_mode():
        loaded.model(tokens, torch.arange(len(tokens)), None, meta)

    rows = []
    print(f"| layer | type | queries | BOS mass per head | BOS mass (mean) | first {args.sinks} tokens (mean) |")
    print("|---|---|---|---|---|---|")
    for i in range(cfg.num_layers):
        w = cfg.window(i)
        lo, hi = (args.start, args.num_tokens) if w is None else (64, min(w, args.num_tokens))
        bos = probe.bos_mass[i][:, lo:hi].mean(-1)
        first = probe.first_mass[i][:, lo:hi].mean()
        kind = "global" if w is None else "local"
        rows.append({"layer": i, "type": kind, "queries": [lo, hi], "bos_mass_per_head": bos.tolist(),
                     "bos_mass": float(bos.mean()), "first_mass": float(first)})
        print(f"| {i} | {kind} | [{lo},{hi}) | {' '.join(f'{x:.3f}' for x in bos.tolist())} | "
              f"{float(bos.mean()):.3f} | {float(first):.3f} |")
    save_json("sink_attention_mass", {"num_tokens": args.num_tokens, "sinks": args.sinks, "layers": rows},
              args.json_dir)


if __name__ == "__main__":
    main()
