"""How coarse can the greedy head's screen be? Candidates left by the rigorous bound at other precisions.

kvserve/kernels/greedy_head.c bounds every logit of an fp32 row h against an int8 copy of the head
(per-token scale, |q| <= 127) with h quantized to int16 (|hq| <= 16383):
    |w . h - s sh (q . hq)| <= s |q|_1 r + e |h|_1     (r, e: the largest rounding error of h, w).
It runs at vpmaddwd's rate (16 multiply-adds an instruction). vpmaddubsw does 32, but takes one
operand as unsigned bytes, so h would have to fit 7 bits (|hq| <= 63, offset to 1..127) or w 7 bits
with h 8. This script counts, on real final hidden states of Gemma 3 270M (greedy rows of WikiText-2
prompts and of the throughput benchmark's random-token prompts), how many tokens each scheme leaves
as candidates (upper bound >= the best lower bound) and in how many 16-token panels they lie;
"outliers N": the N dimensions of h with the largest mean |h| kept exact (their own int16 pass),
the rest quantized at the coarse precision with their own scale.

A second table asks whether a progressive screen could skip work: after the first K dimensions
(ordered by mean |h|, or along W's singular vectors), the tokens whose partial logit plus the
Cauchy-Schwarz bound of the rest, |w_rest| |h_rest|, still reaches the best logit.

    cd benchmarks && ../.venv/bin/python screen_precision.py [--rows 100] [--json-dir DIR]
"""
from __future__ import annotations

import argparse

import torch
from _common import save_json, wikitext2_test

from kvserve import LLM, SamplingParams
from kvserve.cli import positive_int
from kvserve.engine import model_runner
from kvserve.loading import load_model
from kvserve.tools.bench.throughput import make_workload


def capture_hidden(loaded) -> torch.Tensor:
    """Final hidden states [rows, 640] of greedy rows: random-token and WikiText-2 prompts."""
    rows: list[torch.Tensor] = []
    original = model_runner.greedy_tokens

    def keep(model, hidden):
        rows.append(hidden.clone())
        return original(model, hidden)

    model_runner.greedy_tokens = keep
    try:
        cfg = loaded.config
        llm = LLM(loaded=loaded, max_num_seqs=16, enable_prefix_caching=False)
        wl = make_workload(16, (32, 512), (16, 64), cfg.vocab_size, cfg.bos_token_id, 1)
        llm.generate(wl.prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens])
        text = (wikitext2_test()).read_text(encoding="utf-8")[:15000]
        llm.generate([text[i:i + 1500] for i in range(0, 15000, 1500)],
                     SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    finally:
        model_runner.greedy_tokens = original
    return torch.cat(rows)


def candidates(W: torch.Tensor, H: torch.Tensor, w_levels: int, h_levels: int, exact_dims: torch.Tensor):
    """Per row of H: (tokens whose upper bound reaches the best lower bound, 16-token panels
    holding them), the bound of greedy_head.c with w at +-w_levels and h at +-h_levels outside
    `exact_dims` (whose terms are kept as the int16 screen computes them: no h error)."""
    a = W.abs().amax(1, keepdim=True)
    s = a / w_levels
    q = torch.round(W / s)
    e = (W - s * q).abs().amax(1)
    s = s.squeeze(1)
    rest = torch.ones(W.shape[1], dtype=torch.bool)
    rest[exact_dims] = False
    q_rest, q_exact = q[:, rest], q[:, exact_dims]
    l1_rest = q_rest.abs().sum(1)
    out = []
    for h in H:
        hr = h[rest]
        sh = hr.abs().max() / h_levels
        hq = torch.round(hr / sh)
        r = (hr - sh * hq).abs().max()
        est = s * sh * (q_rest @ hq) + s * (q_exact @ h[exact_dims])
        width = (s * l1_rest * r + e * h.abs().sum()) * (1 + 1e-9)
        keep = est + width >= (est - width).max()
        out.append((int(keep.sum()), int(keep.view(-1, 16).any(1).sum())))
    return out


def progressive_survivors(W: torch.Tensor, H: torch.Tensor, order: torch.Tensor, ks: tuple[int, ...]) -> dict:
    """Per ordering (`order` of the dimensions, or W's right singular vectors) and K: the fraction of
    tokens per row (median, p90) whose partial dot over the first K dimensions plus
    |w_rest|_2 |h_rest|_2 reaches the row's best logit."""
    _, _, vh = torch.linalg.svd(W, full_matrices=False)
    out = {}
    for name, w, h in (("mean |h|", W[:, order], H[:, order]), ("singular vectors", W @ vh.T, H @ vh.T)):
        best = (h @ w.T).max(1).values
        for k in ks:
            upper = h[:, :k] @ w[:, :k].T + h[:, k:].norm(dim=1, keepdim=True) * w[:, k:].norm(dim=1)
            frac = (upper >= best[:, None]).double().mean(1)
            out[f"{name}, K={k}"] = (float(frac.median()), float(frac.quantile(.9)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=positive_int, default=100, help="rows sampled from the captured ones")
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    loaded = load_model(None, "float32")
    H = capture_hidden(loaded).double()
    W = loaded.model.embed_tokens.weight.detach().double()
    g = torch.Generator().manual_seed(0)
    H = H[torch.randperm(H.shape[0], generator=g)[:args.rows]]
    order = H.abs().mean(0).argsort(descending=True)
    schemes = [("int8 w, int16 h (the kernel)", 127, 16383, 0), ("int7 w, int8 h", 63, 127, 0),
               ("int8 w, int7 h", 127, 63, 0), ("int8 w, int7 h, outliers 16", 127, 63, 16),
               ("int8 w, int7 h, outliers 64", 127, 63, 64), ("int7 w, int8 h, outliers 16", 63, 127, 16)]
    print(f"{H.shape[0]} rows; candidates of {W.shape[0]:,} tokens (median, p90), 16-token panels holding them (median, p90)")
    print("| scheme | candidates median | p90 | panels median | p90 |\n|---|---|---|---|---|")
    results = {}
    for name, wl, hl, nout in schemes:
        got = torch.tensor(candidates(W, H, wl, hl, order[:nout]), dtype=torch.float64)
        c, pn = got[:, 0], got[:, 1]
        results[name] = {"candidates": got[:, 0].tolist(), "panels": got[:, 1].tolist()}
        print(f"| {name} | {c.median():.0f} | {c.quantile(.9):.0f} | {pn.median():.0f} | {pn.quantile(.9):.0f} |",
              flush=True)
    print("\nprogressive screen: fraction of tokens left after K dimensions (median, p90)")
    print("| ordering, K | median | p90 |\n|---|---|---|")
    progressive = progressive_survivors(W, H, order, (64, 128, 256, 384, 512))
    for key, (med, p90) in progressive.items():
        print(f"| {key} | {med:.4f} | {p90:.4f} |", flush=True)
    save_json("screen_precision", {"rows": H.shape[0], "schemes": results, "progressive": progressive},
              args.json_dir)


if __name__ == "__main__":
    main()
