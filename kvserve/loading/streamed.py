"""`load_quantized_streaming`: EngineConfig.weights int8 / int4 without ever holding the float
model. The model is built on the meta device; its embedding, final norm and head are read, then
block by block the block's tensors are read from the safetensors files (plain reads, see
kvserve/loading/tensors.py), placed in fp32 and RTN-quantized (kvserve/weights/quantize.py `engine_quantize`) before the next block is
read. The peak is the quantized model plus one block's fp32 weights plus the float embedding and
head (kept as stored, bf16 for a bf16 checkpoint, until they are quantized last), instead of the
whole fp32 model. The result is bit for bit that of loading in fp32 and quantizing
(tests/test_streamed_quantize.py): RTN reads each weight widened to fp32 either way.

Sources: a plain HF folder, and a GGUF file's fp32 safetensors cache (kvserve/loading/gguf.py).
Quantized or N:M-compressed folders are not streamed (None: the caller loads them whole).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from kvserve.kernels.host_memory import release_freed_memory
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf import load_gguf
from kvserve.loading.hf import hf_tensor_files, read_hf_config
from kvserve.loading.loader import (
    LoadedModel,
    check_tensors,
    compute_dtype,
    finish_model,
    resolve_model_path,
)
from kvserve.loading.quantized import read_quantization_config
from kvserve.loading.sparse_nm import read_sparsity_config
from kvserve.loading.tensors import TensorFiles
from kvserve.loading.tokenizer import Tokenizer
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.registry import empty_model
from kvserve.weights.quantize import QuantizeReport, engine_quantize

log = logging.getLogger(__name__)

# A quantizer over a skeleton whose blocks `prepare(model, i)` places: kvserve/weights/quantize.py
# `engine_quantize`, or the toolbox's RTN (kvserve/compress/quant/cli.py).
Quantize = Callable[[torch.nn.Module, Callable[[torch.nn.Module, int], None]], QuantizeReport]


def streamable_source(path: Path) -> tuple[ModelConfig, TensorFiles, Path] | None:
    """(config, tensors, tokenizer file) of a source whose float tensors can be read one at a
    time: a plain HF folder or a GGUF file (its fp32 cache, converted once); None otherwise."""
    if path.is_dir():
        if read_quantization_config(path) is not None or read_sparsity_config(path) is not None:
            return None
        cfg = read_hf_config(path)
        return cfg, hf_tensor_files(path, cfg), path / "tokenizer.json"
    if path.suffix == ".gguf":
        cfg, weights, tok_file = load_gguf(path)
        return cfg, TensorFiles([weights]), tok_file
    return None


def _block_index(name: str) -> int | None:
    """i of a tensor "layers.{i}.…", None for the others (embedding, final norm, head)."""
    if not name.startswith("layers."):
        return None
    head = name.split(".", 2)[1]
    return int(head) if head.isdigit() else None


def skeleton_with_ends(cfg: ModelConfig, files: TensorFiles, dtype: torch.dtype, source: Path
                       ) -> tuple[CausalLM, dict[int, list[str]]]:
    """The model on the meta device, names and shapes checked against the files, its tensors
    outside the blocks placed (the embedding and head as stored: they are quantized from
    there; norms in `dtype`); and each block's tensor names, to place later."""
    model = empty_model(cfg)
    check_tensors(model, {n: files.shape(n) for n in files.names()}, source)
    blocks: dict[int, list[str]] = {}
    ends = {}
    for name in files.names():
        i = _block_index(name)
        if i is None:
            t = files.read(name)
            ends[name] = t if name in ("embed_tokens.weight", "lm_head.weight") else t.to(dtype)
        else:
            blocks.setdefault(i, []).append(name)
    model.load_state_dict(ends, assign=True, strict=False)
    return model, blocks


def block_placer(files: TensorFiles, blocks: dict[int, list[str]], dtype: torch.dtype
                 ) -> Callable[[torch.nn.Module, int], None]:
    """prepare(model, i): read block i's tensors and place them in `dtype`."""
    def place(model: torch.nn.Module, i: int) -> None:
        # The last block's fp32 copies are freed: hand the heap's free pages back before the next
        # block is read, or freed holes between the kept codes add up block after block.
        release_freed_memory()
        prefix = f"layers.{i}."
        tensors = {n.removeprefix(prefix): files.read(n, dtype) for n in blocks.get(i, [])}
        model.layers[i].load_state_dict(tensors, assign=True, strict=True)

    return place


def stream_quantize(path: Path, quantize: Quantize, dtype: torch.dtype = torch.float32
                    ) -> tuple[LoadedModel, QuantizeReport] | None:
    """The model at `path` quantized block by block as it is read (see the module doc) by
    `quantize(skeleton, prepare)`; None when the source cannot be streamed."""
    found = streamable_source(path)
    if found is None:
        return None
    cfg, files, tok_file = found
    if not tok_file.exists():
        raise ModelLoadError(tok_file, "tokenizer.json not found")
    tokenizer = Tokenizer.from_file(tok_file, cfg.eos_token_ids, cfg.bos_token_id,
                                    gguf_source=path if path.suffix == ".gguf" else None, add_bos=cfg.add_bos_token)
    model, blocks = skeleton_with_ends(cfg, files, dtype, path)
    report = quantize(model, block_placer(files, blocks, dtype))
    release_freed_memory()
    left = [n for n, t in model.state_dict().items() if t.is_meta]
    if left:
        raise ModelLoadError(path, f"tensors left unplaced after quantizing: {left[:5]}")
    emb = model.embed_tokens
    if getattr(emb, "dtype", dtype) != dtype:  # a lookup made from a table kept as stored
        emb.dtype = dtype
    elif isinstance(emb, torch.nn.Embedding) and emb.weight.dtype != dtype:
        emb.weight = torch.nn.Parameter(emb.weight.to(dtype), requires_grad=False)
    if model.lm_head is not None and isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype != dtype:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.to(dtype), requires_grad=False)
    return LoadedModel(finish_model(model, cfg, "cpu"), cfg, tokenizer, path), report


def load_quantized_streaming(model: str | Path | None, kind: str, dtype: str | torch.dtype = "auto",
                             allow_download: bool = False) -> LoadedModel | None:
    """EngineConfig.weights int8 / int4 loaded layer by layer (CPU): the same model as
    `load_model` then kvserve/engine/builder.py `low_bit_weights`, without the float copy; None
    when the source cannot be streamed (a quantized or N:M folder)."""
    path = resolve_model_path(model, allow_download)
    t = time.perf_counter()
    out = stream_quantize(path, lambda m, prepare: engine_quantize(m, kind, path, prepare), compute_dtype(dtype))
    if out is None:
        return None
    log.info("weights %s: read and RTN-quantized block by block (every linear, the LM head and the embedding) "
             "in %.1f s", kind, time.perf_counter() - t)
    return out[0]
