"""Compile every Triton kernel of the CUDA path for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests (TRITON_INTERPRET=1) check what the kernels compute, but the interpreter
accepts programs that the compiler rejects (shapes under tl.dot's minimum, casts, constexpr
misuse). Here the real wrappers in kvserve/kernels are called with CPU tensors laid out as the
engine lays them out (q, k and v as views of one fused projection, Llama-1B and Gemma 3 shapes,
bf16 and fp32), while Triton's driver reports an sm_90 target and every launch only compiles:
Triton's own compiler and the ptxas it ships produce each cubin, nothing runs. `ptxas -v` on each
kernel's PTX gives its registers and spilled bytes a thread: a tile configuration that spills
kilobytes shows here before it costs a GPU run.

Run as a script, in a process whose TRITON_INTERPRET is unset before Triton is imported
(tests/test_triton_compile.py does); prints one line per compiled kernel and exits 1 on the first
kernel that fails to compile."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # read when the kernels are defined: before their import
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's kvserve

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


class _CompileOnlyDriver:
    """What Triton's launcher asks of a driver before it compiles: an sm_90 target, device 0."""

    def get_current_target(self):
        return SM90

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


compiled: list[tuple[str, int, int, int, str]] = []  # kernel, cubin bytes, registers, spilled bytes a thread, arrival
_run = JITFunction.run


