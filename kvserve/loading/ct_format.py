"""The compressed-tensors checkpoint layout (llm-compressor, GPTQModel, vLLM), read and written
without the `compressed-tensors` package: int32 bit packing, the `quantization_config` schemes,
target / ignore matching, and one layer's tensors <-> kvserve's canonical QuantizedWeight.

What compressed-tensors 0.20's compressors store for a quantized module `P` (weight [N, K], b bits):

  "pack-quantized" (1 <= b <= 8):
    P.weight_packed      int32 [N, ceil(K b / 32)]: the codes as unsigned q + 2^(b-1) (q the signed
                         code in [-2^(b-1), 2^(b-1) - 1]), densely packed: code i of a row occupies
                         bits [i b, (i + 1) b) of the row's bit stream, lowest bits first, so a code
                         straddles two words when b does not divide 32 (3, 5, 6, 7 bits).
    P.weight_scale       [1] (strategy "tensor"), [N, 1] ("channel"), [N, K / group_size] ("group"),
                         in a float dtype (the model's, as calibrated).
    P.weight_zero_point  asymmetric grids only. "channel" / "group": int32 [ceil(N b / 32), G], the
                         signed zero points + 2^(b-1) packed the same way along the OUTPUT dimension;
                         "tensor": int8 [1], the signed zero point itself.
    P.weight_shape       int64 [2] = [N, K].
  "int-quantized" / "naive-quantized": P.weight int8 [N, K] (signed codes), P.weight_scale as above,
    P.weight_zero_point int8 shaped like the scale (asymmetric only).
  Legacy (compressed-tensors <= 0.1x, `actorder: "group"`): P.weight_g_idx int32 [K], the scale group
    of each input column. compressed-tensors 0.20 no longer parses that config ("removed").

The weight is scale * (q - zero) group by group. kvserve's canonical form (kvserve/weights/spec.py)
keeps symmetric codes signed and asymmetric codes / zeros unsigned (q + 2^(b-1)), so both are
scale * (codes - zero) term by term.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvserve.loading.errors import ModelLoadError
from kvserve.weights.spec import MAX_BITS, MIN_BITS, QuantizedWeight, QuantSpec

QUANT_METHOD = "compressed-tensors"
PACKED = "pack-quantized"
INT_FORMATS = ("int-quantized", "naive-quantized")  # one int8 per code, same tensors otherwise
FORMATS = (PACKED, *INT_FORMATS)
MIXED = "mixed-precision"  # the top-level format when groups name their own
LAYOUT_VERSION = "0.20.1"  # the compressed-tensors release whose layout save_quantized writes
_PACK_CHUNK = 1 << 22  # codes packed / unpacked at a time (bounds the int64 scratch to 32 MiB)

# Top-level quantization_config fields: read, ignored as informational, or refused unless empty.
_TOP_FIELDS = {"config_groups", "quant_method", "format", "quantization_status", "ignore", "version",
               "global_compression_ratio", "kv_cache_scheme", "sparsity_config", "transform_config",
               "moe_sparsity_config"}
_MUST_BE_EMPTY = ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config")
_GROUP_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}
_WEIGHT_FIELDS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                  "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
_STRATEGIES = ("tensor", "channel", "group")
_LEGACY_ACTORDER = ("group", "dynamic", True)  # a per-layer g_idx; "weight"/"static" change calibration only


# --- dense int32 bit packing ---------------------------------------------------------------------

def pack_to_int32(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Unsigned codes [R, C] in [0, 2^bits) -> int32 [R, ceil(C bits / 32)] densely packed along
    the columns (dim=1), or [ceil(R bits / 32), C] along the rows (dim=0, zero points)."""
    if dim == 0:
        return pack_to_int32(codes.t(), bits).t().contiguous()
    r, c = codes.shape
    out = torch.empty(r, math.ceil(c * bits / 32), dtype=torch.int32)
    step = max(1, _PACK_CHUNK // max(c, 1))
    for a in range(0, r, step):
        out[a:a + step] = _pack_rows(codes[a:a + step].to(torch.int64), bits, out.shape[1])
    return out


def _pack_rows(v: torch.Tensor, bits: int, words: int) -> torch.Tensor:
    """v int64 [r, C] -> int32 [r, words]: each 32 codes fill exactly `bits` words."""
    r, c = v.shape
    blocks = math.ceil(c / 32)
    v = torch.nn.functional.pad(v, (0, blocks * 32 - c)).view(r, blocks, 32)
    acc = torch.zeros(r, blocks, bits, dtype=torch.int64)
    for j in range(32):  # 32 codes span exactly `bits` words, so a straddle stays inside the block
        w, off = divmod(j * bits, 32)
        acc[..., w] |= (v[..., j] << off) & 0xFFFFFFFF
        if off + bits > 32:  # the high part spills into the next word
            acc[..., w + 1] |= v[..., j] >> (32 - off)
    acc = acc.reshape(r, blocks * bits)[:, :words]
    return torch.where(acc >= 1 << 31, acc - (1 << 32), acc).to(torch.int32)  # two's complement


def unpack_from_int32(packed: torch.Tensor, bits: int, count: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_to_int32: `count` codes per row (dim=1) or per column (dim=0) -> int32
    in [0, 2^bits)."""
    if dim == 0:
        return unpack_from_int32(packed.t(), bits, count).t().contiguous()
    r, words = packed.shape
    out = torch.empty(r, count, dtype=torch.int32)
    step = max(1, _PACK_CHUNK // max(count, 1))
    for a in range(0, r, step):
        out[a:a + step] = _unpack_rows(packed[a:a + step], bits, count)
    return out


def _unpack_rows(p: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    r, words = p.shape
    blocks = math.ceil(words / bits)
    p = torch.nn.functional.pad(p.to(torch.int64) & 0xFFFFFFFF, (0, blocks * bits - words)).view(r, blocks, bits)
    cols = []
    mask = (1 << bits) - 1
    for j in range(32):
        w, off = divmod(j * bits, 32)
        v = p[..., w] >> off
        if off + bits > 32:
            v = v | (p[..., w + 1] << (32 - off))
        cols.append(v & mask)
    return torch.stack(cols, dim=-1).reshape(r, blocks * 32)[:, :count].to(torch.int32)


# --- the quantization_config ---------------------------------------------------------------------

@dataclass(frozen=True)
class Scheme:
    """One config group, as kvserve needs it."""

    group: str                 # the config_groups key (for error messages)
    spec: QuantSpec            # bits, symmetry, strategy, group size (scales are taken as stored)
    fmt: str                   # one of FORMATS
    g_idx: bool                # legacy act-order: each layer has a weight_g_idx
    targets: tuple[str, ...]


def read_config(q: dict, cfg_path: Path) -> tuple[list[Scheme], list[str]]:
    """A compressed-tensors quantization_config -> (schemes in config order, ignore patterns).
    Anything kvserve cannot run exactly as weight-only integer quantization is refused with a
    ModelLoadError naming config.json and the field."""
    def bad(field: str, problem: str) -> ModelLoadError:
        return ModelLoadError(cfg_path, f"quantization_config.{field}: {problem}")

    if q.get("quant_method") != QUANT_METHOD:
        raise bad("quant_method", f"unsupported quant_method {q.get('quant_method')!r} (kvserve loads "
                                  f"{QUANT_METHOD!r} folders)")
    for key in q:
        if key not in _TOP_FIELDS:
            raise bad(key, "unsupported field")
    for key in _MUST_BE_EMPTY:
        if q.get(key):
            raise bad(key, f"{q[key]!r} is not supported (weight-only integer quantization only)")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise bad("quantization_status", f"{status!r}: only 'compressed' checkpoints are supported")
    top = q.get("format")
    if top not in (*FORMATS, MIXED, None):
        raise bad("format", f"unsupported format {top!r} (kvserve loads {', '.join(FORMATS)})")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise bad("config_groups", "must be a non-empty object")
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise bad("ignore", "must be a list of strings")
    schemes = [_read_group(name, g, top, bad) for name, g in groups.items()]
    return schemes, ignore


def _read_group(name: str, g, top: str | None, bad: Callable[[str, str], ModelLoadError]) -> Scheme:
    where = f"config_groups.{name}"
    if not isinstance(g, dict):
        raise bad(where, "must be an object")
    for key in g:
        if key not in _GROUP_FIELDS:
            raise bad(f"{where}.{key}", "unsupported field")
    for key in ("input_activations", "output_activations"):
        if g.get(key) is not None:
            raise bad(f"{where}.{key}", "activation quantization is not supported (weight-only checkpoints)")
    fmt = g.get("format") or top
    if fmt not in FORMATS:
        raise bad(f"{where}.format", f"unsupported format {fmt!r} (kvserve loads {', '.join(FORMATS)})")
    targets = g.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise bad(f"{where}.targets", "must be a non-empty list of strings")
    w = g.get("weights")
    if not isinstance(w, dict):
        raise bad(f"{where}.weights", "missing: a weight-only scheme needs weight quantization")
    spec, g_idx = _read_weights(w, f"{where}.weights", fmt, bad)
    return Scheme(name, spec, fmt, g_idx, tuple(targets))


def _read_weights(w: dict, where: str, fmt: str, bad) -> tuple[QuantSpec, bool]:
    for key in w:
        if key not in _WEIGHT_FIELDS:
            raise bad(f"{where}.{key}", "unsupported field")
    if w.get("type", "int") != "int":
        raise bad(f"{where}.type", f"{w.get('type')!r}: only integer weights are supported")
    if w.get("dynamic", False) is not False:
        raise bad(f"{where}.dynamic", f"{w.get('dynamic')!r}: only static weight scales are supported")
    if w.get("block_structure") is not None:
        raise bad(f"{where}.block_structure", "block quantization is not supported")
    bits = w.get("num_bits", 8)
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise bad(f"{where}.num_bits", f"{bits!r}: kvserve runs {MIN_BITS}..{MAX_BITS}-bit integer weights")
    group_size = w.get("group_size")
    strategy = w.get("strategy") or ("tensor" if group_size is None else "channel" if group_size == -1 else "group")
    if strategy not in _STRATEGIES:
        raise bad(f"{where}.strategy", f"{strategy!r}: supported strategies are {', '.join(_STRATEGIES)}")
    if strategy == "group" and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise bad(f"{where}.group_size", f"{group_size!r}: strategy 'group' needs a positive group size")
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise bad(f"{where}.symmetric", f"{sym!r} is not a boolean")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static", *_LEGACY_ACTORDER):
        raise bad(f"{where}.actorder", f"unsupported actorder {actorder!r}")
    g_idx = actorder in _LEGACY_ACTORDER
    if g_idx and (strategy != "group" or fmt != PACKED):
        raise bad(f"{where}.actorder", f"{actorder!r} (a g_idx) needs strategy 'group' in {PACKED!r}")
    spec = QuantSpec(bits=bits, sym=sym, granularity=strategy, group_size=group_size if strategy == "group" else 128)
    return spec, g_idx


# --- targets -------------------------------------------------------------------------------------

def matches(name: str, cls: str, pattern: str) -> bool:
    """compressed-tensors' rule: "re:<regex>" matched at the start of the module name, else the
    exact module name or the module's class name ("Linear", "Embedding")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern == cls


def assign_schemes(modules: list[tuple[str, str]], schemes: list[Scheme], ignore: list[str],
                   cfg_path: Path) -> dict[str, Scheme]:
    """(HF module name, class name) in model order -> the scheme of each quantized module: the first
    target, in config order, that matches it, unless an ignore pattern does (compressed-tensors'
    apply_quantization_config)."""
    target_to_scheme: dict[str, Scheme] = {}
    for s in schemes:
        for t in s.targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise ModelLoadError(cfg_path, f"quantization_config.config_groups.{s.group}.targets: "
                                                   f"bad regex {t!r} ({e})") from None
            target_to_scheme[t] = s
    out = {}
    for name, cls in modules:
        hit = next((s for t, s in target_to_scheme.items() if matches(name, cls, t)), None)
        if hit is not None and not any(matches(name, cls, p) for p in ignore):
            out[name] = hit
    return out


# --- one layer -----------------------------------------------------------------------------------

def scale_shape(spec: QuantSpec, n: int, k: int) -> tuple[int, ...]:
    if spec.granularity == "tensor":
        return (1,)
    return (n, spec.num_groups(k))


def layer_tensors(qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A canonical QuantizedWeight -> its pack-quantized tensors (unprefixed), scales in
    `scale_dtype` (they must be exact in it)."""
    spec = qw.spec
    n, k = qw.shape
    offset = 1 << (spec.bits - 1)
    unsigned = qw.codes + offset if spec.sym else qw.codes
    scale, zero = qw.scale, qw.zero
    if spec.granularity == "tensor":
        scale, zero = scale[:1, 0], None if zero is None else zero[:1, 0]
    out = {"weight_packed": pack_to_int32(unsigned, spec.bits),
           "weight_scale": scale.to(scale_dtype).contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if zero is not None:
        out["weight_zero_point"] = ((zero - offset).to(torch.int8) if spec.granularity == "tensor"
                                    else pack_to_int32(zero, spec.bits, dim=0)).contiguous()
    if qw.g_idx is not None:
        out["weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()
    return out


def weights_entry(spec: QuantSpec, g_idx: bool) -> dict:
    """The `weights` QuantizationArgs of a config group, as compressed-tensors serializes it."""
    entry = {"dynamic": False, "group_size": spec.group_size if spec.granularity == "group" else None,
             "num_bits": spec.bits, "strategy": spec.granularity, "symmetric": spec.sym, "type": "int"}
    if g_idx:
        entry["actorder"] = "group"
    return entry


def read_layer(get: Callable[[str], torch.Tensor], where: Callable[[str], Path], name: str,
               scheme: Scheme) -> tuple[QuantizedWeight, torch.dtype]:
    """One module's tensors (get("weight_scale"), ...) -> (canonical QuantizedWeight, the stored
    scale dtype). Shapes, dtypes and ranges are checked; a problem raises ModelLoadError naming
    the file and tensor."""
    def bad(key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(where(key), f"tensor {name}.{key}: {problem}")

    spec = scheme.spec
    offset = 1 << (spec.bits - 1)
    if scheme.fmt == PACKED:
        n, k = _weight_shape(get("weight_shape"), bad)
        packed = get("weight_packed")
        want = (n, math.ceil(k * spec.bits / 32))
        if packed.dtype != torch.int32 or tuple(packed.shape) != want:
            raise bad("weight_packed", f"expected int32 {want}, got {packed.dtype} {tuple(packed.shape)}")
        unsigned = unpack_from_int32(packed, spec.bits, k)
    else:
        w = get("weight")
        if w.dtype != torch.int8 or w.dim() != 2:
            raise bad("weight", f"expected int8 [N, K], got {w.dtype} {tuple(w.shape)}")
        n, k = w.shape
        if spec.bits < 8 and (int(w.min()) < -offset or int(w.max()) >= offset):
            raise bad("weight", f"codes outside the {spec.bits}-bit range")
        unsigned = w.to(torch.int32) + offset
    try:
        want_s = scale_shape(spec, n, k)
    except ValueError as e:
        raise bad("weight_scale", str(e)) from None
    scale = get("weight_scale")
    if not scale.dtype.is_floating_point or scale.dtype.itemsize < 2 or tuple(scale.shape) != want_s:
        raise bad("weight_scale", f"expected a float16/bfloat16/float32 tensor {want_s}, got {scale.dtype} "
                                  f"{tuple(scale.shape)}")
    scale_dtype = scale.dtype
    scale = scale.float()
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise bad("weight_scale", "scales must be finite and positive")
    zero = None if spec.sym else _zero_point(get("weight_zero_point"), scheme, n, want_s, bad)
    g_idx = _g_idx(get("weight_g_idx"), k, spec.num_groups(k), bad) if scheme.g_idx else None
    if spec.granularity == "tensor":
        scale = scale.reshape(1, 1).expand(n, 1).contiguous()
        zero = None if zero is None else zero.reshape(1, 1).expand(n, 1).contiguous()
    codes = unsigned - offset if spec.sym else unsigned
    return QuantizedWeight(codes, scale, zero, spec, g_idx), scale_dtype


def _weight_shape(t: torch.Tensor, bad) -> tuple[int, int]:
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != (2,) or (t <= 0).any():
        raise bad("weight_shape", f"expected 2 positive integers, got {t.dtype} {t.tolist()}")
    return int(t[0]), int(t[1])


def _zero_point(z: torch.Tensor, scheme: Scheme, n: int, want: tuple[int, ...], bad) -> torch.Tensor:
    """The stored zero points -> unsigned int32 shaped like the scale."""
    bits = scheme.spec.bits
    if scheme.fmt == PACKED and scheme.spec.granularity != "tensor":
        packed_want = (math.ceil(n * bits / 32), want[1])
        if z.dtype != torch.int32 or tuple(z.shape) != packed_want:
            raise bad("weight_zero_point", f"expected int32 {packed_want} (packed along the outputs), got "
                                           f"{z.dtype} {tuple(z.shape)}")
        return unpack_from_int32(z, bits, n, dim=0)
    offset = 1 << (bits - 1)
    if z.dtype != torch.int8 or tuple(z.shape) != want:
        raise bad("weight_zero_point", f"expected int8 {want}, got {z.dtype} {tuple(z.shape)}")
    if int(z.min()) < -offset or int(z.max()) >= offset:
        raise bad("weight_zero_point", f"zero points outside the {bits}-bit range")
    return z.to(torch.int32) + offset


def _g_idx(t: torch.Tensor, k: int, groups: int, bad) -> torch.Tensor:
    if t.dtype.is_floating_point or tuple(t.shape) != (k,) or int(t.min()) < 0 or int(t.max()) >= groups:
        raise bad("weight_g_idx", f"expected integer [{k}] in [0, {groups}), got {t.dtype} {tuple(t.shape)}")
    return t.to(torch.int64)
