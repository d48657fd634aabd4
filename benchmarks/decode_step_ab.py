"""The measurements behind issue 9's decode-step choices, each A/B side by side in one process.

    python benchmarks/decode_step_ab.py head-rows    # LM head GEMM: rows 1..64, plain vs padded to 16
    python benchmarks/decode_step_ab.py fusion       # q/k/v and gate/up: separate vs one fused GEMM
    python benchmarks/decode_step_ab.py norm         # batch-1 decode: RMSNorm as 6 ops, F.rms_norm, C kernel
    python benchmarks/decode_step_ab.py int8-gemv    # batch-1 int8 decode: C kernel vs _weight_int8pack_mm
    python benchmarks/decode_step_ab.py fused-decode # batch-1 int4 / int8 decode: q/k/v, gate/up fused or not
    python benchmarks/decode_step_ab.py panels       # fp32 GEMMs of 1..128 rows: MKL vs the packed-panel kernel
    python benchmarks/decode_step_ab.py packed-decode  # batch-1 fp32 decode, pack_weights off / on
    python benchmarks/decode_step_ab.py argmax       # greedy pick over [rows, 262144]: torch max vs the C kernel
    python benchmarks/decode_step_ab.py int4-rows    # PyTorch's int4 kernel on one row: GB/s per matrix shape
    python benchmarks/decode_step_ab.py fused-step   # batch-1 fp32 / int8 decode: the per-layer torch ops
                                                     # vs the fused prologue, residual norms, q/k/v panels
    python benchmarks/decode_step_ab.py lowbit-rows  # int8 / int4 matmuls of 1..512 rows: PyTorch's kernels,
                                                     # kvserve's C kernels, dequantize + fp32 matmul
    python benchmarks/decode_step_ab.py decode-plan  # batch-1 decode: the layers from Python vs one C call
    python benchmarks/decode_step_ab.py prefill-panels  # 512-token fp32 prefill: MKL vs the panel kernel

GEMM timings are medians of repeated calls; the decode ones alternate A and B over --rounds
requests of the bundled Gemma 3 270M (a 200-token prompt, 96 new tokens) and compare tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from _common import machine, save_json


def _ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def head_rows(args) -> dict:
    """The 262144 x 640 fp32 LM head against few rows: MKL's slow path and the padding around it."""
    from kvserve.model.base import HEAD_PAD_ROWS

    w = torch.randn(262144, 640)
    out = {}
    for m in (1, 4, 5, 6, 7, 8, 10, 12, 14, 15, 16, 32, 64):
        x = torch.randn(m, 640)
        padded = torch.zeros(max(m, HEAD_PAD_ROWS), 640)
        padded[:m] = x
        out[m] = {"plain_ms": _ms(lambda: F.linear(x, w), args.reps),
                  "padded_ms": _ms(lambda: F.linear(padded, w)[:m], args.reps)}
        print(f"rows {m:3d}: plain {out[m]['plain_ms']:6.1f} ms, padded to {padded.shape[0]}: "
              f"{out[m]['padded_ms']:6.1f} ms")
    return out


def fusion(args) -> dict:
    """Gemma 3 270M's projection shapes: q (1024) k, v (256 each) and gate, up (2048 each) from 640."""
    wq, wk, wv = torch.randn(1024, 640), torch.randn(256, 640), torch.randn(256, 640)
    wg, wu = torch.randn(2048, 640), torch.randn(2048, 640)
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    out = {}
    for m in (1, 8, 64, 512, 2048):
        x = torch.randn(m, 640)
        r = {"qkv_ms": _ms(lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)), args.reps),
             "qkv_fused_ms": _ms(lambda: F.linear(x, wqkv).split([1024, 256, 256], -1), args.reps),
             "gate_up_ms": _ms(lambda: (F.linear(x, wg), F.linear(x, wu)), args.reps),
             "gate_up_fused_ms": _ms(lambda: F.linear(x, wgu).chunk(2, -1), args.reps)}
        out[m] = r
        print(f"rows {m:4d}: qkv {r['qkv_ms']:.3f} vs fused {r['qkv_fused_ms']:.3f} ms | gate/up "
              f"{r['gate_up_ms']:.3f} vs fused {r['gate_up_fused_ms']:.3f} ms")
    return out


