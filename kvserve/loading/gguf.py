"""GGUF files: config from metadata (read by gguf_file.py), weights dequantized (`dequantized`),
tokenizer.

Converting a GGUF takes seconds, so `load_gguf` converts once
into the cache (config.json + model.safetensors in fp32 + tokenizer.json) and later starts
read only the cache. `load_gguf_blocks` keeps the file's quantized blocks instead (no fp32
copy anywhere): it caches the config, the tokenizer and an index of the tensors (type, shape,
offset), and on every start reads the matrices into memory (or maps the file, `mmap`).
"""
from __future__ import annotations

import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file
from torch import nn

from kvserve.kernels.host_memory import empty_huge
from kvserve.loading.cache import atomic_write_bytes, entry_dir, replace_atomically
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf_file import GGUFFile, Unreadable
from kvserve.loading.serialize import config_from_dict, config_to_dict
from kvserve.loading.tokenizer import GEMMA_VOCABULARIES, cached_gguf_tokenizer, write_gguf_tokenizer
from kvserve.model.config import FULL, SLIDING, ModelConfig, MoEConfig, RopeConfig
from kvserve.weights.embedding import QuantEmbedding
from kvserve.weights.ggml import GGML_TYPES, GGMLLinear, dequantize_rows, row_bytes

SUPPORTED_ARCHS = ("gemma3", "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")

