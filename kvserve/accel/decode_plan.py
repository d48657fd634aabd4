"""A small step's layer stack as one C call (kvserve/kernels/decode_step.c).

At a few rows per step each decoder layer costs ~0.6-0.8 ms of Python and torch dispatch around
~10 kernel calls, about as much as streaming its weights. `DecodePlan` describes every layer once
(pointers to the packed fp32 panels or the int8 / int4 weights, the norm gains, the KV pages) and
hands the C loop the same kernels the Python path calls, in the same order: the hidden state it
returns is bitwise the Python path's (tests/test_decode_plan.py).

It applies to steps of a few rows (decode rows of several sequences, the k + 1 rows of a
speculative verification: as many as every projection's kernel takes in one call, 8-64) through
Gemma 3 or Llama-family layers (Llama, Mistral, Qwen3; without biases) that run on the C kernels
(fp32 activations on the CPU, an unquantized KV pool, every projection packed or on kvserve's int
kernels), no custom attention hook, no early exit; anything else runs the Python path. The plan
remembers each tensor it points at (and its in-place version) and is rebuilt when one changes.
"""
from __future__ import annotations

import ctypes
import operator
import weakref

import torch
from torch import nn

from kvserve import kernels
from kvserve.accel.panels import PanelLinear
from kvserve.model.attention import AttentionMetadata, KVCache
from kvserve.model.gemma3 import Gemma3DecoderLayer
from kvserve.model.llama import LlamaDecoderLayer
from kvserve.weights import ggml, half, linear
from kvserve.weights.ggml import GGMLLinear
from kvserve.weights.half import HalfLinear
from kvserve.weights.linear import QuantLinear
from kvserve.weights.packing import cpu_int4_block_n

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# _Lin.kind: the C loop's LIN_* (decode_step.c), which kernel multiplies by the projection
LIN_PANELS, LIN_INT8, LIN_INT4, LIN_GGML, LIN_GGML_Q8, LIN_HALF = range(6)


class _Lin(ctypes.Structure):
    _fields_ = [("kind", _I), ("n", _I), ("k", _I), ("w", _P), ("scale", _P), ("sz_bf16", _I), ("group", _I),
                ("block_n", _I), ("row_bytes", ctypes.c_int64), ("order", _P)]


class _Chunk(ctypes.Structure):
    _fields_ = [("q_start", _I), ("q_len", _I), ("slots", _P), ("n", _I), ("first_kv", _I), ("first_q", _I)]


class _Ctx(ctypes.Structure):
    _fields_ = [("cos", _P), ("sin", _P), ("slot", _P), ("n_dec", _I), ("max_len", _I), ("max_blocks", _I),
                ("dec_rows", _P), ("table", _P), ("start", _P), ("len", _P), ("n_chunks", _I), ("window", _I),
                ("chunks", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Lin * 3), ("o", _Lin), ("gate_up", _Lin * 2), ("down", _Lin), ("n_qkv", _I), ("n_gate_up", _I),
                ("g_in", _P), ("g_post_attn", _P),
                ("g_pre_ff", _P), ("g_post_ff", _P), ("g_q", _P), ("g_k", _P), ("k_pool", _P), ("v_pool", _P),
                ("ctx", _I)]


class _Step(ctypes.Structure):
    _fields_ = [("panel_gemm", _P), ("int8_gemv", _P), ("int4_gemv", _P), ("rms_norm", _P), ("add_rms_norm", _P),
                ("norm_rope_write", _P), ("paged_decode", _P), ("gated_act", _P), ("ggml_gemv", _P), ("ggml_q8", _P),
                ("half_gemv", _P), ("prefill", _P),
                ("H", _I), ("KVH", _I), ("D", _I), ("hidden", _I), ("inter", _I), ("block_size", _I), ("threads", _I),
                ("kv_type", _I), ("eps", _F), ("qk_eps", _F), ("scale", _F)]