def _decode_ab(args, label: str, variants: dict[str, Callable[[], object]]) -> dict:
    """Alternate the variants over args.rounds requests; a variant sets the process up and
    returns the LLM to run."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    ids = list(range(1000, 1200))
    tok_s: dict[str, list[float]] = {k: [] for k in variants}
    tokens = {}
    for _ in range(args.rounds):
        for name, setup in variants.items():
            o = setup().generate(ids, params)[0]
            tokens[name] = o.outputs[0].token_ids
            tok_s[name].append(1 / o.metrics.tpot)
    names = list(variants)
    res = {k: {"runs": v, "median_tok_s": statistics.median(v)} for k, v in tok_s.items()}
    res["same_tokens"] = all(tokens[n] == tokens[names[0]] for n in names)
    print(label, {k: round(v["median_tok_s"], 2) for k, v in res.items() if isinstance(v, dict)},
          "same tokens:", res["same_tokens"])
    return res


def _llm(weights: str, loaded=None):
    from kvserve import LLM

    return LLM(loaded=loaded, weights=weights, enable_prefix_caching=False, max_num_seqs=1, kv_cache_gib=0.5)


def norm(args) -> dict:
    """Batch-1 decode with RMSNorm as the former 6 ops, as F.rms_norm, and as the C kernel."""
    from kvserve.model import layers

    current, limit = layers.RMSNorm.forward, layers.NORM_KERNEL_MAX_ELEMENTS

    def six_ops(self, x):  # the former RMSNorm.forward
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    out = {}
    for weights in ("float", "int4"):
        llm = _llm(weights)

        def use(forward, small):
            def setup():
                layers.RMSNorm.forward, layers.NORM_KERNEL_MAX_ELEMENTS = forward, small
                return llm
            return setup

        out[weights] = _decode_ab(args, weights, {"six_ops": use(six_ops, 0), "F.rms_norm": use(current, 0),
                                                  "C kernel": use(current, limit)})
    return out


def int8_gemv(args) -> dict:
    """Batch-1 int8 decode: PyTorch's _weight_int8pack_mm vs the C kernel, one engine."""
    from kvserve.quant.linear import QuantLinear

    llm = _llm("int8")
    layers = [m for m in llm.engine.loaded.model.modules() if isinstance(m, QuantLinear)]

    def use(on: bool):
        def setup():
            for m in layers:
                if on:
                    m.use_gemv_kernel()
                else:
                    m._gemv = None
            return llm
        return setup

    return _decode_ab(args, "int8", {"_weight_int8pack_mm": use(False), "C gemv": use(True)})


def fused(args) -> dict:
    """Batch-1 low-bit decode, q/k/v and gate/up fused or separate: two engines, same weights."""
    import kvserve.quant.fuse as fuse
    from kvserve.loading import load_model

    loaded = load_model(None)
    out = {}
    for weights in ("int4", "int8"):
        with_fusion = _llm(weights, loaded)
        real, fuse.fuse_projections = fuse.fuse_projections, lambda model: 0
        try:
            separate = _llm(weights, loaded)
        finally:
            fuse.fuse_projections = real
        out[weights] = _decode_ab(args, weights, {"separate": lambda: separate, "fused": lambda: with_fusion})
    return out