# GGUF tensor name (after "blk.N.") -> our parameter name (after "layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the MoE router [experts, hidden]
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",  # Qwen2-MoE's shared expert and its gate
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # [hidden] in the file, [1, hidden] here
}
# llama.cpp's MoE experts, one 3-D tensor per projection [experts, out, in] (numpy order) -> the
# projection of each of our per-expert MLPs, layers.N.mlp.experts.E.<proj>
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# The norm after attention is "post_attention_norm" in Gemma, while Llama's pre-MLP norm
# ("ffn_norm") is what HF calls post_attention_layernorm.
_FAMILY_LAYER_NAMES = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "llama": {"ffn_norm": "post_attention_layernorm"},
}
# llama.cpp permutes q/k rows for its interleaved RoPE in these architectures only (the Qwen
# families use the half rotation as stored)
_PERMUTED_QK = ("llama",)
# Tensors that are part of the configuration, not parameters: Llama 3.1+'s RoPE frequency
# divisors (read by _rope_freq_factors)
_CONFIG_TENSORS = ("rope_freqs.weight",)
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as e:  # truncated or corrupt files: the reader says where
        raise ModelLoadError(path, f"not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None


def _field(reader: GGUFFile, key: str, default=None, path: Path | None = None, kind: type | None = None):
    """A metadata value (the default when absent; none: an error naming the key), converted to
    `kind` with an error naming the key when it is not one."""
    if key not in reader.fields:
        if default is None:
            raise ModelLoadError(path, f"GGUF metadata lacks {key!r}")
        return default
    value = reader.fields[key]
    if isinstance(value, Unreadable):
        raise ModelLoadError(path, f"GGUF metadata {key!r} cannot be read ({value.reason})")
    if kind is None:
        return value
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ModelLoadError(path, f"GGUF metadata {key!r} must be a number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ModelLoadError(path, f"GGUF metadata {key!r} must be a string, got {value!r}")
    return kind(value)


def read_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """ModelConfig from the metadata; a value of the wrong type or an inconsistent set of them
    is a ModelLoadError naming the file."""
    try:
        return _read_gguf_config(reader, path)
    except (ValueError, TypeError, ZeroDivisionError, IndexError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(path, f"inconsistent GGUF metadata ({type(e).__name__}: {e})") from None


def _read_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture", path=path, kind=str)
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(path, f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")

    def meta(key: str, default=None, kind: type | None = None):
        return _field(reader, f"{arch}.{key}", default, path, kind)

    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(path, "GGUF has no token_embd.weight tensor")
    hidden = meta("embedding_length", kind=int)
    heads = meta("attention.head_count", kind=int)
    kv_heads = meta("attention.head_count_kv", heads, kind=int)
    head_dim = meta("attention.key_length", hidden // heads, kind=int)
    n_layers = meta("block_count", kind=int)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", -1)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", -1)
    pad = _field(reader, "tokenizer.ggml.padding_token_id", -1)
    eos_ids = [] if eos < 0 else [int(eos)]
    if arch == "gemma3":
        # Gemma ends a chat turn with <end_of_turn>; HF's generation_config lists it as an eos.
        tokens = _field(reader, "tokenizer.ggml.tokens", [])
        if "<end_of_turn>" in tokens:
            eos_ids.append(tokens.index("<end_of_turn>"))
    common = dict(
        model_type=arch,
        vocab_size=int(embd.shape[-1]),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length", kind=int),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", kind=float),
        max_position_embeddings=meta("context_length", kind=int),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=None if bos < 0 else int(bos),
        eos_token_ids=eos_ids,
        pad_token_id=None if pad < 0 else int(pad),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
        chat_template=_field(reader, "tokenizer.chat_template", "") or None,
    )
    theta = meta("rope.freq_base", 10000.0, kind=float)
    scaling = None
    kind = meta("rope.scaling.type", "none")
    if kind == "linear":
        scaling = (("rope_type", "linear"), ("factor", meta("rope.scaling.factor", kind=float)))
    elif kind not in ("none", ""):
        raise ModelLoadError(path, f"rope scaling {kind!r} is not supported")

    if arch == "gemma3":
        # As HF's GGUF loader: local layers use base 10k, every 6th layer is global, and the
        # query scale is query_pre_attn_scalar = 256 (these are not in the GGUF metadata).
        layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n_layers)]
        return ModelConfig(
            family="gemma3",
            layer_types=layer_types,
            rope={SLIDING: RopeConfig(10000.0), FULL: RopeConfig(theta, scaling)},
            attn_scale=256**-0.5,
            sliding_window=meta("attention.sliding_window", kind=int),
            hidden_act="gelu_pytorch_tanh",
            qk_norm=True,
            **common,
        )
    if "rope_freqs.weight" in names:
        if scaling is not None:
            raise ModelLoadError(path, f"rope_freqs.weight and {arch}.rope.scaling.type {kind!r} together are not "
                                       "supported")
        scaling = (("factors", _rope_freq_factors(reader, head_dim, path)), ("rope_type", "freq_factors"))
    return ModelConfig(
        family="llama",
        layer_types=[FULL] * n_layers,
        rope={FULL: RopeConfig(theta, scaling)},
        attn_scale=head_dim**-0.5,
        hidden_act="silu",
        qk_norm="blk.0.attn_q_norm.weight" in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        moe=_gguf_moe(meta, arch, n_layers, common["intermediate_size"], path),
        **common,
    )


def _rope_freq_factors(reader: GGUFFile, head_dim: int, path: Path) -> tuple[float, ...]:
    """rope_freqs.weight: what each rotary frequency is divided by (llama.cpp writes Llama 3.1+'s
    llama3 scaling this way, [head_dim / 2] F32), as a tuple of positive floats."""
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    try:
        f = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
    except Exception as e:
        raise ModelLoadError(path, f"cannot read tensor 'rope_freqs.weight' ({e})") from None
    if f.shape != (head_dim // 2,) or not (np.isfinite(f) & (f > 0)).all():
        raise ModelLoadError(path, f"rope_freqs.weight must hold {head_dim // 2} positive values (head_dim / 2), "
                                   f"got {f.size}")
    return tuple(float(v) for v in f)


def _gguf_moe(meta, arch: str, n_layers: int, intermediate: int, path: Path) -> MoEConfig | None:
    """Experts in every layer, routed softmax top-k as llama.cpp computes them: a llama file
    (Mixtral) and qwen3moe renormalise the top-k weights; qwen2moe does not, and adds a shared
    expert of expert_shared_feed_forward_length scaled by sigmoid(ffn_gate_inp_shexp . x)."""
    experts = meta("expert_count", 0, kind=int)
    if experts == 0:
        if arch in ("qwen2moe", "qwen3moe"):
            raise ModelLoadError(path, f"GGUF metadata {arch}.expert_count is missing or 0")
        return None
    used = meta("expert_used_count", 0, kind=int)
    if not 0 < used <= experts:
        raise ModelLoadError(path, f"GGUF metadata {arch}.expert_used_count ({used}) must be in 1..expert_count "
                                   f"({experts})")
    layers = tuple(range(n_layers))
    if arch in ("qwen2moe", "qwen3moe"):
        own = (dict(shared_intermediate_size=meta("expert_shared_feed_forward_length", kind=int),
                    shared_expert_gate=True) if arch == "qwen2moe" else dict(norm_topk_prob=True))
        return MoEConfig(num_experts=experts, top_k=used, layers=layers,
                         intermediate_size=meta("expert_feed_forward_length", kind=int), **own)
    return MoEConfig(num_experts=experts, top_k=used, intermediate_size=intermediate, layers=layers,
                     norm_topk_prob=True)


def _expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """Our per-expert parameter names of a stacked expert tensor (blk.N.ffn_*_exps.weight), in
    the tensor's expert order; None for any other tensor."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES and parts[3] == "weight":
        return [f"layers.{parts[1]}.mlp.experts.{e}.{_EXPERT_NAMES[parts[2]]}.weight" for e in range(num_experts)]
    return None


def _check_experts(name: str, shape: tuple[int, ...], cfg: ModelConfig, path: Path) -> None:
    """A stacked expert tensor holds one [out, in] matrix per expert of the config (shape in
    numpy order: experts, out, in)."""
    if cfg.moe is None:
        raise ModelLoadError(path, f"tensor {name!r}: expert weights, but the metadata has no expert_count")
    h, i = cfg.hidden_size, cfg.moe.intermediate_size
    want = (cfg.moe.num_experts, *((h, i) if ".ffn_down_exps." in name else (i, h)))
    if tuple(shape) != want:
        raise ModelLoadError(path, f"tensor {name!r} has shape {list(shape)}, the metadata implies {list(want)}")


def _param_name(gguf_name: str, family: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        local = _FAMILY_LAYER_NAMES[family].get(parts[2]) or _LAYER_NAMES.get(parts[2])
        if local:
            return f"layers.{parts[1]}.{local}.{kind}"
    return None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves for Llama q/k; undo it for half-rotation."""
    dim = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(reader: GGUFFile, cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32, under our parameter names."""
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        experts = _expert_names(t.name, cfg.moe.num_experts if cfg.moe else 0)
        if experts is not None:
            sd.update(_dequantized_experts(t, experts, cfg, path))
            continue
        name = _param_name(t.name, cfg.family)
        if name is None:
            raise ModelLoadError(path, f"unexpected tensor {t.name!r} for architecture {cfg.model_type!r}")
        try:
            w = dequantized(t.data, t.tensor_type, t.shape[0])
        except Exception as e:
            raise ModelLoadError(path, f"cannot dequantize tensor {t.name!r} ({e})") from None
        if cfg.family == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma norm weights as 1 + w
        if cfg.model_type in _PERMUTED_QK and ".self_attn.q_proj." in name:
            w = _unpermute_rope(w, cfg.num_heads)
        if cfg.model_type in _PERMUTED_QK and ".self_attn.k_proj." in name:
            w = _unpermute_rope(w, cfg.num_kv_heads)
        if name.endswith(".shared_expert_gate.weight"):
            w = w.reshape(1, -1)
        # F32 tensors come back as read-only views of the memory-mapped file: those are copied.
        sd[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    return sd


def dequantized(data: np.ndarray, ggml_type: gguf.GGMLQuantizationType, k: int) -> np.ndarray:
    """A tensor's stored data (`GGUFTensor.data`) in fp32, shaped as the `gguf` package's
    dequantizer shapes it ([..., k]). Blocks go through `dequantize_rows` (kernels/ggml_blocks.c:
    gguf's values bit for bit, ~8x faster, the bundled model in 0.25 s against 2.0 s on two
    cores); plain types, and every type without a C compiler, through gguf."""
    if data.dtype != np.uint8 or data.ndim < 2 or ggml_type not in GGML_TYPES:
        return np.asarray(dequantize(data, ggml_type), dtype=np.float32)
    rows = data.reshape(-1, data.shape[-1])
    with warnings.catch_warnings():  # (read-only file pages: only read)
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(rows)
    return dequantize_rows(raw, ggml_type, k, torch.arange(rows.shape[0])).numpy().reshape(*data.shape[:-1], k)


def _dequantized_experts(t, names: list[str], cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """A stacked expert tensor [experts, out, in] dequantized, one fp32 matrix per expert."""
    try:
        w = dequantized(t.data, t.tensor_type, t.shape[0])
    except Exception as e:
        raise ModelLoadError(path, f"cannot dequantize tensor {t.name!r} ({e})") from None
    _check_experts(t.name, w.shape, cfg, path)
    return {name: torch.from_numpy(np.array(w[e], dtype=np.float32, order="C", copy=True))
            for e, name in enumerate(names)}


def _tokenizer_meta(reader: GGUFFile, path: Path) -> dict:
    """The tokenizer.ggml.* metadata by key without its prefix."""
    prefix = "tokenizer.ggml."
    return {k.removeprefix(prefix): _field(reader, k, path=path) for k in reader.fields if k.startswith(prefix)}


def _gguf_tokenizer(reader: GGUFFile, path: Path, entry: Path) -> Path:
    """The cache entry's tokenizer file (tokenizer.model or tokenizer.json), written once. The
    vocabulary's values are read only for the architectures that can use them (the others go to
    transformers' converter, which reads the file itself)."""
    cached = cached_gguf_tokenizer(entry)
    if cached is not None:
        return cached
    arch = _field(reader, "general.architecture", "", path, str)
    meta = _tokenizer_meta(reader, path) if arch in GEMMA_VOCABULARIES else {}
    return write_gguf_tokenizer(path, meta, arch, entry)


def load_gguf(path: Path) -> tuple[ModelConfig, Path, Path]:
    """Convert (once) and return (config, safetensors path, tokenizer file) from the cache."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "no such GGUF file")
    entry = entry_dir("gguf", path)
    cfg_file, weights, tok_file = entry / "config.json", entry / "model.safetensors", cached_gguf_tokenizer(entry)
    if not (cfg_file.exists() and weights.exists() and tok_file is not None):
        tok_file = _convert(path, entry, cfg_file, weights)
    try:
        cfg = config_from_dict(json.loads(cfg_file.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(cfg_file, f"corrupt cached config ({e}); delete the folder to rebuild it") from None
    return cfg, weights, tok_file


def _convert(path: Path, entry: Path, cfg_file: Path, weights: Path) -> Path:
    """Write the entry's weights, tokenizer and config (last: it marks a complete entry) -> the
    tokenizer file."""
    reader = open_gguf(path)
    cfg = read_gguf_config(reader, path)
    sd = gguf_state_dict(reader, cfg, path)
    tok_file = _gguf_tokenizer(reader, path, entry)
    replace_atomically(weights, lambda tmp: save_file(sd, str(tmp)))
    atomic_write_bytes(cfg_file, json.dumps(config_to_dict(cfg), indent=1).encode())
    return tok_file


# ---------------------------------------------------------------- the file's own blocks

_INDEX_VERSION = 1


def _tensor_index(reader: GGUFFile) -> list[dict]:
    """Each tensor's name, ggml type, shape (GGUF order: fastest axis first), file offset, bytes."""
    return [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
             "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]


def _block_entry(path: Path) -> tuple[ModelConfig, list[dict], Path]:
    """(config, tensor index, tokenizer file) of a GGUF from the cache, made once (no weights)."""
    entry = entry_dir("gguf", path)
    cfg_file, tok_file, index_file = entry / "config.json", cached_gguf_tokenizer(entry), entry / "tensors.json"
    if not (cfg_file.exists() and tok_file is not None and index_file.exists()):
        reader = open_gguf(path)
        cfg = read_gguf_config(reader, path)
        tok_file = _gguf_tokenizer(reader, path, entry)
        index = {"version": _INDEX_VERSION, "size": path.stat().st_size, "tensors": _tensor_index(reader)}
        atomic_write_bytes(index_file, json.dumps(index).encode())
        if not cfg_file.exists():
            atomic_write_bytes(cfg_file, json.dumps(config_to_dict(cfg), indent=1).encode())
    try:
        cfg = config_from_dict(json.loads(cfg_file.read_text()))
        index = json.loads(index_file.read_text())
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(entry, f"corrupt cache entry ({e}); delete the folder to rebuild it") from None
    if index.get("version") != _INDEX_VERSION or index.get("size") != path.stat().st_size:
        raise ModelLoadError(index_file, "stale tensor index; delete the folder to rebuild it")
    return cfg, index["tensors"], tok_file


def gguf_block_entry(path: Path) -> tuple[ModelConfig, list[dict], Path]:
    """(config, tensor index, tokenizer file) of a GGUF loaded as blocks, from its cache entry
    (made once); load_gguf_blocks takes the first two."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "no such GGUF file")
    return _block_entry(path)


def load_gguf_blocks(path: Path, cfg: ModelConfig, index: list[dict], dtype: torch.dtype, activations: str = "int8",
                     mmap: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, nn.Module]]:
    """A GGUF's weights as the file stores them (`cfg`, `index` from gguf_block_entry): (plain
    tensors by name (norms, biases, routers, in `dtype`), modules by name (a GGMLLinear over the
    bytes of every matrix, its `activations` as given; the token embedding a lookup into its
    table, shared with the LM head when tied)).

    The matrices' bytes are read into the process's own memory in 2 MB pages (`_read_matrices`),
    or with `mmap` are the memory-mapped file's pages themselves. Either way they are the file's
    bytes, unchanged; the difference is speed and sharing: a decode step streams every matrix,
    and on 4 KB file pages that is a TLB miss every 4 KB (measured: batch-1 decode of 1B-shaped
    Q4_0 / Q4_K_M files 6-16% faster from 2 MB pages, docs/ARCHITECTURE.md), while mapped pages
    are shared through the page cache with every other process serving the same file."""
    # Copy-on-write pages: torch wants a writable buffer; nothing writes, so they stay the file's.
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    read = {} if mmap else _read_matrices(path, index)
    plain: dict[str, torch.Tensor] = {}
    modules: dict[str, nn.Module] = {}
    for t in index:
        if t["name"] in _CONFIG_TENSORS:
            continue
        data = read.get(t["name"])
        if data is None:
            data = mapped[t["offset"]:t["offset"] + t["bytes"]]
        experts = _expert_names(t["name"], cfg.moe.num_experts if cfg.moe else 0)
        if experts is not None:
            modules.update(_expert_blocks(data, t, experts, cfg, path, activations))
            continue
        name = _param_name(t["name"], cfg.family)
        if name is None:
            raise ModelLoadError(path, f"unexpected tensor {t['name']!r} for architecture {cfg.model_type!r}")
        if len(t["shape"]) == 1:  # norms, biases, the shared-expert gate: small, as floats
            plain[name] = _vector(data, t, cfg, name, path).to(dtype)
            if name.endswith(".shared_expert_gate.weight"):
                plain[name] = plain[name].reshape(1, -1)
            continue
        if name.endswith(".mlp.gate.weight"):  # the router: a float matrix (it picks the experts)
            plain[name] = _matrix(data, t, path).to(dtype)
            continue
        k, n = t["shape"]
        try:
            raw = torch.from_numpy(data).view(n, row_bytes(t["type"], k))
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(path, f"tensor {t['name']!r}: {e}") from None
        order = None
        if cfg.model_type in _PERMUTED_QK and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            order = torch.from_numpy(_unpermute_rope(np.arange(n, dtype=np.int64), heads).copy())
        modules[name.removesuffix(".weight")] = GGMLLinear(raw, t["type"], k, n, activations=activations,
                                                           out_order=order)
    for name in [n for n in plain if n.endswith(".bias") and n.removesuffix(".bias") in modules]:
        modules[name.removesuffix(".bias")].bias = plain.pop(name)  # (Qwen2-MoE's q/k/v biases)
    table = modules.pop("embed_tokens", None)
    if table is None:
        raise ModelLoadError(path, "no token_embd tensor")
    if cfg.tie_word_embeddings:
        modules["lm_head"] = table
        modules["embed_tokens"] = QuantEmbedding(table, dtype, tied=True)
    else:
        modules["embed_tokens"] = QuantEmbedding(table, dtype, tied=False)
    return plain, modules


def _read_matrices(path: Path, index: list[dict]) -> dict[str, np.ndarray]:
    """Every tensor of 2+ dimensions read from the file into fresh memory advised for 2 MB pages
    (read, not mapped: the file's pages stay in the page cache, outside this process's memory),
    a thread per core: the page faults that fill the new memory dominate a warm load, and they
    run in parallel (positional reads, which release the GIL)."""
    wanted = [t for t in index if len(t["shape"]) >= 2 and t["name"] not in _CONFIG_TENSORS]
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
            arrays = list(pool.map(lambda t: _read_huge(fd, t, path), wanted))
    finally:
        os.close(fd)
    return {t["name"]: a for t, a in zip(wanted, arrays)}


def _read_huge(fd: int, t: dict, path: Path) -> np.ndarray:
    out = empty_huge(t["bytes"], dtype=torch.uint8).numpy()
    view, done = memoryview(out), 0
    while done < t["bytes"]:
        got = os.preadv(fd, [view[done:]], t["offset"] + done)
        if not got:
            raise ModelLoadError(path, f"tensor {t['name']!r}: the file ends {t['bytes'] - done} bytes short")
        done += got
    return out


def _expert_blocks(data: np.ndarray, t: dict, names: list[str], cfg: ModelConfig, path: Path,
                   activations: str) -> dict[str, GGMLLinear]:
    """A stacked expert tensor's blocks as one GGMLLinear per expert over its slice of the mapped
    bytes (the experts are the slowest axis: each one's rows are contiguous)."""
    k, n, experts = t["shape"]  # GGUF order: in, out, experts
    _check_experts(t["name"], (experts, n, k), cfg, path)
    try:
        raw = torch.from_numpy(data).view(experts * n, row_bytes(t["type"], k))
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(path, f"tensor {t['name']!r}: {e}") from None
    return {name.removesuffix(".weight"): GGMLLinear(raw[e * n:(e + 1) * n], t["type"], k, n, activations=activations)
            for e, name in enumerate(names)}


def _matrix(data: np.ndarray, t: dict, path: Path) -> torch.Tensor:
    """A 2-D tensor dequantized to fp32 [out, in]."""
    k, n = t["shape"]
    try:
        w = np.asarray(dequantize(data, gguf.GGMLQuantizationType(t["type"])), dtype=np.float32).reshape(n, k)
    except Exception as e:
        raise ModelLoadError(path, f"cannot read tensor {t['name']!r} ({e})") from None
    return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


def _vector(data: np.ndarray, t: dict, cfg: ModelConfig, name: str, path: Path) -> torch.Tensor:
    """A 1-D tensor (norm gain, bias) dequantized to fp32, Gemma's norm offset removed."""
    try:
        w = np.asarray(dequantize(data, gguf.GGMLQuantizationType(t["type"])), dtype=np.float32).reshape(-1)
    except Exception as e:
        raise ModelLoadError(path, f"cannot read tensor {t['name']!r} ({e})") from None
    if cfg.family == "gemma3" and name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp stores Gemma norm weights as 1 + w
    return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