def _registers(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) a thread, from `ptxas -v` (the ptxas Triton compiles with)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        r = subprocess.run([get_ptxas(SM90.arch).path, f"-arch=sm_{SM90.arch}a", "-v", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True)
    info = r.stderr + r.stdout
    return int(re.search(r"Used (\d+) registers", info)[1]), int(re.search(r"(\d+) bytes spill stores", info)[1])


def _arrival(ptx: str) -> str:
    """How a kernel whose programs count their arrival (paged decode's last part merges) orders
    it, from its PTX: 'ordered' where every thread's stores precede a barrier, then the counter's
    add at GPU scope with acquire-release, then a barrier before the loads (from L2, .cg) of what
    the others stored; '' for a kernel without atomics."""
    atom = re.search(r"atom\.global\.gpu\.(\w+)\.add", ptx)
    if atom is None:
        return ""
    before, after = ptx[:atom.start()], ptx[atom.end():]
    stored_then_barrier = before.rfind("bar.sync") > before.rfind("st.global")
    first_load = after.find("ld.global")
    barrier_then_load = -1 < after.find("bar.sync") < first_load and after[first_load:].startswith("ld.global.cg")
    ok = atom[1] == "acq_rel" and stored_then_barrier and barrier_then_load
    return "ordered" if ok else "UNORDERED"


launched: list[object] = []  # every launch's compiled kernel (the same object when Triton reuses it)


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    launched.append(kernel)
    cubin = kernel.asm.get("cubin", b"")
    if not cubin:
        raise RuntimeError(f"{self.fn.__name__}: no cubin")
    ptx = kernel.asm["ptx"]
    compiled.append((self.fn.__name__, len(cubin), *_registers(ptx), _arrival(ptx)))
    return kernel


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qk_norm: bool
    offset: bool  # Gemma's (1 + w) norms
    gelu_tanh: bool
    window: int | None


SHAPES = [
    Shape("llama-1b", 2048, 32, 8, 64, 8192, qk_norm=False, offset=False, gelu_tanh=False, window=None),
    Shape("gemma3-270m", 640, 4, 1, 256, 2048, qk_norm=True, offset=True, gelu_tanh=True, window=512),
    Shape("qwen3", 1024, 16, 8, 128, 3072, qk_norm=True, offset=False, gelu_tanh=False, window=None),
]


def compile_shape(s: Shape, dtype: torch.dtype, T: int = 3, block_size: int = 16, num_blocks: int = 8) -> None:
    from kvserve.kernels import triton_attention, triton_ops

    H, KVH, D = s.heads, s.kv_heads, s.head_dim
    x = torch.randn(T, s.hidden, dtype=dtype)
    w = torch.randn(s.hidden, dtype=dtype)
    triton_ops.rms_norm(x, w, 1e-6, s.offset)
    triton_ops.residual_norm(x, x.clone(), 1e-6, s.offset, None, w)  # Llama: residual + x, then a norm
    triton_ops.residual_norm(x, x.clone(), 1e-6, s.offset, w, w)  # Gemma's sandwich, then the next norm
    triton_ops.residual_norm(x, x.clone(), 1e-6, s.offset, w, None)
    qkv = torch.randn(T, (H + 2 * KVH) * D, dtype=dtype)  # the fused projection's output
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    cos, sin = torch.randn(T, D, dtype=dtype), torch.randn(T, D, dtype=dtype)
    k_pool = torch.randn(num_blocks * block_size, KVH, D, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    slots = torch.arange(T, dtype=torch.int64)
    norm = (torch.randn(D, dtype=dtype), 1e-6, s.offset) if s.qk_norm else None
    triton_ops.qk_norm_rope(q, k, v, norm, norm, cos, sin, k_pool, v_pool, slots)
    triton_ops.norm_rope(q, norm, cos, sin)  # a layer reusing another layer's K/V
    gate_up = torch.randn(T, 2 * s.intermediate, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    triton_ops.gated_act(gate, up, s.gelu_tanh)
    q = q.contiguous()
    tables = torch.arange(num_blocks, dtype=torch.int32).view(1, -1).repeat(T, 1)
    lens = torch.full((T,), 40, dtype=torch.int32)
    starts = torch.zeros(T, dtype=torch.int32)
    triton_attention.paged_decode(q, k_pool, v_pool, tables, starts, lens, block_size, D ** -0.5, parts=4)  # merged
    triton_attention.paged_decode(q, k_pool, v_pool, tables, starts, lens, block_size, D ** -0.5, parts=1)
    triton_attention.paged_prefill(q, k_pool, v_pool, slots, 0, 0, s.window, D ** -0.5)  # a short chunk
    chunk = torch.randn(40, H, D, dtype=dtype)
    triton_attention.paged_prefill(chunk, k_pool, v_pool, torch.arange(40), 0, 0, s.window, D ** -0.5)  # two tiles
    from kvserve.kernels.triton_gemv import CONFIGS

    compile_gemv(s, dtype, CONFIGS if dtype == torch.bfloat16 else CONFIGS[:1])  # fp32: the exactness check


def compile_gemv(s: Shape, dtype: torch.dtype, configs) -> None:
    """The small-batch products of a decode step with each tiling the engine may time: q/k/v
    (one row and four), the down projection with its activation (one row and four); one with a
    bias (Qwen2's q/k/v)."""
    from kvserve.kernels import triton_gemv

    rows = triton_gemv.MAX_ROWS
    qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
    w_qkv = torch.randn(qkv_rows, s.hidden, dtype=dtype)
    w_down = torch.randn(s.hidden, s.intermediate, dtype=dtype)
    for config in configs:
        for m in (1, rows):
            triton_gemv.gemv(torch.randn(m, s.hidden, dtype=dtype), w_qkv, None, config)
            gate, up = torch.randn(m, 2 * s.intermediate, dtype=dtype).chunk(2, dim=-1)
            triton_gemv.gated_gemv(gate, up, w_down, None, s.gelu_tanh, config)
    triton_gemv.gemv(torch.randn(1, s.hidden, dtype=dtype), w_qkv, torch.randn(qkv_rows, dtype=dtype), configs[0])


def eager_launches_compile_once() -> list[str]:
    """Eager steps hand the attention kernels block tables and slots as views at any offset and of
    any width (the step's longest context): each kernel must compile once for all of them, not
    once more in the middle of a run when a view lands off a 16-byte boundary or a width is a
    multiple of 16 (or 1); likewise the K/V write's slots. Lines 'one kernel for N launches: NAME'
    or 'RECOMPILED ...'."""
    from kvserve.kernels import triton_attention, triton_ops

    H, KVH, D, bs = 32, 8, 64, 16
    dtype = torch.bfloat16
    pool = torch.randn(64 * bs, KVH, D, dtype=dtype)
    lines = []
    start = len(launched)
    for B, width, group in ((3, 37, 1), (2, 16, 0), (5, 1, 1), (4, 48, 1), (1, 5, 0)):
        tables = torch.zeros(2, B, width, dtype=torch.int32)[group]  # one group's view of [groups, B, width]
        lens = torch.full((B,), min(width * bs, 40), dtype=torch.int32)
        q = torch.randn(B, H, D, dtype=dtype)
        triton_attention.paged_decode(q, pool, pool, tables, torch.zeros_like(lens), lens, bs, 0.1, parts=4)
    lines.append(_once("_decode_part_kernel", launched[start:]))
    start = len(launched)
    all_slots = torch.arange(200)
    for first, T in ((0, 40), (1, 33), (3, 5), (16, 100)):
        q = torch.randn(T, H, D, dtype=dtype)
        triton_attention.paged_prefill(q, pool, pool, all_slots[first:first + T + 10], 10, 10, None, 0.1)
    lines.append(_once("_prefill_kernel", launched[start:]))
    start = len(launched)
    for first, T in ((0, 40), (1, 33), (3, 2)):  # the K/V write's slots: one group's of [groups, T]
        qkv = torch.randn(T, (H + 2 * KVH) * D, dtype=dtype)
        q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
        cos = torch.randn(T, D, dtype=dtype)
        triton_ops.qk_norm_rope(q, k, v, None, None, cos, cos, pool, pool, all_slots[first:first + T])
    lines.append(_once("_qk_norm_rope_kernel", launched[start:]))
    return lines


def _once(name: str, kernels: list[object]) -> str:
    distinct = len({id(k) for k in kernels})
    if distinct == 1:
        return f"one kernel for {len(kernels)} launches: {name}"
    return f"RECOMPILED {name}: {distinct} kernels for {len(kernels)} launches"


# bf16 is the speed dtype on CUDA; fp32 runs the exactness check (the bundled model and Llama-1B).
CASES = [(s, torch.bfloat16) for s in SHAPES] + [(s, torch.float32) for s in SHAPES[:2]]


def main() -> int:
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = _compile_only
    for shape, dtype in CASES:
        start = len(compiled)
        try:
            compile_shape(shape, dtype)
        except Exception as exc:  # the failing kernel's compiler message is the point
            print(f"FAILED {shape.name} {dtype}: {type(exc).__name__}: {exc}", flush=True)
            return 1
        for name, size, regs, spilled, arrival in compiled[start:]:
            print(f"{shape.name} {str(dtype).removeprefix('torch.')} {name}: cubin {size} bytes, {regs} registers, "
                  f"spills {spilled} bytes" + (f", arrival {arrival}" if arrival else ""), flush=True)
    print(f"{len(compiled)} kernels compiled in {len(CASES)} cases", flush=True)
    for line in eager_launches_compile_once():
        print(line, flush=True)
    from kvserve.kernels.triton_gemv import CONFIGS
    from kvserve.tools.bench.cuda_check import triton_compiles

    with triton_compiles() as counts:  # the GPU check's count of compiles inside a measured run
        compile_gemv(SHAPES[1], torch.float16, CONFIGS[:1])
    print(f"compiles counted: {counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