_FUNCTIONS = {"panel_gemm": ("panel_gemm", "panel_gemm"), "int8_gemv": ("lowbit_gemv", "int8_gemv"),
              "int4_gemv": ("lowbit_gemv", "int4_gemv"), "rms_norm": ("rms_norm", "rms_norm"),
              "add_rms_norm": ("rms_norm", "add_rms_norm"), "norm_rope_write": ("rope_cache", "norm_rope_write"),
              "paged_decode": ("paged_attention", "paged_decode"),
              "ggml_gemv": ("ggml_blocks", "ggml_gemv"), "ggml_q8": ("ggml_int8", "ggml_q8_matmul"),
              "half_gemv": ("half_gemv", "half_gemv")}
# Rows of a step a plan takes: as many as each of its projections' kernels takes in the one call
# the Python path makes (more rows, and a layer multiplies by a dequantized or widened weight).
_ROW_LIMITS = {LIN_PANELS: None, LIN_INT8: linear.GEMV_MAX_ROWS, LIN_INT4: linear.GEMV_MAX_ROWS,
               LIN_GGML: ggml.GEMV_MAX_ROWS, LIN_GGML_Q8: None, LIN_HALF: half.GEMV_MAX_ROWS}  # None: any rows
MAX_ROWS = max(n for n in _ROW_LIMITS.values() if n is not None)  # the most any plan takes


def _version(t: torch.Tensor) -> int | None:
    """The in-place version counter; None for inference tensors (made under inference_mode, e.g. a
    norm's cached gain, which the plan tracks through its weight instead)."""
    return None if t.is_inference() else t._version


def _holder(owner: object, attr: str) -> dict:
    """The dict that holds owner.attr: a module's parameters or buffers, else its own __dict__."""
    if isinstance(owner, nn.Module):
        for d in (owner._parameters, owner._buffers):
            if attr in d:
                return d
    return vars(owner)


class _Unsupported(Exception):
    """The model (or one of its layers) is not something the C loop runs."""


def _linear(module: nn.Module | None, panels, keep: list) -> _Lin:
    """The C description of one projection: fp32 packed panels, a QuantLinear on the C kernels,
    GGUF blocks or 16-bit weights."""
    if panels is not None:  # a Panels object (accel/panels.py)
        if not panels.refresh():
            raise _Unsupported("weights no longer fp32 on the CPU")
        keep += [(panels, "packed", panels.packed)] + [(None, None, w) for w in panels.weights]
        return _Lin(LIN_PANELS, panels.rows, panels.weights[0].shape[1], panels.packed.data_ptr(), None, 0, 0, 0)
    if isinstance(module, QuantLinear) and module._gemv is not None and module.bias is None:
        keep += [(module, "qweight", module.qweight), (module, "_gemv", module._gemv)]
        if module.kernel == "int8":
            return _Lin(LIN_INT8, module.out_features, module.in_features, module.qweight.data_ptr(),
                        module._gemv.data_ptr(), 0, 0, 0)
        if module.kernel == "int4" and cpu_int4_block_n() in (32, 64) and module.group_size % 2 == 0:
            return _Lin(LIN_INT4, module.out_features, module.in_features, module.qweight.data_ptr(),
                        module._gemv.data_ptr(), int(module._gemv.dtype == torch.bfloat16), module.group_size,
                        cpu_int4_block_n())
    if isinstance(module, GGMLLinear) and module.bias is None:
        keep.append((module, "raw", module.raw))
        order = module.out_order
        if order is not None:
            keep.append((module, "out_order", order))
        return _Lin(LIN_GGML_Q8 if module.int8_path else LIN_GGML, module.out_features, module.in_features,
                    module.raw.data_ptr(), None, 0, int(module.ggml_type), 0, module.raw.shape[1], None if order is None else order.data_ptr())
    if type(module) is HalfLinear and module.bias is None:
        keep.append((module, "weight", module.weight))
        return _Lin(LIN_HALF, module.out_features, module.in_features, module.weight.data_ptr(), None,
                    int(module.weight.dtype == torch.bfloat16), 0, 0)
    raise _Unsupported(f"projection {type(module).__name__} is not on the C kernels")


def _parts(fused: nn.Module | None, panels, separate: tuple, keep: list, out) -> int:
    """Fill `out` (a _Lin array) with a fused projection (one matrix or packed panels) or the
    separate projections reading the same input (GGUF blocks, layers left unfused); returns how many."""
    if fused is not None or panels is not None:
        out[0] = _linear(fused, panels if fused is None else None, keep)
        return 1
    for j, m in enumerate(separate):
        out[j] = _linear(m, None, keep)
    return len(separate)


