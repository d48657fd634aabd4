"""`kvserve roofline`: parameter count, KV cache size, arithmetic intensity per operation, and
memory / latency / throughput as the batch grows, for a model on an accelerator (or this machine,
measured). Pure arithmetic: no weights are loaded."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

from kvserve.argtypes import positive_float, positive_int
from kvserve.tools.analysis import roofline as rl

PLOTS = ("roofline_latency_throughput.png", "roofline_memory_vs_batch.png", "roofline_kv_variants.png")


def _batches(text: str) -> list[int]:
    out = [positive_int(t) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected a comma list of batch sizes, e.g. 1,8,64")
    return sorted(set(out))


def add_roofline_parser(sub) -> None:
    """Register `kvserve roofline` on the top-level subparsers `sub`."""
    p = sub.add_parser("roofline", help="roofline arithmetic: KV size, intensity, memory/latency/throughput vs batch")
    p.add_argument("--hardware", default="h100", help="h100, h200 or a100 (default h100); see --measure")
    p.add_argument("--measure", action="store_true",
                   help="use this machine instead: CPU matmul FLOP/s and read bandwidth measured (a few seconds)")
    p.add_argument("--model", default=None,
                   help="preset (llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, gemma-3-270m, deepseek-v2-lite, "
                        "bamba-9b), "
                        "HF config.json or its folder, or a .gguf (default: bundled Gemma 3 270M)")
    p.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per sequence S (KV size, decode context)")
    p.add_argument("--prompt-len", type=positive_int, default=None, help="prefill tokens T (default: --seq-len)")
    p.add_argument("--batch", type=_batches, default=None,
                   help="comma list of batch sizes (default: powers of 2 up to the first that does not fit)")
    p.add_argument("--kv-bits", type=positive_int, default=None, help="bits per cached element (default: --dtype-bytes)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="override the KV head count (GQA/MQA what-if)")
    p.add_argument("--share-kv-every", type=positive_int, default=None, metavar="N",
                   help="cross-layer KV sharing what-if: runs of N same-type layers cache one K/V")
    p.add_argument("--dtype-bytes", type=positive_float, default=None,
                   help="bytes per weight/activation (default 2 = bf16; 4 = fp32 with --measure, as the CPU engine runs)")
    p.add_argument("--plot", default=None, metavar="DIR", help=f"write {', '.join(PLOTS)} here")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number here")


def _setup(args: argparse.Namespace) -> tuple[rl.ModelShape, rl.Hardware]:
    from kvserve.tools.analysis.measure import measure_hardware
    from kvserve.tools.analysis.presets import hardware_preset, resolve_model

    hw = measure_hardware() if args.measure else hardware_preset(args.hardware)
    model = resolve_model(args.model)
    if args.prompt_len is not None and args.prompt_len > args.seq_len:
        raise ValueError(f"--prompt-len {args.prompt_len} exceeds --seq-len {args.seq_len}")
    wb = args.dtype_bytes or (4.0 if args.measure else 2.0)
    if args.kv_bits is not None and args.kv_bits > 32:
        raise ValueError(f"--kv-bits {args.kv_bits}: at most 32")
    model = replace(model, weight_bytes=wb, kv_bytes=args.kv_bits / 8 if args.kv_bits else wb)
    if args.kv_heads is not None:
        if model.mla:
            raise ValueError(f"--kv-heads does not apply to {model.name}: it caches an MLA latent")
        if model.heads % args.kv_heads:
            raise ValueError(f"--kv-heads {args.kv_heads} must divide the model's {model.heads} attention heads")
        model = replace(model, kv_heads=args.kv_heads)
    if args.share_kv_every is not None:
        if model.mla:
            raise ValueError(f"--share-kv-every does not apply to {model.name}: it caches an MLA latent")
        model = replace(model, kv_share=args.share_kv_every)
    return model, hw


def analyze(model: rl.ModelShape, hw: rl.Hardware, seq_len: int, prompt_len: int,
            batches: list[int] | None = None) -> dict:
    """Every number the command prints, as a JSON-able dict (bytes, seconds, FLOP/byte)."""
    batches = batches or rl.default_batches(model, hw, seq_len)
    top = rl.max_batch(model, hw, seq_len)
    decode_batch = top if top > 1 else batches[-1]
    columns = {f"prefill B=1 T={prompt_len}": rl.prefill_costs(model, 1, prompt_len),
               "decode B=1": rl.decode_costs(model, 1, seq_len),
               f"decode B={decode_batch}": rl.decode_costs(model, decode_batch, seq_len)}
    variants = [{"variant": label, "kv_bytes_per_sequence": rl.kv_bytes_per_sequence(v, seq_len),
                 "params": rl.num_params(v), "max_batch": rl.max_batch(v, hw, seq_len),
                 "throughput_at_max_batch": (rl.batch_point(v, hw, rl.max_batch(v, hw, seq_len), seq_len).throughput
                                             if rl.max_batch(v, hw, seq_len) else 0.0)}
                for label, v in rl.kv_variants(model)]
    return {
        "hardware": {**asdict(hw), "intensity": hw.intensity},
        "model": {**asdict(model), "attention": rl.attention_kind(model)},
        "seq_len": seq_len, "prompt_len": prompt_len,
        "params": rl.num_params(model), "active_params": rl.num_params(model, active=True),
        "weight_bytes": rl.weight_memory(model),
        "kv_bytes_per_token": rl.kv_bytes_per_token(model),
        "kv_bytes_per_sequence": rl.kv_bytes_per_sequence(model, seq_len),
        "state_bytes_per_sequence": rl.state_bytes_per_sequence(model),
        "max_batch": top,
        "ops": {col: {"ops": [{"name": op.name, "flops": op.flops, "bytes": op.bytes, "intensity": op.intensity,
                               "bound": op.bound(hw)} for op in ops], "step_time_s": rl.step_time(ops, hw)}
                for col, ops in columns.items()},
        "sweep": [asdict(p) for p in rl.batch_sweep(model, hw, seq_len, batches)],
        "kv_variants": variants,
    }


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _time(t: float) -> str:
    return f"{t:,.2f} s" if t >= 1 else f"{t * 1e3:.3g} ms"


def _count(x: float) -> str:
    """A parameter count: 13.02 B, 268.1 M."""
    return f"{x / 1e9:.2f} B" if x >= 1e9 else f"{x / 1e6:.1f} M"


def _attention_layers(m: dict) -> str:
    """"32 layers", or for a hybrid "3 of 32 layers (29 Mamba2)"."""
    mamba = m.get("mamba_layers", 0)
    return f"{m['layers']} layers" if not mamba else f"{m['layers'] - mamba} of {m['layers']} layers ({mamba} Mamba2)"


def render(r: dict) -> str:
    """The readable tables."""
    hw, m, s = r["hardware"], r["model"], r["seq_len"]
    kv_note = "" if m["sliding_layers"] == 0 else f", {m['sliding_layers']} sliding layers keep {m['sliding_window']}"
    lines = [
        f"{m['name']} on {hw['name']}: sequences of S = {s} tokens, prefill of T = {r['prompt_len']}, "
        f"{m['weight_bytes']:g}-byte weights, {m['kv_bytes']:g}-byte KV",
        "",
        "| quantity | value |", "|---|---|",
        f"| peak compute | {_si(hw['flops'], 'FLOP/s')} |",
        f"| memory bandwidth | {_si(hw['bandwidth'], 'B/s')} |",
        f"| memory | {_si(hw['memory'], 'B')} |",
        f"| accelerator intensity | {hw['intensity']:.3g} FLOP/byte |",
        f"| parameters | {r['params']:,} ({_count(r['params'])})"
        + (f", {_count(r['active_params'])} active per token |" if r["active_params"] != r["params"] else " |"),
        f"| weights | {_si(r['weight_bytes'], 'B')} |",
        f"| attention | {m['attention']}, {_attention_layers(m)}, {m['heads']} heads x {m['head_dim']} |",
        f"| KV bytes per token | {r['kv_bytes_per_token']:,.0f} |",
        f"| KV bytes per sequence (S = {s}{kv_note}) | {r['kv_bytes_per_sequence']:,.0f} "
        f"({_si(r['kv_bytes_per_sequence'], 'B')}) |",
        *([f"| recurrent state per sequence ({m['mamba_layers']} Mamba layers, any S) | "
           f"{r['state_bytes_per_sequence']:,.0f} ({_si(r['state_bytes_per_sequence'], 'B')}) |"]
          if r.get("state_bytes_per_sequence") else []),
        f"| max batch that fits in {_si(hw['memory'], 'B')} | {r['max_batch']:,} |",
        "",
        f"Arithmetic intensity in FLOP/byte (compute-bound above {hw['intensity']:.3g}):",
        "",
        "| operation | " + " | ".join(r["ops"]) + " |",
        "|---|" + "---|" * len(r["ops"]),
    ]
    cols = list(r["ops"].values())
    for i, op in enumerate(cols[0]["ops"]):
        cells = [f"{c['ops'][i]['intensity']:,.1f} ({c['ops'][i]['bound']})" for c in cols]
        lines.append(f"| {op['name']} | " + " | ".join(cells) + " |")
    lines.append("| step time | " + " | ".join(_time(c["step_time_s"]) for c in cols) + " |")
    per_seq = "(KV + recurrent state)" if r.get("state_bytes_per_sequence") else "KV"
    lines += ["", f"Decode at context {s} as the batch grows (memory = weights + batch x {per_seq} per sequence):", "",
              "| batch | memory | fits | step (= time per token) | throughput | bound |", "|---|---|---|---|---|---|"]
    for p in r["sweep"]:
        lines.append(f"| {p['batch']:,} | {_si(p['memory'], 'B')} | {'yes' if p['fits'] else 'OOM'} | "
                     f"{_time(p['step_time'])} | {p['throughput']:,.0f} tok/s | {p['bound']} |")
    if r["max_batch"]:
        lines.append(f"\nOut of memory above batch {r['max_batch']:,} ({_si(hw['memory'], 'B')}).")
    else:
        lines.append(f"\nThe weights alone ({_si(r['weight_bytes'], 'B')}) do not fit in {_si(hw['memory'], 'B')}.")
    lines += ["", "KV cache variants (same model otherwise):", "",
              "| variant | KV per sequence | params | max batch | tok/s at max batch |", "|---|---|---|---|---|"]
    for v in r["kv_variants"]:
        lines.append(f"| {v['variant']} | {_si(v['kv_bytes_per_sequence'], 'B')} | {_count(v['params'])} | "
                     f"{v['max_batch']:,} | {v['throughput_at_max_batch']:,.0f} |")
    return "\n".join(lines)


def _grid(upper: int, points: int = 80) -> list[int]:
    """About `points` batch sizes from 1 to `upper`, evenly spaced on a log axis, and every power
    of two up to `upper`."""
    import numpy as np

    upper = max(upper, 2)
    twos = {1 << i for i in range(upper.bit_length()) if 1 << i <= upper}
    return sorted({int(b) for b in np.geomspace(1, upper, points).round()} | twos)


def _plain_log(*axes) -> None:
    """Log axes labelled in plain numbers (1, 2, 5, 10, ...; only powers of ten over more than
    three decades) instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter

    def formatter(axis) -> FuncFormatter:
        def label(v: float, _pos) -> str:
            lo, hi = sorted(axis.get_view_interval())
            wide = lo > 0 and hi / lo > 1e3
            mantissa = round(v / 10 ** math.floor(math.log10(v)), 6) if v > 0 else 0
            return f"{v:,.10g}" if mantissa in ((1,) if wide else (1, 2, 5)) else ""
        return FuncFormatter(label)

    for ax in axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                axis.set_major_formatter(formatter(axis))
                axis.set_minor_formatter(formatter(axis))


