"""Small C kernels for the CPU hot path, compiled on first use and called through ctypes.

Plain C (no torch headers) compiles in about a second with the system compiler; the shared
object is cached under ~/.cache/kvserve/kernels keyed by the source, the flags and the CPU, so
later starts just load it. Without a compiler (or with KVSERVE_NO_KERNELS=1) everything falls
back to the pure-torch path, which gives the same results; KVSERVE_REQUIRE_KERNELS=1 turns a
kernel that cannot be built into an error instead (`make test` sets it, so a missing compiler
cannot quietly skip the kernels' tests).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from kvserve.kernels.host_memory import empty_huge
from kvserve.paths import cache_root

log = logging.getLogger(__name__)

# -ffp-contract=off (also C11's default): no fused multiply-adds the source did not ask for, so
# elementwise kernels round like torch's ops (rope_cache.c is bitwise the torch path).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-math-errno", "-ffp-contract=off"]


def _cpu_signature() -> str:
    """The CPU's feature flags: -march=native code must not run on another kind of CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Libraries a source links beyond libm: gelu.c, prefill_attention.c and paged_attention.c call
# glibc's vector tanhf / expf (libmvec); where it is missing the build fails and that kernel falls
# back to torch.
_LIBS = {"gelu.c": ["-lmvec"], "prefill_attention.c": ["-lmvec"], "paged_attention.c": ["-lmvec"], "sampling.c": ["-lmvec"]}


COMPILE_TIMEOUT_S = 300  # one kernel builds in seconds; a hung compiler must not hang the engine


def _compile(src: Path, out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        try:
            proc = subprocess.run([cc, *_FLAGS, str(src), "-o", str(tmp_out), *_LIBS.get(src.name, []), "-lm"],
                                  capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{cc} did not finish {src.name} within {COMPILE_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {src.name}: {proc.stderr.strip()[:500]}")
        os.replace(tmp_out, out)  # atomic: a concurrent process never loads a half-written file


def load_source(src: Path, signatures: str | None = None) -> ctypes.CDLL:
    """The C file `src` compiled with the kernels' flags (once: cached under ~/.cache/kvserve/kernels
    keyed by the source, the headers beside it, the flags and the CPU) and loaded; with
    `signatures`, its functions typed as _SIGNATURES[signatures]'s. Raises RuntimeError or OSError
    when it cannot be built or loaded. (Also the benchmarks' way to build a kernel's other versions
    and benchmarks/peak.c.)"""
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))  # shared by some sources
    key = hashlib.sha256(src.read_bytes() + headers + " ".join(_FLAGS + _LIBS.get(src.name, [])).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    so = cache_root() / "kernels" / f"{src.stem}-{key}.so"
    if not so.exists():
        _compile(src, so)
    try:
        return _open(so, signatures)
    except (OSError, AttributeError) as e:  # a truncated or corrupt cached build: rebuild it once
        log.warning("cached kernel %s is unusable (%s): rebuilding it", so, e)
        so.unlink(missing_ok=True)
        _compile(src, so)
        return _open(so, signatures)


def _open(so: Path, signatures: str | None) -> ctypes.CDLL:
    """Load a built kernel library and type its functions (AttributeError: one is missing)."""
    lib = ctypes.CDLL(str(so))
    for name, (args, res) in (_SIGNATURES[signatures] if signatures else {}).items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def _load(name: str) -> ctypes.CDLL | None:
    """kvserve/kernels/<name>.c compiled (once, cached), loaded and typed, or None when unavailable."""
    if os.environ.get("KVSERVE_NO_KERNELS") == "1":
        return None
    try:
        return load_source(Path(__file__).with_name(f"{name}.c"), name)
    except (OSError, RuntimeError) as e:
        if os.environ.get("KVSERVE_REQUIRE_KERNELS") == "1":  # make test: a missing kernel is a failure
            raise RuntimeError(f"KVSERVE_REQUIRE_KERNELS=1 and the C kernel {name} is unavailable: {e}") from e
        log.warning("C kernels (%s) unavailable, using the torch path: %s", name, e)
        return None


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# kernels/<source>.c -> {function: (argtypes, restype)}
_SIGNATURES: dict[str, dict[str, tuple[list, object]]] = {
    "paged_attention": {"paged_decode": ([_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _I, _I, _I],
                                         ctypes.c_int)},
    "prefill_attention": {"prefill_attention_available": ([], ctypes.c_int),  # prefill chunks from the pool
                          "prefill_attention": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F, _I, _I],
                                                ctypes.c_int)},
    "lowbit_gemv": {"int8_gemv": ([_P, _P, _P, _P, _I, _I, _I, _I], None),  # a few rows, int8 / int4 weights
                    "int4_gemv": ([_P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I], ctypes.c_int),
                    "int4_dequant": ([_P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I], None)},
    "half_gemv": {"half_gemv": ([_P, _P, _I, _P, _I, _I, _I, _I], None)},  # a few rows, bf16 / fp16 weights
    "ggml_blocks": {"ggml_gemv": ([_P, _P, _I, _P, _I, _I, _I, _L, _I], ctypes.c_int),  # GGUF's quantized blocks
                    "ggml_dequant": ([_P, _I, _I, _L, _P, _I, _P, _I], ctypes.c_int)},
    "ggml_int8": {"ggml_q8_matmul": ([_P, _P, _I, _P, _I, _I, _I, _L, _I], ctypes.c_int),  # blocks x int8 rows
                  "ggml_q8_matmul_reference": ([_P, _P, _I, _P, _I, _I, _I, _L], ctypes.c_int),
                  "ggml_q8_quantize": ([_P, _I, _P, _P, _I], ctypes.c_int)},
    "rms_norm": {"rms_norm": ([_P, _P, _P, _I, _I, _F, _I], None),  # a few fp32 rows
                 "add_rms_norm": ([_P, _P, _P, _P, _P, _P, _I, _I, _F, _I], None)},
    "rope_cache": {"norm_rope_write": ([_P, _L, _P, _L, _P, _L, _I, _I, _I, _I, _P, _P, _F, _P, _P, _P, _P, _P, _P,
                                        _I, _I], None)},  # a decode step's attention prologue
    "argmax": {"argmax_rows": ([_P, _P, _I, ctypes.c_int64, _I], None)},  # greedy picks
    "sampling": {"sample_rows": ([_P, _L, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I], None),  # random picks
                 "filtered_probs": ([_P, _L, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I], None)},
    "token_mask": {"apply_token_bitmask": ([_P, _P, _P, _I, _L, _L, _I], None)},  # structured outputs
    "gelu": {"gelu_tanh_mul": ([_P, _P, _P, _I, _I, _L, _I], None),  # Gemma's MLP activation
             "silu_mul": ([_P, _P, _P, _I, _I, _L, _I], None)},  # Llama's
    "decode_step": {"decode_layers": ([_P, _P, _P, _I, _I, _P], ctypes.c_int)},  # accel/decode_plan.py
    "ssm_decode": {"ssm_decode": ([_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I], None)},  # Mamba2
    "panel_gemm": {"panel_width": ([], ctypes.c_int),  # fp32 decode-step matmuls on packed weights
                   "pack_panels": ([_P, _P, _I, _I, _L, _L, _I], None),
                   "panel_gemm": ([_P, _P, _P, _I, _I, _I, _I], None)},
    "greedy_head": {"screen_available": ([], ctypes.c_int),  # exact greedy tokens of an fp32 head
                    "screen_pack": ([_P, _I, _P, _P, _P, _P, _I, _I, _I], ctypes.c_int),
                    "screen_argmax": ([_P, _P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I], ctypes.c_int),
                    "screen_top_k": ([_P, _P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I], ctypes.c_int)},
}