def _single_panels(module) -> object | None:
    """A PanelLinear's own packed copy (None for other modules)."""
    return module.panels if type(module) is PanelLinear and module.bias is None else None


def _norms(layer: nn.Module) -> tuple:
    """(input, post-attention, pre-feedforward, post-feedforward, q, k) norms of a decoder layer,
    None where the family has none (Llama: no post norms; its post_attention_layernorm is the
    MLP's pre-norm; q/k norms in Qwen3 only)."""
    att = layer.self_attn
    if type(layer) is Gemma3DecoderLayer:
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm, att.q_norm, att.k_norm)
    return layer.input_layernorm, None, layer.post_attention_layernorm, None, att.q_norm, att.k_norm


class DecodePlan:
    """The C description of a model's layers for small steps (see module doc)."""

    def __init__(self, model: nn.Module, kv_cache: KVCache):
        cfg = model.config
        kinds = {type(layer) for layer in model.layers}
        if len(kinds) != 1 or kinds.pop() not in (Gemma3DecoderLayer, LlamaDecoderLayer):
            raise _Unsupported("not all Gemma 3 or all Llama layers")
        if cfg.moe is not None:
            raise _Unsupported("mixture-of-experts layers")
        kv_type = kernels.kv_type_code(kv_cache.k[0].dtype) if kv_cache.k else None
        if kv_cache.quantized or kv_cache.dtype != torch.float32 or cfg.kv_source is not None or kv_type is None:
            raise _Unsupported("quantized, non-fp32 or shared KV")
        acts = {"gelu_tanh_mul" if layer.mlp.gelu_tanh else "silu_mul" if layer.mlp.silu else None
                for layer in model.layers}
        if len(acts) != 1 or None in acts:
            raise _Unsupported("MLP activations other than one of gelu_tanh, silu")
        functions = {**_FUNCTIONS, "gated_act": ("gelu", acts.pop())}
        addresses = {f: kernels.kernel_address(src, name) for f, (src, name) in functions.items()}
        if None in addresses.values() or kernels.kernel_lib("decode_step") is None:
            raise _Unsupported("C kernels unavailable")
        # Chunks of a sequence go through the prefill kernel where the Python path does (else the
        # plan takes steps of decode rows only).
        lib = kernels.kernel_lib("prefill_attention")
        self.takes_chunks = bool(lib is not None and lib.prefill_attention_available() and cfg.head_dim % 16 == 0)
        addresses["prefill"] = kernels.kernel_address("prefill_attention", "prefill_attention") if self.takes_chunks \
            else None
        # (owner, attribute, tensor) to re-check; never the model or the KVCache object themselves,
        # which key the weak map of plans (see plan_for)
        self._keep: list[tuple[object, str | None, torch.Tensor]] = []
        layers = (_Layer * len(model.layers))()
        self._ctx_keys: list[tuple[int, int | None, str]] = []  # (KV group, window, rope table) per Ctx
        norm_eps = set()
        for i, layer in enumerate(model.layers):
            att, mlp = layer.self_attn, layer.mlp
            norms = _norms(layer)
            if not att.computes_kv or (norms[4] is None) != (norms[5] is None):
                raise _Unsupported("layer without its own K/V, or with only one of the q/k norms")
            ly = layers[i]
            ly.n_qkv = _parts(att.qkv_proj, att.qkv_panels, (att.q_proj, att.k_proj, att.v_proj), self._keep, ly.qkv)
            ly.o = _linear(att.o_proj, _single_panels(att.o_proj), self._keep)
            ly.n_gate_up = _parts(mlp.gate_up_proj, mlp.gate_up_panels, (mlp.gate_proj, mlp.up_proj), self._keep,
                                  ly.gate_up)
            ly.down = _linear(mlp.down_proj, _single_panels(mlp.down_proj), self._keep)
            present = [n for n in norms if n is not None]
            gains = {id(n): n.kernel_gain() for n in present}
            if any(g is None for g in gains.values()):
                raise _Unsupported("norm gains not fp32 on the CPU")
            norm_eps |= {n.eps for n in norms[:4] if n is not None}
            if att.q_norm is not None and att.q_norm.eps != att.k_norm.eps:
                raise _Unsupported("q and k norms with different eps")
            self._keep += [(n, "weight", n.weight) for n in present] + [(None, None, g) for g in gains.values()]
            ly.g_in, ly.g_post_attn, ly.g_pre_ff, ly.g_post_ff, ly.g_q, ly.g_k = (
                None if n is None else gains[id(n)].data_ptr() for n in norms)
            k_pool, v_pool, group = kv_cache.layer(i)
            self._keep += [(None, None, k_pool), (None, None, v_pool)]
            ly.k_pool, ly.v_pool = k_pool.data_ptr(), v_pool.data_ptr()
            key = (group, att.window, cfg.layer_types[i])
            if key not in self._ctx_keys:
                self._ctx_keys.append(key)
            ly.ctx = self._ctx_keys.index(key)
        first = model.layers[0].self_attn
        if len(norm_eps) != 1 or any(layer.self_attn.scale != first.scale for layer in model.layers):
            raise _Unsupported("layers with different norm eps or attention scales")
        self._layers = layers
        lins = [lin for ly in layers for lin in (*ly.qkv[:ly.n_qkv], ly.o, *ly.gate_up[:ly.n_gate_up], ly.down)]
        self.max_rows = min((_ROW_LIMITS[lin.kind] for lin in lins if _ROW_LIMITS[lin.kind] is not None),
                            default=MAX_ROWS)
        self._ctxs = (_Ctx * len(self._ctx_keys))()
        self._step = _Step(**addresses, H=cfg.num_heads, KVH=cfg.num_kv_heads, D=cfg.head_dim,
                           hidden=cfg.hidden_size, inter=cfg.intermediate_size, block_size=0, threads=1,
                           kv_type=kv_type,
                           eps=norm_eps.pop(), qk_eps=first.q_norm.eps if first.q_norm is not None else 0.0,
                           scale=first.scale)
        # What current() compares, laid out once: it runs every step over ~400 tensors, and the
        # plain loop over _keep (Module.__getattr__ per weight) cost ~0.25 ms of a 10 ms Gemma step.
        # A module keeps each attribute in one dict (parameters, buffers or its own), which
        # assignment through the module updates in place: the check reads that dict's entry.
        owned = [(_holder(owner, attr), attr, t) for owner, attr, t in self._keep if owner is not None]
        self._holders, self._attrs, self._targets = (list(c) for c in zip(*owned)) if owned else ([], [], [])
        self._versioned = [t for _, _, t in self._keep if _version(t) is not None]
        self._versions = [t._version for t in self._versioned]
        self._fn = kernels.kernel_lib("decode_step").decode_layers

    @classmethod
    def build(cls, model: nn.Module, kv_cache: KVCache) -> DecodePlan | None:
        try:
            return cls(model, kv_cache)
        except _Unsupported:
            return None

    def current(self) -> bool:
        """Every tensor the plan points at is still the module's and unchanged in place."""
        return (all(map(operator.is_, map(dict.get, self._holders, self._attrs), self._targets))
                and [t._version for t in self._versioned] == self._versions)

    @staticmethod
    def applies(h: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step of 1..MAX_ROWS rows (fp32 CPU hidden state, no custom hook); whether this plan
        runs it is `takes`."""
        return (0 < h.shape[0] <= MAX_ROWS and meta.custom is None and h.dtype == torch.float32
                and h.device.type == "cpu")

    def takes(self, rows: int, meta: AttentionMetadata) -> bool:
        """Rows its projections' kernels take in one call, and chunks only with the prefill kernel."""
        return rows <= self.max_rows and (self.takes_chunks or not meta.seqs)

    def run(self, h: torch.Tensor, cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> torch.Tensor | None:
        """h [M, hidden] after the embedding -> the last layer's output [M, hidden]; None when the
        C loop failed (the caller runs the Python path; nothing it wrote is read)."""
        keep = []  # the step's tensors and chunk arrays stay alive until the call returns
        rows: dict[int, torch.Tensor] = {}  # id(DecodeBatch) -> its int64 row indices (Ctxs share groups)
        M = h.shape[0]
        for c, (group, window, rope) in zip(self._ctxs, self._ctx_keys):
            gm = meta.for_group(group)
            cos, sin = (t.contiguous() for t in cos_sin[rope])
            keep += [cos, sin]
            c.cos, c.sin, c.slot, c.window = cos.data_ptr(), sin.data_ptr(), gm.slot_mapping.data_ptr(), window or 0
            self._decode_rows(c, gm.decode, window, M, bool(gm.seqs), rows, keep)
            c.n_chunks, c.chunks = len(gm.seqs), self._chunks(gm.seqs, window, keep) if gm.seqs else None
        self._step.threads = torch.get_num_threads()
        out = h.contiguous().clone()
        rc = self._fn(ctypes.byref(self._step), self._layers, self._ctxs, len(self._layers), M, out.data_ptr())
        return out if rc == 0 else None

    @staticmethod
    def _chunks(seqs: list, window: int | None, keep: list) -> int:
        """The address of a _Chunk array describing each sequence's chunk of query rows."""
        chunks = (_Chunk * len(seqs))()
        for chunk, s in zip(chunks, seqs):
            first_kv = s.first_kv(window)
            slots = s.ctx_slots[first_kv:]
            keep.append(slots)
            chunk.q_start, chunk.q_len, chunk.slots = s.q_start, s.q_len, slots.data_ptr()
            chunk.n, chunk.first_kv, chunk.first_q = slots.shape[0], first_kv, s.ctx_len - s.q_len
        keep.append(chunks)
        return ctypes.addressof(chunks)

    def _decode_rows(self, c: _Ctx, batch, window: int | None, M: int, chunks: bool, rows: dict,
                     keep: list) -> None:
        """The Ctx's decode rows from the group's DecodeBatch (None: none); their row indices go
        along only when the step has other rows (then the kernel gathers them, as _decode does),
        converted once a step (`rows`, by batch: Ctxs of one KV group share it)."""
        if batch is None:
            c.n_dec = 0
            return
        table = batch.block_tables if batch.block_tables.is_contiguous() else batch.block_tables.contiguous()
        start = batch.starts(window)
        keep += [table, start]
        c.n_dec, c.max_blocks, c.table = batch.rows.shape[0], table.shape[1], table.data_ptr()
        c.start, c.len = start.data_ptr(), batch.lens.data_ptr()
        c.max_len = batch.max_len if batch.max_len is not None else int(batch.lens.max())
        c.dec_rows = None
        if chunks or c.n_dec != M:
            if id(batch) not in rows:
                rows[id(batch)] = batch.rows.to(torch.int64).contiguous()
                keep.append(rows[id(batch)])
            c.dec_rows = rows[id(batch)].data_ptr()
        self._step.block_size = batch.block_size


# model -> {KV cache: its plan or None}: outside the module, so copying or saving a model never
# meets the ctypes structures; engines sharing a model (a draft and its target, tests) each keep
# theirs; a model that had no plan for a cache is not re-examined for it.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_decode_plan(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                    meta: AttentionMetadata) -> torch.Tensor | None:
    """A step's final hidden states [M, hidden] through the model's plan (embedding, every layer
    in one C call, final norm), or None where no plan applies (the caller runs the model)."""
    if input_ids.shape[0] > MAX_ROWS or _PLANS.get(model, {}).get(kv_cache, True) is None:
        return None  # too many rows, or a model already found without a plan (kept None by plan_for)
    h = model.embed(input_ids)
    if not DecodePlan.applies(h, meta):
        return None
    plan = plan_for(model, kv_cache)
    if plan is None or not plan.takes(h.shape[0], meta):
        return None
    out = plan.run(h, model.rope_tables(positions, h.dtype), meta)
    return None if out is None else model.norm(out)


def plan_for(model: nn.Module, kv_cache: KVCache) -> DecodePlan | None:
    """The model's current plan for this KV cache (built, or rebuilt after a change), or None."""
    plans = _PLANS.setdefault(model, weakref.WeakKeyDictionary())
    if kv_cache in plans:
        plan = plans[kv_cache]
        if plan is None or plan.current():
            return plan
    plan = plans[kv_cache] = DecodePlan.build(model, kv_cache)
    return plan