def plot(model: rl.ModelShape, hw: rl.Hardware, seq_len: int, out_dir: str) -> list[Path]:
    """Write the three PNGs into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in PLOTS]
    top = rl.max_batch(model, hw, seq_len)
    grid = _grid(max(4 * top, 256))
    pts = rl.batch_sweep(model, hw, seq_len, grid)
    where = f"{model.name} on {hw.name}\ndecode at S = {seq_len}"

    fig, ax = plt.subplots(figsize=(8, 5.5))
    ok = [p for p in pts if p.fits]
    oom = [p for p in pts if not p.fits]
    ax.plot([p.throughput for p in ok], [p.step_time * 1e3 for p in ok], "o-", ms=3, label="fits in memory")
    ax.plot([p.throughput for p in oom], [p.step_time * 1e3 for p in oom], "o--", ms=3, color="grey", mfc="none",
            label="out of memory")
    if top:
        p = rl.batch_point(model, hw, top, seq_len)
        ax.plot(p.throughput, p.step_time * 1e3, "r*", ms=14, label=f"largest batch that fits: {top:,}")
    for p in pts:
        if p.batch & (p.batch - 1) == 0:  # label powers of two
            ax.annotate(f"B={p.batch}", (p.throughput, p.step_time * 1e3), textcoords="offset points",
                        xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (output tokens/s)")
    ax.set_ylabel("latency per output token (ms)")
    ax.set_title(f"Latency vs throughput as the batch grows\n{where}", fontsize=10)
    _plain_log(ax)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5.5))
    b = [p.batch for p in pts]
    weights = rl.weight_memory(model) / 1e9
    ax.fill_between(b, 0, weights, color="tab:blue", alpha=0.5, label=f"weights ({weights:.3g} GB)")
    ax.fill_between(b, weights, [p.memory / 1e9 for p in pts], color="tab:orange", alpha=0.5,
                    label=f"KV cache ({rl.kv_bytes_per_sequence(model, seq_len) / 1e6:,.4g} MB per sequence)")
    ax.axhline(hw.memory / 1e9, color="red", label=f"capacity ({hw.memory / 1e9:.3g} GB)")
    if top:
        ax.axvline(top, color="red", ls=":", label=f"largest batch that fits: {top:,}")
    ax.set_xscale("log")
    ax.set_ylim(0, max(hw.memory, pts[-1].memory) * 1.05 / 1e9)
    ax.set_xlim(1, b[-1])
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("memory (GB)")
    ax.set_title(f"Memory vs batch\n{where}", fontsize=10)
    _plain_log(ax)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    variants = rl.kv_variants(model)
    fig, (axk, axt) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1, 1.4]})
    labels = [label for label, _ in variants]
    kv = [rl.kv_bytes_per_sequence(v, seq_len) / 1e6 for _, v in variants]
    tops = [rl.max_batch(v, hw, seq_len) for _, v in variants]
    bars = axk.barh(labels, kv, color=[f"C{i}" for i in range(len(variants))])
    for bar, t in zip(bars, tops):
        axk.annotate(f" max batch {t:,}", (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center",
                     fontsize=8)
    axk.invert_yaxis()
    axk.set_xscale("log")
    axk.set_xlim(min(kv) / 2, max(kv) * 6)
    axk.set_xlabel(f"KV cache per sequence at S = {seq_len} (MB, log)")
    axk.set_title("KV bytes per sequence and the largest batch that fits", fontsize=10)
    axk.grid(alpha=0.3, axis="x", which="both")
    for i, ((label, v), t) in enumerate(zip(variants, tops)):
        if not t:
            continue
        vp = rl.batch_sweep(v, hw, seq_len, _grid(t, 40))
        axt.plot([p.batch for p in vp], [p.throughput for p in vp], "-", color=f"C{i}", label=label)
        axt.plot(vp[-1].batch, vp[-1].throughput, "o", color=f"C{i}")
    axt.set_xscale("log")
    axt.set_yscale("log")
    axt.set_xlabel("batch (sequences); each curve ends at its largest batch that fits (dot)")
    axt.set_ylabel("decode throughput (output tokens/s)")
    axt.set_title(f"Effect of GQA / MLA / CLA / KV bits\n{where}", fontsize=10)
    axt.grid(alpha=0.3, which="both")
    if any(tops):
        axt.legend(fontsize=8)
    else:
        axt.text(0.5, 0.5, "no variant fits: the weights exceed memory", ha="center", transform=axt.transAxes)
    _plain_log(axk, axt)
    axk.xaxis.set_minor_formatter(NullFormatter())  # room for the bar labels
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def run(args: argparse.Namespace) -> int:
    model, hw = _setup(args)
    prompt_len = args.prompt_len or args.seq_len
    report = analyze(model, hw, args.seq_len, prompt_len, args.batch)
    print(render(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        for path in plot(model, hw, args.seq_len, args.plot):
            print(f"wrote {path}")
    return 0