def kernel_lib(source: str) -> ctypes.CDLL | None:
    """kernels/<source>.c compiled, loaded and its functions typed (see _SIGNATURES), or None;
    None also while torch.compile traces (kvserve/accel/compiled.py): the graph gets the torch
    ops each wrapper falls back to, as dynamo cannot trace a ctypes call."""
    return None if torch.compiler.is_compiling() else _typed_lib(source)


@lru_cache(maxsize=None)
def _typed_lib(source: str) -> ctypes.CDLL | None:
    return _load(source)


kernel_lib.cache_clear = _typed_lib.cache_clear  # reload after KVSERVE_NO_KERNELS changes (tests)


def kernel_address(source: str, name: str) -> int | None:
    """The address of kernels/<source>.c's function `name` (for a C caller: decode_step.c), or None."""
    lib = kernel_lib(source)
    return None if lib is None else ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


_F32 = torch.float32


def _f32_cpu(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given (None skipped) is fp32 on the CPU. (Cheap checks: this runs ~40 times a
    decode step, where a few microseconds of Python per call add up.)"""
    return all(t is None or (t.dtype is _F32 and t.is_cpu) for t in tensors)


# The KV pool's element types the fp32 CPU kernels read and write (kernels/kv_row.h)
_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def kv_type_code(dtype: torch.dtype) -> int | None:
    """kv_row.h's code for a pool dtype, None for one the kernels do not take."""
    return _KV_TYPES.get(dtype)


def _kv_pools_cpu(k_pool: torch.Tensor, v_pool: torch.Tensor) -> int | None:
    """The kv_row.h code of two contiguous CPU pools of one kernel-readable dtype, else None."""
    if not (k_pool.is_cpu and k_pool.dtype == v_pool.dtype and k_pool.is_contiguous() and v_pool.is_contiguous()):
        return None
    return kv_type_code(k_pool.dtype)


def paged_attention_lib() -> ctypes.CDLL | None:
    return kernel_lib("paged_attention")


def lowbit_lib() -> ctypes.CDLL | None:
    return kernel_lib("lowbit_gemv")


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., d] fp32 (CPU) normalized over d, times gain [d] fp32; None when the kernel is
    unavailable or does not apply (another dtype or device)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or gain.dtype != torch.float32:
        return None
    lib = kernel_lib("rms_norm")
    if lib is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    d = x.shape[-1]
    lib.rms_norm(x.data_ptr(), gain.data_ptr(), y.data_ptr(), x.numel() // d, d, eps, torch.get_num_threads())
    return y


def add_rms_norm(x: torch.Tensor, gain: torch.Tensor, residual: torch.Tensor, eps: float,
                 gain2: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """residual + rms_norm(x) * gain for fp32 CPU rows [..., d] of the same shape (one rounding of
    the sum, as torch's add); with gain2 also rms_norm(that sum) * gain2, returned as a pair.
    None when the kernel is unavailable or does not apply."""
    if not (_f32_cpu(x, gain, residual, gain2) and residual.shape == x.shape):
        return None
    lib = kernel_lib("rms_norm")
    if lib is None:
        return None
    x, residual = x.contiguous(), residual.contiguous()
    y = torch.empty_like(x)
    y2 = None if gain2 is None else torch.empty_like(x)
    d = x.shape[-1]
    lib.add_rms_norm(x.data_ptr(), gain.data_ptr(), residual.data_ptr(), y.data_ptr(),
                     None if gain2 is None else gain2.data_ptr(), None if y2 is None else y2.data_ptr(),
                     x.numel() // d, d, eps, torch.get_num_threads())
    return y if y2 is None else (y, y2)


def _row_stride(x: torch.Tensor) -> int | None:
    """Floats between token rows of x [T, heads, D] whose heads are packed within a row; None
    when the layout is not that."""
    T, heads, D = x.shape
    if x.stride(2) != 1 or (heads > 1 and x.stride(1) != D):
        return None
    return x.stride(0) if T > 1 else heads * D


def norm_rope_write(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    q_gain: torch.Tensor | None, k_gain: torch.Tensor | None, eps: float,
                    cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor | None,
                    k_pool: torch.Tensor | None, v_pool: torch.Tensor | None) -> torch.Tensor | None:
    """The attention prologue in one C call (kvserve/kernels/rope_cache.c): q [T, H, D] and k, v
    [T, KVH, D] fp32 -> q normed (when q_gain) and rotated [T, H, D]; k normed (when k_gain),
    rotated and written with v into k_pool, v_pool [slots, KVH, D] at `slots` [T] int64. k None:
    rotate q only. cos, sin [T, D]. The pools may hold fp32, bf16 or fp16 (rounded as `.to()`
    rounds). None where it does not apply (the caller runs the torch ops)."""
    if not (_f32_cpu(q, cos, sin, q_gain, k_gain) and cos.is_contiguous() and sin.is_contiguous()) or q.shape[2] % 2:
        return None
    if any(g is not None and not g.is_contiguous() for g in (q_gain, k_gain)):
        return None
    T, H, D = q.shape
    q_stride, k_stride, v_stride, kvh, kv_type = _row_stride(q), 0, 0, 0, 0
    if k is not None:
        kv_type = _kv_pools_cpu(k_pool, v_pool)
        if not (_f32_cpu(k, v) and kv_type is not None and slots.dtype is torch.int64 and slots.is_contiguous()
                and k_pool.shape[1:] == k.shape[1:] and v_pool.shape[1:] == v.shape[1:] == k.shape[1:]):
            return None
        k_stride, v_stride, kvh = _row_stride(k), _row_stride(v), k.shape[1]
    if q_stride is None or k_stride is None or v_stride is None:
        return None
    lib = kernel_lib("rope_cache")
    if lib is None:
        return None
    out = torch.empty(T, H, D)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    lib.norm_rope_write(q.data_ptr(), q_stride, ptr(k), k_stride, ptr(v), v_stride, T, H, kvh, D, ptr(q_gain),
                        ptr(k_gain), eps, cos.data_ptr(), sin.data_ptr(), ptr(slots), ptr(k_pool), ptr(v_pool),
                        out.data_ptr(), torch.get_num_threads(), kv_type)
    return out


def _ggml_matmul(source: str, fn: str, x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n: int,
                 *tail: int) -> torch.Tensor | None:
    """y [M, N] fp32 = x [M, K] fp32 @ W^T through `source`'s `fn` (x, w, type, y, M, N, K, row
    bytes, *tail); None when the kernel is unavailable or refuses (rc != 0)."""
    lib = kernel_lib(source)
    if lib is None or not _f32_cpu(x) or not raw.is_contiguous():
        return None
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    rc = getattr(lib, fn)(x.data_ptr(), raw.data_ptr(), ggml_type, y.data_ptr(), m, n, k, raw.shape[1], *tail)
    return y if rc == 0 else None


def ggml_gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n: int) -> torch.Tensor | None:
    """y [M, N] fp32 = x [M, K] fp32 @ W^T for W held as GGUF blocks (`raw` uint8 [N, row bytes],
    kvserve/weights/ggml.py), M <= 64; None when the kernel is unavailable or does not take
    this type."""
    return _ggml_matmul("ggml_blocks", "ggml_gemv", x, raw, ggml_type, n, torch.get_num_threads())


def ggml_q8_matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, n: int, reference: bool = False
                   ) -> torch.Tensor | None:
    """y [M, N] fp32 = x [M, K] fp32 @ W^T for W held as GGUF blocks, x quantized to int8 per 32
    values (kvserve/kernels/ggml_int8.c; any M); None when the kernel is unavailable or has no
    int8 path for this type. `reference`: the plain C loops, whatever this CPU has."""
    if reference:
        return _ggml_matmul("ggml_int8", "ggml_q8_matmul_reference", x, raw, ggml_type, n)
    return _ggml_matmul("ggml_int8", "ggml_q8_matmul", x, raw, ggml_type, n, torch.get_num_threads())


def ggml_q8_quantize(x: torch.Tensor, vector: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A row x [K] fp32 quantized as ggml_q8_matmul quantizes it: (codes int8 [K], floats [3 K / 16]:
    dx per 32 values, dx * sum per 32, dx per 16, dx * sum per 16); `vector` False: the plain C
    loop. None when the kernel is unavailable or K is not whole blocks of 32."""
    lib = kernel_lib("ggml_int8")
    if lib is None or not _f32_cpu(x) or x.dim() != 1:
        return None
    x = x.contiguous()
    k = x.numel()
    codes, floats = torch.empty(k, dtype=torch.int8), torch.empty(3 * k // 16, dtype=torch.float32)
    rc = lib.ggml_q8_quantize(x.data_ptr(), k, codes.data_ptr(), floats.data_ptr(), int(vector))
    return (codes, floats) if rc == 0 else None


def ggml_dequant(raw: torch.Tensor, ggml_type: int, k: int, rows: torch.Tensor) -> torch.Tensor | None:
    """Rows `rows` (int64 [n]) of W held as GGUF blocks, dequantized to fp32 [n, K] exactly as
    ggml computes them; None when the kernel is unavailable or does not take this type."""
    lib = kernel_lib("ggml_blocks")
    if lib is None or not raw.is_contiguous():
        return None
    ids = rows.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    rc = lib.ggml_dequant(raw.data_ptr(), ggml_type, k, raw.shape[1], ids.data_ptr(), ids.numel(), out.data_ptr(),
                          torch.get_num_threads())
    return out if rc == 0 else None


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """y [M, N] fp32 = x [M, K] fp32 @ (scale[:, None] * qweight)^T with the C kernel for a few
    rows (each row computed as it would be alone); None when it is unavailable. qweight int8
    [N, K] (a symmetric grid), scale [N] fp32."""
    lib = lowbit_lib()
    if lib is None:
        return None
    x = x.contiguous()
    (m, k), n = x.shape, qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.int8_gemv(x.data_ptr(), qweight.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def half_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """y [M, N] fp32 = x [M, K] fp32 @ weight^T for weight bf16 or fp16 [N, K], widened to fp32 in
    registers, with the C kernel for a few rows (each row computed as it would be alone); None
    when it is unavailable or does not apply (another dtype or device, a non-contiguous weight)."""
    if not (_f32_cpu(x) and weight.is_cpu and weight.dtype in (torch.bfloat16, torch.float16)
            and weight.is_contiguous() and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]):
        return None
    lib = kernel_lib("half_gemv")
    if lib is None:
        return None
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.half_gemv(x.data_ptr(), weight.data_ptr(), int(weight.dtype == torch.bfloat16), y.data_ptr(), m, n, k,
                  torch.get_num_threads())
    return y


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
              block_n: int) -> torch.Tensor | None:
    """y [M, N] fp32 = x [M, K] fp32 @ W^T for W held in `_weight_int4pack_mm_for_cpu`'s layout
    (qweight uint8 [N, K/2] in tiles of block_n rows, kvserve/weights/packing.py; scales_and_zeros
    [K/g, N, 2] bf16 or fp32: W = (u - 8) s + z), with the C kernel for a few rows (each computed
    as it would be alone); None when it is unavailable or does not take this tile height."""
    lib = lowbit_lib()
    if lib is None or scales_and_zeros.dtype not in (torch.bfloat16, torch.float32):
        return None
    x, sz = x.contiguous(), scales_and_zeros.contiguous()
    (m, k), n = x.shape, qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.int4_gemv(x.data_ptr(), qweight.data_ptr(), sz.data_ptr(), int(sz.dtype == torch.bfloat16),
                       y.data_ptr(), m, n, k, group_size, block_n, torch.get_num_threads())
    return y if rc == 0 else None


def int4_dequant(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, block_n: int,
                 n0: int, n1: int) -> torch.Tensor | None:
    """Rows [n0, n1) of W = (u - 8) s + z [N, K] fp32 from the int4 layout (as `int4_gemv`), the
    same two roundings as torch's `(u - 8) * s + z`; n0 a multiple of block_n, n1 one too or N.
    None when the kernel is unavailable."""
    lib = lowbit_lib()
    if lib is None or scales_and_zeros.dtype not in (torch.bfloat16, torch.float32):
        return None
    sz = scales_and_zeros.contiguous()
    n, k = qweight.shape[0], qweight.shape[1] * 2
    out = torch.empty(n1 - n0, k, dtype=torch.float32)
    lib.int4_dequant(qweight.data_ptr(), sz.data_ptr(), int(sz.dtype == torch.bfloat16), out.data_ptr(), n, k,
                     group_size, block_n, n0, n1, torch.get_num_threads())
    return out


def _gated_act(fn: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """act(gate) * up through kernels/gelu.c's `fn` for fp32 CPU [..., n] views whose rows share
    one stride (a fused gate_up output's halves, or two contiguous tensors of one shape) ->
    [..., n] contiguous; None when the kernel does not apply."""
    if not (_f32_cpu(gate, up) and gate.shape == up.shape and gate.dim() >= 1 and gate.stride(-1) == 1
            and up.stride(-1) == 1):
        return None
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)  # views when the rows are evenly strided
    stride = g2.stride(0) if g2.shape[0] > 1 else n
    if g2.shape[0] > 1 and u2.stride(0) != stride:
        return None
    lib = kernel_lib("gelu")
    if lib is None:
        return None
    out = torch.empty(gate.shape, dtype=torch.float32)
    getattr(lib, fn)(g2.data_ptr(), u2.data_ptr(), out.data_ptr(), g2.shape[0], n, stride, torch.get_num_threads())
    return out


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up (Gemma's MLP), see `_gated_act`."""
    return _gated_act("gelu_tanh_mul", gate, up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up (Llama's MLP), see `_gated_act`."""
    return _gated_act("silu_mul", gate, up)


def ssm_decode(pool: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
               A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor) -> torch.Tensor | None:
    """One decode token of Mamba2's SSM (kernels/ssm_decode.c): pool [slots, H, P, N] updated in
    place at `slots` [Bn] (from zeros where has_state [Bn] is False), x [Bn, H, P], dt [Bn, H]
    (after softplus), A, D [H], B and C [Bn, H, N] -> y [Bn, H, P] (without the gate); all fp32 on
    the CPU. None where the kernel does not apply (then nothing was written)."""
    if not _f32_cpu(pool, x, dt, A, B, C, D) or not pool.is_contiguous() or pool.dim() != 4:
        return None
    lib = kernel_lib("ssm_decode")
    if lib is None:
        return None
    n_seq, H, P = x.shape
    N = pool.shape[3]
    if pool.shape[1:] != (H, P, N) or B.shape != (n_seq, H, N) or C.shape != (n_seq, H, N):
        return None
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    slots = slots.to(torch.int64).contiguous()
    has = has_state.to(torch.uint8).contiguous()
    y = torch.empty_like(x)
    lib.ssm_decode(pool.data_ptr(), slots.data_ptr(), has.data_ptr(), x.data_ptr(), dt.data_ptr(), A.data_ptr(),
                   B.data_ptr(), C.data_ptr(), D.data_ptr(), y.data_ptr(), n_seq, H, P, N, torch.get_num_threads())
    return y


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [M, N] fp32 (CPU) -> [M] int64: each row's first index of its maximum (a NaN counts as
    the maximum), what torch's max(dim=-1).indices gives; None when the kernel does not apply."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return None
    lib = kernel_lib("argmax")
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def _sampling_args(logits: torch.Tensor, rows: list[int], temperature: list[float], top_k: list[int],
                   top_p: list[float], min_p: list[float]) -> tuple | None:
    """sampling.c's row arguments (kept alive by the caller), or None when the kernels do not apply."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    if not rows or kernel_lib("sampling") is None:
        return None
    return (torch.tensor(rows, dtype=torch.int64), torch.tensor(temperature, dtype=torch.float32),
            torch.tensor(top_k, dtype=torch.int32), torch.tensor(top_p, dtype=torch.float32),
            torch.tensor(min_p, dtype=torch.float32))


def sample_rows(logits: torch.Tensor, rows: list[int], temperature: list[float], top_k: list[int],
                top_p: list[float], min_p: list[float], u: torch.Tensor) -> torch.Tensor | None:
    """One token for each row `rows[r]` of logits [N, V] fp32 (CPU, unit stride along V) drawn with
    the uniform number u[r] (float64) under temperature[r] > 0, top_k[r] (0: off), top_p[r] and
    min_p[r]: the token of sampler.py's torch path (filter_logits, then the inverse-CDF draw) for
    that draw (kernels/sampling.c). -> [len(rows)] int64, -1 for a row holding a NaN or no finite
    logit; None when the kernel does not apply."""
    args = _sampling_args(logits, rows, temperature, top_k, top_p, min_p)
    if args is None:
        return None
    out = torch.empty(len(rows), dtype=torch.int64)
    u = u.to(torch.float64).contiguous()
    kernel_lib("sampling").sample_rows(logits.data_ptr(), logits.stride(0), args[0].data_ptr(), len(rows),
                                       logits.shape[1], *(a.data_ptr() for a in args[1:]), u.data_ptr(),
                                       out.data_ptr(), torch.get_num_threads())
    return out


def filtered_probs(logits: torch.Tensor, rows: list[int], temperature: list[float], top_k: list[int],
                   top_p: list[float], min_p: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The distributions `sample_rows` draws from: softmax(filter_logits(...)) of each row `rows[r]`
    -> (probs [len(rows), V] fp32, failed [len(rows)] bool: rows holding a NaN or no finite
    logit, left unwritten); None when the kernel does not apply."""
    args = _sampling_args(logits, rows, temperature, top_k, top_p, min_p)
    if args is None:
        return None
    probs = torch.empty(len(rows), logits.shape[1], dtype=torch.float32)
    failed = torch.empty(len(rows), dtype=torch.int64)
    kernel_lib("sampling").filtered_probs(logits.data_ptr(), logits.stride(0), args[0].data_ptr(), len(rows),
                                          logits.shape[1], *(a.data_ptr() for a in args[1:]), probs.data_ptr(),
                                          failed.data_ptr(), torch.get_num_threads())
    return probs, failed.bool()


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """x[r, v] = -inf, in place, for each r in `rows` and each token v whose bit is 0 in
    bitmask [M, ceil(V / 32)] int32 (xgrammar's layout: bit v % 32 of word v // 32). x [M, V]."""
    if not rows:
        return
    lib = kernel_lib("token_mask")
    if lib is not None and _f32_cpu(x) and x.is_contiguous() and bitmask.is_contiguous():
        idx = torch.tensor(rows, dtype=torch.int64)
        lib.apply_token_bitmask(x.data_ptr(), bitmask.data_ptr(), idx.data_ptr(), len(idx), x.shape[1],
                                bitmask.shape[1], torch.get_num_threads())
        return
    idx = torch.tensor(rows, device=x.device)
    bits = torch.arange(32, dtype=torch.int32, device=x.device)
    words = bitmask.to(x.device)[idx]
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().view(len(rows), -1)[:, :x.shape[1]]
    x[idx] = x[idx].masked_fill(~allowed, float("-inf"))


def _panel_lib() -> tuple[ctypes.CDLL, int] | None:
    lib = kernel_lib("panel_gemm")
    width = lib.panel_width() if lib is not None else 0
    return (lib, width) if width else None  # 0: built without AVX-512 or AVX2 + FMA


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] fp32 (CPU) -> its copy packed for `panel_matmul`: [ceil(N / W), K, W] with W
    output columns per panel (32 with AVX-512, 16 with AVX2), the last panel zero-padded; None
    when the kernel is unavailable."""
    found = _panel_lib()
    if found is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    lib, width = found
    w = weight.detach()  # (any strides: the loader keeps weights column-major for PyTorch's matmuls)
    n, k = w.shape
    packed = empty_huge(-(-n // width), k, width)  # streamed from memory every step: 2 MB pages
    lib.pack_panels(w.data_ptr(), packed.data_ptr(), n, k, w.stride(0), w.stride(1), torch.get_num_threads())
    return packed


def panel_matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] fp32 (CPU) @ the packed [N, K] weight^T -> [M, N] (kvserve/kernels/panel_gemm.c).
    Every output is the same FMA chain over K whatever M: a row's result does not depend on the
    batch it is in."""
    found = _panel_lib()
    assert found is not None and packed.shape[0] * packed.shape[2] >= n, "pack_panels first"
    lib, _ = found
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    lib.panel_gemm(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


@dataclass(frozen=True)
class HeadScreen:
    """An fp32 head [V, K]'s int8 copy for `screen_argmax` (kvserve/kernels/greedy_head.c):
    q [ceil(V / 16) * Kp * 16] int8 (Kp = K rounded up to even), and per token its scale and the
    two error-bound coefficients, [V] float64 each."""
    q: torch.Tensor
    scale: torch.Tensor
    c1: torch.Tensor
    c2: torch.Tensor


def _screen_lib() -> ctypes.CDLL | None:
    lib = kernel_lib("greedy_head")
    return lib if lib is not None and lib.screen_available() else None  # 0: built without AVX2 + FMA


def pack_head_screen(packed: torch.Tensor, n: int) -> HeadScreen | None:
    """The head [n, K] packed by `pack_panels` (finite) -> its int8 copy for `screen_argmax`; None
    when the kernel is unavailable or the head has a non-finite value."""
    lib = _screen_lib()
    if lib is None or packed.device.type != "cpu" or packed.dtype != torch.float32 or packed.dim() != 3:
        return None
    k = packed.shape[1]
    kp = k + (k & 1)
    screen = HeadScreen(q=empty_huge(-(-n // 16) * kp * 16, dtype=torch.int8),
                        scale=torch.empty(n, dtype=torch.float64), c1=torch.empty(n, dtype=torch.float64),
                        c2=torch.empty(n, dtype=torch.float64))
    bad = lib.screen_pack(packed.data_ptr(), packed.shape[2], screen.q.data_ptr(), screen.scale.data_ptr(),
                          screen.c1.data_ptr(), screen.c2.data_ptr(), n, k, torch.get_num_threads())
    return None if bad else screen  # (a non-finite weight, found while packing)


SCREEN_CAP = 4096  # candidates a row may keep per thread before the caller computes it in full


def screen_argmax(x: torch.Tensor, packed: torch.Tensor, n: int, screen: HeadScreen,
                  allowed: torch.Tensor | None = None, cap: int = SCREEN_CAP) -> torch.Tensor:
    """x [M, K] fp32 (CPU) -> [M] int64: each row's first index of the maximum of
    panel_matmul(x, packed, n) (packed: the head [n, K] from pack_panels, the screen from
    pack_head_screen of it), found through the screen; -1 for a row it did not settle.
    allowed: [M, ceil(n / 32)] int32 in `apply_token_bitmask`'s layout, each row's maximum then
    taken over its allowed tokens only (the logits with `apply_token_bitmask` applied); a row
    allowing none is left at -1."""
    lib = _screen_lib()
    assert lib is not None and screen.scale.shape[0] == n, "pack_head_screen first"
    x = x.contiguous()
    m, k = x.shape
    words = -(-n // 32)
    if allowed is not None:
        if allowed.dtype != torch.int32 or allowed.device.type != "cpu" or tuple(allowed.shape) != (m, words):
            raise ValueError(f"allowed must be a [{m}, {words}] int32 CPU bitmask, got "
                             f"{tuple(allowed.shape)} {allowed.dtype} on {allowed.device}")
        allowed = allowed.contiguous()
    tokens = torch.empty(m, dtype=torch.int64)
    lib.screen_argmax(x.data_ptr(), packed.data_ptr(), packed.shape[2], screen.q.data_ptr(), screen.scale.data_ptr(),
                      screen.c1.data_ptr(), screen.c2.data_ptr(), None if allowed is None else allowed.data_ptr(),
                      words, tokens.data_ptr(), m, n, k, cap, torch.get_num_threads())
    return tokens


SCREEN_MAX_TOP_K = 128  # the largest top-k the screen keeps a heap of lower bounds for
# Top-k rows a step takes through the screen at most: each keeps ~500-600 survivors at k = 40-50
# (a strided walk of the packed head each), so from ~14 rows the full head costs less (Intel Xeon:
# 3.1x the full head's speed at 1 row, 1.6x at 8, 0.9x at 16).
SCREEN_TOP_K_MAX_ROWS = 8
# Tokens a step's rows may ask the screen for besides their top-k (those their penalties change):
# each is an exact logit, a strided walk of the packed head (Intel Xeon, Gemma: +4.5 ms for 2,048 at
# one row, a screen of 11 ms against the full head's 23; at 8 rows and k = 40, 23 against 32).
SCREEN_MAX_TOUCHED = 2048


def screen_top_k(x: torch.Tensor, packed: torch.Tensor, n: int, screen: HeadScreen, top_k: list[int],
                 touched: list[list[int]] | None = None, cap: int = SCREEN_CAP) -> tuple[torch.Tensor, list[int]]:
    """x [M, K] fp32 (CPU), top_k [M] (1 <= k <= SCREEN_MAX_TOP_K) -> (logits [M, n] fp32, rows the
    screen did not settle). A settled row holds, bitwise, panel_matmul(x, packed, n)'s logits of
    a superset of its top_k largest tokens (every token tied with the k-th, and any token within
    2^-20 of it) and -inf elsewhere, so temperature, top-k, top-p and min-p applied to it cut and
    draw as on the full row; an unsettled row is left uninitialised for the caller to compute.
    touched [M]: each row's tokens that its penalties or logit biases will change (distinct, in
    [0, n)): they get their logits too, and the superset covers the top_k of the row after any
    change to them."""
    lib = _screen_lib()
    assert lib is not None and screen.scale.shape[0] == n, "pack_head_screen first"
    x = x.contiguous()
    m, k = x.shape
    if len(top_k) != m or not all(1 <= t <= min(n, SCREEN_MAX_TOP_K) for t in top_k):
        raise ValueError(f"top_k must hold {m} values in [1, {min(n, SCREEN_MAX_TOP_K)}], got {top_k}")
    ks = torch.tensor(top_k, dtype=torch.int32)
    off = ids = None
    if touched is not None:
        if len(touched) != m:
            raise ValueError(f"touched must hold {m} rows of token ids, got {len(touched)}")
        ids = torch.tensor([t for row in touched for t in row], dtype=torch.int32)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < n):
            raise ValueError(f"touched token ids must lie in [0, {n}), got {int(ids.min())}..{int(ids.max())}")
        if any(len(set(row)) != len(row) for row in touched):
            raise ValueError("touched token ids must be distinct within a row")
        off = torch.tensor([0] + [len(row) for row in touched], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.empty(m, n, dtype=torch.float32)
    done = torch.empty(m, dtype=torch.int32)
    lib.screen_top_k(x.data_ptr(), packed.data_ptr(), packed.shape[2], screen.q.data_ptr(), screen.scale.data_ptr(),
                     screen.c1.data_ptr(), screen.c2.data_ptr(), ks.data_ptr(),
                     None if off is None else off.data_ptr(), None if ids is None else ids.data_ptr(),
                     out.data_ptr(), done.data_ptr(), m, n, k, cap, torch.get_num_threads())
    return out, (done == 0).nonzero().flatten().tolist()


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                      first_kv: int, first_q: int, window: int | None, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
    """One sequence's chunk of queries against its context in the paged pool, with the C kernel
    (kernels/prefill_attention.c); None where it does not apply (no kernel, not fp32 on the CPU,
    head_dim not a multiple of 16) and the caller uses SDPA. The pool may hold fp32, bf16 or fp16.

    q [T, H, D], query t at position first_q + t; k_pool, v_pool [slots, KVH, D]; slots [n] int64,
    slots[j] holding position first_kv + j. Query position x attends p in [first_kv, x], and
    p > x - window with a window. out: a contiguous [T, H, D] to write into. -> [T, H, D].
    """
    if q.is_cuda:
        return _triton_prefill(q, k_pool, v_pool, slots, first_kv, first_q, window, scale, out)
    kv_type = _kv_pools_cpu(k_pool, v_pool)
    if not _f32_cpu(q) or kv_type is None or q.shape[-1] % 16 or q.shape[1] % k_pool.shape[1]:
        return None
    if slots.dtype != torch.int64:
        return None
    if out is not None and not (out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype):
        return None
    lib = kernel_lib("prefill_attention")
    if lib is None or not lib.prefill_attention_available():
        return None
    q, slots = q.contiguous(), slots.contiguous()
    T, H, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    rc = lib.prefill_attention(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), out.data_ptr(),
                               T, H, k_pool.shape[1], D, slots.shape[0], first_kv, first_q, window or 0, scale,
                               torch.get_num_threads(), kv_type)
    if rc == -1:
        raise MemoryError("prefill attention kernel could not allocate its scratch memory")
    return out if rc == 0 else None


def paged_decode_attention(q, k_pool, v_pool, tables, starts, lens, block_size: int, scale: float,
                           max_len: int):
    """Decode attention from the paged pool with the C kernel; None where it does not apply
    (no kernel, not CPU, q other than fp32 / bf16 or a pool the kernel does not read), and the
    caller uses the torch path. fp32 q reads fp32, bf16 or fp16 pools; bf16 q a bf16 pool.

    q [B, H, D]; k_pool, v_pool [slots, KVH, D]; tables [B, max_blocks] int32; starts, lens [B]
    int32 (sequence b attends positions [starts[b], lens[b])); max_len = max(lens). -> [B, H, D].
    Table entries of blocks wholly before starts[b] are never read (a sliding-window layer group
    marks released blocks -1 there).
    """
    if q.is_cuda:
        return _triton_decode(q, k_pool, v_pool, tables, starts, lens, block_size, scale, max_len)
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return None  # checked first: a CUDA run never compiles the CPU kernel
    kv_type = _kv_pools_cpu(k_pool, v_pool)
    if kv_type is None or (q.dtype == torch.bfloat16 and k_pool.dtype != q.dtype):
        return None
    lib = paged_attention_lib()
    if lib is None:
        return None
    q = q.contiguous()
    B, H, D = q.shape
    kvh = k_pool.shape[1]
    threads = torch.get_num_threads()
    # Few sequences: cut each context into ranges so every thread has work (>= 64 positions each;
    # 128 left a batch-1 context under 256 on one thread).
    if max_len is None:  # (a batch built for a CUDA graph, run eagerly)
        max_len = int(lens.max())
    splits = max(1, min(-(-4 * threads // (B * kvh)), -(-max_len // 64)))
    out = torch.empty_like(q)
    rc = lib.paged_decode(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), starts.data_ptr(),
                          lens.data_ptr(), out.data_ptr(), B, H, kvh, D, block_size, tables.shape[1], splits, scale,
                          threads, int(q.dtype == torch.bfloat16), kv_type)
    if rc != 0:
        raise MemoryError("paged attention kernel could not allocate its scratch memory")
    return out


# ---------------------------------------------------------------- CUDA (Triton)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _triton_fits(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """The Triton kernels' shapes: float pools of one head width for K and V (not MLA's latent),
    query heads a multiple of the KV heads, head_dim up to 256, unit stride along head_dim."""
    D = q.shape[-1]
    return (k_pool.is_cuda and q.dtype in _FLOATS and k_pool.dtype in _FLOATS and v_pool.dtype in _FLOATS
            and k_pool.shape[-1] == v_pool.shape[-1] == D <= 256 and q.shape[1] % k_pool.shape[1] == 0
            and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and q.stride(-1) == 1)


def _triton_decode(q, k_pool, v_pool, tables, starts, lens, block_size: int, scale: float,
                   max_len: int | None) -> torch.Tensor | None:
    if not _triton_fits(q, k_pool, v_pool):
        return None
    from kvserve.kernels import (
        triton_attention,  # Triton comes with CUDA builds of torch only
    )

    return triton_attention.paged_decode(q, k_pool, v_pool, tables, starts, lens, block_size, scale, max_len)


def _triton_prefill(q, k_pool, v_pool, slots, first_kv: int, first_q: int, window: int | None, scale: float,
                    out: torch.Tensor | None) -> torch.Tensor | None:
    if not _triton_fits(q, k_pool, v_pool) or (out is not None and out.stride(-1) != 1):
        return None
    from kvserve.kernels import (
        triton_attention,  # Triton comes with CUDA builds of torch only
    )

    return triton_attention.paged_prefill(q, k_pool, v_pool, slots, first_kv, first_q, window, scale, out=out)


def _cuda_float(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given (None skipped) is a float CUDA tensor, and no gradient is being recorded
    (the Triton ops have no backward)."""
    return not torch.is_grad_enabled() and all(t is None or (t.is_cuda and t.dtype in _FLOATS) for t in tensors)


def norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor | None:
    """CUDA: RMSNorm of x [..., d] as the model's RMSNorm computes it (kernels/triton_ops.py);
    None elsewhere."""
    if not _cuda_float(x, weight):
        return None
    from kvserve.kernels import (
        triton_ops,  # Triton comes with CUDA builds of torch only
    )

    return triton_ops.rms_norm(x, weight, eps, offset)


def residual_norm_rows(x: torch.Tensor, residual: torch.Tensor, eps: float, offset: bool,
                       w1: torch.Tensor | None, w2: torch.Tensor | None):
    """CUDA: h = residual + (x, or its norm with w1), and with w2 also the norm of h -> h or
    (h, norm(h)); None elsewhere or for shapes that differ."""
    if not (_cuda_float(x, residual, w1, w2) and x.shape == residual.shape):
        return None
    from kvserve.kernels import (
        triton_ops,  # Triton comes with CUDA builds of torch only
    )

    return triton_ops.residual_norm(x, residual, eps, offset, w1, w2)


def norm_rope_write_rows(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, q_norm, k_norm,
                         cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                         k_pool: torch.Tensor | None, v_pool: torch.Tensor | None) -> torch.Tensor | None:
    """CUDA: the attention prologue in one launch: q [T, H, D] normed (q_norm = (weight, eps,
    offset) or None) and rotated -> [T, H, D]; k [T, KVH, D] likewise, written with v into the
    pools at `slots` (k None: a layer reusing another's K/V). None elsewhere."""
    if not _cuda_float(q, k, v, cos, sin, k_pool, v_pool) or q.stride(-1) != 1:
        return None
    if k is not None and not (k.stride(-1) == 1 and v.stride(-1) == 1 and k_pool.dtype == q.dtype
                              and k_pool.is_contiguous() and v_pool.is_contiguous()):
        return None
    from kvserve.kernels import (
        triton_ops,  # Triton comes with CUDA builds of torch only
    )

    cos, sin = cos.contiguous(), sin.contiguous()
    if k is None:
        return triton_ops.norm_rope(q, q_norm, cos, sin)
    if (q_norm is None) != (k_norm is None) or (q_norm is not None and q_norm[2] != k_norm[2]):
        return None  # one launch takes one norm style for both (every model here has)
    return triton_ops.qk_norm_rope(q, k, v, q_norm, k_norm, cos, sin, k_pool, v_pool, slots)


def gated_act_rows(gate: torch.Tensor, up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor | None:
    """CUDA: silu(gate) * up, or gelu_tanh(gate) * up, rounded as the PyTorch ops round; None
    elsewhere."""
    if not (_cuda_float(gate, up) and gate.shape == up.shape and gate.stride(-1) == 1 and up.stride(-1) == 1):
        return None
    from kvserve.kernels import (
        triton_ops,  # Triton comes with CUDA builds of torch only
    )

    return triton_ops.gated_act(gate, up, gelu_tanh)