def _interleaved_ms(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median ms of each function, calls interleaved so machine drift hits all alike."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def panels(args) -> dict:
    """Gemma 3 270M's fp32 matrices (the tied head, q/k/v, o, gate/up, down) against 1..128 rows
    (the layers also 256 and 512, prefill chunks):
    F.linear (MKL; the head as the engine ran it before, 5..15 rows padded to 16) vs panel_matmul."""
    from kvserve import kernels
    from kvserve.model.base import head_matmul

    out = {}
    for name, (n, k) in {"head": (262144, 640), "qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640),
                         "down": (640, 2048)}.items():
        w = torch.randn(n, k)
        packed = kernels.pack_panels(w)
        for m in (1, 4, 8, 16, 32, 64, 128) + ((256, 512) if name != "head" else ()):
            x = torch.randn(m, k)
            mkl = (lambda: head_matmul(x, w)) if name == "head" else (lambda: F.linear(x, w))
            r = _interleaved_ms({"mkl": mkl, "panels": lambda: kernels.panel_matmul(x, packed, n)}, args.reps)
            r["speedup"] = r["mkl"] / r["panels"]
            out[f"{name} {n}x{k} rows {m}"] = r
            print(f"{name:8s} {n}x{k} rows {m:3d}: MKL {r['mkl']:8.2f} ms, panels {r['panels']:8.2f} ms "
                  f"({r['speedup']:.2f}x, {2 * m * n * k / r['panels'] / 1e6:.0f} GFLOP/s)")
    return out


def packed_decode(args) -> dict:
    """Batch-1 fp32 decode of two engines on separately loaded copies: weights packed or not."""
    from kvserve import LLM
    from kvserve.loading import load_model

    def llm(pack: bool):
        return LLM(loaded=load_model(None), pack_weights=pack, enable_prefix_caching=False, max_num_seqs=1,
                   kv_cache_gib=0.5)

    plain, packed = llm(False), llm(True)
    return {"fp32": _decode_ab(args, "fp32", {"MKL": lambda: plain, "panels": lambda: packed})}


def _add_then_norm(self, residual, x, then=None):
    """RMSNorm.add_to as separate torch steps (the unfused reference)."""
    h = residual + self(x)
    return h if then is None else (h, then(h))


def fused_step(args) -> dict:
    """Batch-1 decode with the attention prologue (q/k norms, RoPE, K/V write) and the residual
    norms as torch ops and q/k/v, gate/up as separate packed matrices (fp32), vs the fused C
    kernels and stacked panels: two engines on separately loaded copies, alternating."""
    from kvserve import LLM
    from kvserve.loading import load_model
    from kvserve.model.attention import Attention
    from kvserve.model.layers import GatedMLP, RMSNorm
    from kvserve.model.panels import Panels

    fused_prologue, add_to = Attention._fused_prologue, RMSNorm.add_to

    def llm(weights: str, fuse: bool):
        engine = LLM(loaded=load_model(None), weights=weights, enable_prefix_caching=False, max_num_seqs=1,
                     kv_cache_gib=0.5)
        if not fuse:  # back to one packed copy per Linear
            for m in engine.engine.loaded.model.modules():
                for name, parts in (("qkv_panels", ("q_proj", "k_proj", "v_proj")),
                                    ("gate_up_panels", ("gate_proj", "up_proj"))):
                    if isinstance(m, (Attention, GatedMLP)) and getattr(m, name, None) is not None:
                        setattr(m, name, None)
                        for p in parts:
                            getattr(m, p).panels = Panels.pack(getattr(m, p).weight)
        return engine

    def use(engine, fuse: bool):
        def setup():
            Attention._fused_prologue = fused_prologue if fuse else (lambda self, *a: None)
            RMSNorm.add_to = add_to if fuse else (_add_then_norm)
            return engine
        return setup

    out = {}
    try:
        for weights in args.weights.split(","):
            ops, fused = llm(weights, False), llm(weights, True)
            out[weights] = _decode_ab(args, weights, {"torch ops": use(ops, False), "fused": use(fused, True)})
            del ops, fused
    finally:
        Attention._fused_prologue, RMSNorm.add_to = fused_prologue, add_to
    return out


def int4_rows(args) -> dict:
    """One row through QuantLinear int4 (PyTorch's _weight_int4pack_mm_for_cpu, bf16 activations)
    on Gemma 3 270M's shapes: the weight bytes over the time, from cache (so not memory-bound)."""
    from kvserve.quant.linear import QuantLinear
    from kvserve.quant.rtn import quantize_rtn
    from kvserve.quant.spec import QuantSpec

    spec = QuantSpec(bits=4, sym=False, group_size=128)
    out = {}
    for name, (n, k) in {"head": (262144, 640), "qkv": (1536, 640), "gate_up": (4096, 640),
                         "down": (640, 2048)}.items():
        layer = QuantLinear.from_quantized(quantize_rtn(torch.randn(n, k) * 0.02, spec), kernel="int4")
        x = torch.randn(1, k)
        ms = _ms(lambda: layer(x), args.reps)
        nbytes = layer.weight_nbytes
        out[name] = {"ms": ms, "weight_bytes": nbytes, "GB_s": nbytes / ms / 1e6}
        print(f"{name:8s} {n}x{k}: {ms:.3f} ms, {nbytes / ms / 1e6:.1f} GB/s of weights")
    return out


def lowbit_rows(args) -> dict:
    """Gemma 3 270M's int8 / int4 projections (QuantLinear as the engine builds them) against 1..512
    rows: PyTorch's kernels (bf16 activations), kvserve's C kernels (the rows kernel's per-row
    loop), and the weight dequantized to fp32 + F.linear; calls interleaved, from cache."""
    from kvserve import kernels
    from kvserve.quant.linear import QuantLinear
    from kvserve.quant.packing import cpu_int4_block_n
    from kvserve.quant.rtn import quantize_rtn
    from kvserve.quant.spec import QuantSpec

    specs = {"int8": QuantSpec(bits=8, sym=True, granularity="channel", scale_dtype=torch.bfloat16),
             "int4": QuantSpec(bits=4, sym=False, group_size=128, scale_dtype=torch.bfloat16)}
    out = {}
    for kind, spec in specs.items():
        for name, (n, k) in {"qkv": (1536, 640), "gate_up": (4096, 640), "down": (640, 2048)}.items():
            layer = QuantLinear.from_quantized(quantize_rtn(torch.randn(n, k) * 0.02, spec), kernel=kind)
            layer.use_gemv_kernel()
            torch_path = lambda x: (torch.ops.aten._weight_int8pack_mm(x.bfloat16(), layer.qweight, layer.scales)  # noqa: E731
                                    if kind == "int8" else torch.ops.aten._weight_int4pack_mm_for_cpu(
                                        x.bfloat16(), layer.qweight, layer.group_size, layer.scales_and_zeros))
            c_path = lambda x: (kernels.int8_gemv(x, layer.qweight, layer._gemv) if kind == "int8"  # noqa: E731
                                else kernels.int4_gemv(x, layer.qweight, layer._gemv, layer.group_size,
                                                       cpu_int4_block_n()))
            for m in (1, 4, 16, 64, 128, 512):
                x = torch.randn(m, k)
                r = _interleaved_ms({"pytorch": lambda: torch_path(x), "kvserve C": lambda: c_path(x),
                                     "dequant+F.linear": lambda: layer._dequantized_matmul(x)}, args.reps)
                out[f"{kind} {name} {n}x{k} rows {m}"] = r
                print(f"{kind} {name:8s} {n}x{k} rows {m:3d}: " + ", ".join(f"{a} {b:.3f} ms" for a, b in r.items()))
    return out


def decode_plan(args) -> dict:
    """Batch-1 decode with the layers run from Python vs as one C call (model/decode_plan.py): one
    engine per --weights, the plan switched off and on between alternating requests."""
    from kvserve.model.decode_plan import DecodePlan

    applies = DecodePlan.applies

    def use(engine, on: bool):
        def setup():
            DecodePlan.applies = staticmethod(applies if on else (lambda h, meta: False))
            return engine
        return setup

    out = {}
    try:
        for weights in args.weights.split(","):
            engine = _llm(weights)
            out[weights] = _decode_ab(args, weights, {"python layers": use(engine, False), "C plan": use(engine, True)})
            del engine
    finally:
        DecodePlan.applies = staticmethod(applies)
    return out


def prefill_panels(args) -> dict:
    """Fresh 512-token prompts through one fp32 engine, alternating the prefill's matmuls between
    MKL (MAX_PANEL_ROWS 128, the earlier limit) and the packed-panel kernel (every chunk)."""
    from kvserve import LLM, SamplingParams
    from kvserve.bench.throughput import make_workload
    from kvserve.loading import load_model
    from kvserve.model import panels as panel_module

    loaded = load_model(None)
    llm = LLM(loaded=loaded, enable_prefix_caching=False, max_num_seqs=1, max_model_len=600)
    prompts = make_workload(2 * args.rounds + 1, (512, 512), (1, 1), loaded.config.vocab_size,
                            loaded.config.bos_token_id, 0).prompts
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    limit = panel_module.MAX_PANEL_ROWS
    llm.generate(prompts[0], params)
    tok_s: dict[str, list[float]] = {"MKL": [], "panels": []}
    try:
        for i, ids in enumerate(prompts[1:]):
            name = "MKL" if i % 2 == 0 else "panels"
            panel_module.MAX_PANEL_ROWS = 128 if name == "MKL" else limit
            t = time.perf_counter()
            llm.generate(ids, params)
            tok_s[name].append(512 / (time.perf_counter() - t))
    finally:
        panel_module.MAX_PANEL_ROWS = limit
    out = {k: {"runs": v, "median_tok_s": statistics.median(v)} for k, v in tok_s.items()}
    print("512-token prefill tok/s:", {k: round(v["median_tok_s"], 1) for k, v in out.items()})
    return out


def argmax(args) -> dict:
    from kvserve import kernels

    out = {}
    for m in (1, 8, 64):
        x = torch.randn(m, 262144)
        r = _interleaved_ms({"torch max": lambda: x.max(dim=-1).indices, "C argmax": lambda: kernels.argmax_rows(x)},
                            args.reps)
        out[f"rows {m}"] = r
        print(f"[{m}, 262144]: torch max {r['torch max']:.2f} ms, C argmax {r['C argmax']:.2f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["head-rows", "fusion", "norm", "int8-gemv", "fused-decode", "panels",
                                     "packed-decode", "argmax", "fused-step", "int4-rows", "lowbit-rows",
                                     "decode-plan", "prefill-panels"])
    ap.add_argument("--reps", type=int, default=7, help="calls per GEMM timing (median)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating requests per decode variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="fp32,int8", help="fused-step, decode-plan: the engines' --weights")
    ap.add_argument("--json-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = {"head-rows": head_rows, "fusion": fusion, "norm": norm, "int8-gemv": int8_gemv,
           "fused-decode": fused, "panels": panels, "packed-decode": packed_decode, "argmax": argmax,
           "fused-step": fused_step, "int4-rows": int4_rows, "lowbit-rows": lowbit_rows,
           "decode-plan": decode_plan, "prefill-panels": prefill_panels}[args.what]
    data = run(args)
    print(machine())
    save_json(f"decode_step_{args.what.replace('-', '_')}", {"results": data}, args.json_dir)


if __name__ == "__main__":
    main()
