"""What LLMEngine is built from: the weights as computed, the context cap, the KV pool and its
layer groups, StreamingLLM's policies, CUDA graphs.

Each function takes the config it reads (a part of the EngineConfig, or the whole one where a
decision spans parts) and the model (or its config) and returns one part, so the engine's
constructor reads as its list of steps and each decision sits in one function with its reason.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import torch

from kvserve.accel.prepare import fast_path_nbytes, prepare_model
from kvserve.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StreamingConfig,
)
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.scheduler import Scheduler
from kvserve.kernels.host_memory import available_memory_bytes, keep_freed_memory
from kvserve.loading import LoadedModel, load_model
from kvserve.loading.footprint import state_pool_footprint, weight_footprint
from kvserve.loading.loader import build_model, resolve_model_path
from kvserve.loading.streamed import load_quantized_streaming
from kvserve.model.attention import KVCache
from kvserve.model.base import stored_weight_bytes
from kvserve.model.config import LayerGroup, ModelConfig, kv_layer_groups
from kvserve.model.state_cache import StateCache
from kvserve.model.streaming import StreamPolicy, layer_policies
from kvserve.weights.ggml import GGMLLinear
from kvserve.weights.linear import QuantLinear
from kvserve.weights.quantize import engine_quantize

log = logging.getLogger(__name__)
# StreamingLLM's default context cap: a position is only a stream index there (the model sees
# ranks in its bounded cache), so this bounds bookkeeping, not memory. --max-model-len changes it.
STREAMING_MAX_MODEL_LEN = 1 << 20
# The automatic KV pool takes at most this share of the memory available once the weights are in.
AUTO_KV_SHARE = 0.5


class InsufficientMemoryError(MemoryError):
    """The model and its KV pool will not fit in the memory available; raised before loading."""


@dataclasses.dataclass
class KVPool:
    """The paged KV cache and how the block manager counts it."""

    cache: KVCache
    page_bytes: int  # one page: block_size tokens of K and V for one layer group's layers
    num_blocks: int  # pages the block manager hands out (a CUDA-graph padding page is not one)


def set_up_host(cfg: EngineConfig) -> None:
    """Process-wide settings the engine's steps rely on."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if torch.device(cfg.device).type == "cpu":
        keep_freed_memory()  # no page faults on each step's large temporaries


def model_path(cfg: EngineConfig) -> Path:
    """The file or folder cfg.model names (a path, a Hugging Face name found in the HF cache or
    downloaded when cfg.allow_download, or the bundled model), resolved once per engine."""
    return resolve_model_path(cfg.model, cfg.allow_download)


def check_memory(cfg: EngineConfig, path: Path) -> None:
    """Refuse, before anything loads, a CPU engine whose weights (as cfg.weights keeps them, from
    the headers of `path`, the model's files) and explicit KV pool exceed the memory available,
    naming the numbers. Skipped where the available memory cannot be read, or the path does not
    exist (the load names that problem)."""
    available = available_memory_bytes()
    if torch.device(cfg.device).type != "cpu" or available is None or not path.exists():
        return
    w = cfg.weights_config
    weights = weight_footprint(path, w.weights, cfg.dtype, w.pack_weights and not w.compile)
    kv = int(cfg.kv_cache_gib * 2**30) if cfg.kv_cache_gib is not None else 0
    state = state_pool_footprint(path, cfg.max_num_seqs, cfg.dtype, cfg.device)
    if weights + kv + state > available:
        kv_part = f" + KV pool {kv / 1e9:.2f} GB (--kv-cache-gib)" if kv else ""
        state_part = f" + recurrent state pool {state / 1e9:.2f} GB (--max-num-seqs slots)" if state else ""
        raise InsufficientMemoryError(
            f"{path.name}: weights {weights / 1e9:.2f} GB as --weights {w.weights} keeps them{kv_part}{state_part} = "
            f"{(weights + kv + state) / 1e9:.2f} GB, but {available / 1e9:.2f} GB of memory is available; use a "
            f"smaller --kv-cache-gib, --weights gguf (a GGUF's own blocks) or int4, or --no-pack-weights")


def load_weights(cfg: EngineConfig, loaded: LoadedModel | None, path: Path | None) -> LoadedModel:
    """The model as the engine computes with it: `loaded` (else the model at `path`, loaded here),
    low-bit when cfg.weights asks, then prepared with the fast paths the configuration allows
    (kvserve/accel/prepare.py)."""
    w = cfg.weights_config
    if w.weights == "gguf":
        if loaded is None:
            loaded = load_model(path, cfg.dtype, cfg.device, gguf_blocks=True, gguf_activations=w.gguf_activations,
                                gguf_mmap=w.gguf_mmap)
        elif not any(isinstance(m, GGMLLinear) for m in loaded.model.modules()):
            raise ValueError("weights 'gguf' reads a GGUF file's own blocks: give model= (a .gguf file), or "
                             "loaded=load_model(path, gguf_blocks=True), not a model loaded as floats")
        prepare_model(loaded.model, cfg.device, pack=w.pack_weights)
        return loaded
    if loaded is None and w.low_bit:  # quantized as it is read, block by block, when the source allows
        streamed = load_quantized_streaming(path, w.weights, cfg.dtype)
        if streamed is not None:
            prepare_model(streamed.model, cfg.device, pack=w.pack_weights, head_only=w.compile, low_bit=True)
            return streamed
    out = low_bit_weights(loaded or load_model(path, cfg.dtype, cfg.device), w.weights, cfg.device,
                          owned=loaded is None)
    prepare_model(out.model, cfg.device, pack=w.pack_weights, head_only=w.compile, low_bit=w.low_bit)
    return out


def low_bit_weights(loaded: LoadedModel, kind: str, device: str, owned: bool) -> LoadedModel:
    """EngineConfig.weights int8 / int4: RTN-quantize every linear layer, the LM head and the
    embedding, onto the int8 / int4 kernels of kvserve/weights/linear.py (a copy when the caller
    owns the model)."""
    if kind == "float":
        return loaded
    model = loaded.model
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError(f"weights {kind!r}: {loaded.source} is already quantized (a kvserve quant folder); "
                         "weights int8 / int4 quantize a float model when the engine starts")
    if not owned:
        dtype = next(model.parameters()).dtype
        model = build_model(loaded.config, model.state_dict(), dtype, device, loaded.source)
    t = time.perf_counter()
    engine_quantize(model, kind, loaded.source)
    log.info("weights %s: RTN-quantized every linear, the LM head and the embedding in %.1f s", kind,
             time.perf_counter() - t)
    return dataclasses.replace(loaded, model=model)


def check_model(cfg: EngineConfig, mc: ModelConfig) -> None:
    """Refuse the options the model's KV layout cannot serve. MLA caches one latent per token: no
    per-head K/V for KV quantization or StreamingLLM. StreamingLLM keeps a per-layer rank-rotated
    cache; a layer reusing another's K/V (cross-layer sharing) has none. An MoE model is not
    traced (compile)."""
    if mc.mla and cfg.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {cfg.kv_cache_dtype!r} is not supported for MLA models "
                         f"({mc.model_type}): use 'auto'")
    if mc.mla and cfg.streaming_window is not None:
        raise ValueError(f"streaming_window is not supported for MLA models ({mc.model_type})")
    if mc.kv_source is not None and cfg.streaming_window is not None:
        raise ValueError("streaming_window is not supported for models with cross-layer KV sharing "
                         "(config kvserve_kv_source)")
    if mc.moe is not None and cfg.compile:
        # the expert dispatch sizes its matmuls by the step's routing (data-dependent shapes)
        raise ValueError(f"compile is not supported for mixture-of-experts models ({mc.model_type})")
    if mc.is_hybrid:
        check_hybrid(cfg, mc)


def check_hybrid(cfg: EngineConfig, mc: ModelConfig) -> None:
    """What a model with recurrent (Mamba) layers cannot do yet, refused by option: its state
    advances token by token and cannot be rolled back (speculative decoding rejects drafts) or
    windowed (StreamingLLM); the compiled graph, CUDA graphs and tensor-parallel workers know
    only the paged KV pool. (Prefix caching is turned off instead: see `block_manager`.)"""
    refused = [(cfg.speculative is not None, f"speculative {cfg.speculative!r}"),
               (cfg.streaming_window is not None, "streaming_window"),
               (cfg.compile, "compile"),
               (cfg.parallel_config.enabled, "tensor_parallel_size > 1")]
    for bad, option in refused:
        if bad:
            raise ValueError(f"{option} is not supported for hybrid models with recurrent layers "
                             f"({mc.model_type}: {len(mc.mamba_layers)} Mamba layers)")


def state_pool(cfg: SchedulerConfig, device: str, mc: ModelConfig, dtype: torch.dtype) -> StateCache | None:
    """A hybrid model's recurrent state pool: one slot per sequence that may run at once
    (max_num_seqs; the scheduler never admits a sequence, or a request's n samples, without free
    slots). None for a model without recurrent layers."""
    if not mc.is_hybrid:
        return None
    cache = StateCache(mc.mamba_layers, cfg.max_num_seqs, mc.mamba_conv_dim, mc.mamba_d_conv, mc.mamba_n_heads,
                       mc.mamba_head_dim, mc.mamba_d_state, dtype, device)
    log.info("recurrent state pool: %d slots x %.2f MiB (%d Mamba layers: conv + SSM state) = %.2f GiB",
             cache.num_slots, cache.slot_nbytes / 2**20, len(mc.mamba_layers), cache.nbytes / 2**30)
    return cache


def stream_policies(streaming: StreamingConfig, mc: ModelConfig) -> list[StreamPolicy] | None:
    """StreamingLLM's per-layer policies (None when off). The ranks given to cached keys
    must stay within the positions the model was trained on."""
    if not streaming.enabled:
        return None
    budget = streaming.attention_sinks + streaming.streaming_window
    if budget > mc.max_position_embeddings:
        raise ValueError(f"attention_sinks + streaming_window = {budget} exceeds the model's context "
                         f"(max_position_embeddings {mc.max_position_embeddings})")
    return layer_policies(mc, streaming.attention_sinks, streaming.streaming_window)


def max_model_len(cfg: SchedulerConfig, mc: ModelConfig, policies: list[StreamPolicy] | None) -> int:
    """The context cap: the model's trained context, or with StreamingLLM (whose positions
    are ranks in a bounded cache) what the user asks, by default STREAMING_MAX_MODEL_LEN."""
    if policies is not None:
        return cfg.max_model_len or STREAMING_MAX_MODEL_LEN
    return min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)


def layer_groups(cfg: EngineConfig, mc: ModelConfig, policies: list[StreamPolicy] | None) -> list[LayerGroup]:
    """KV layer groups: with sliding-window release, full and sliding layers get separate
    block tables so sliding ones can return their old blocks. Off without a KV cache (that
    baseline recomputes from position 0 into the same blocks) and with a separate draft
    model (its layers do not map onto the target's groups; it shares group 0's table).
    With StreamingLLM every layer reads only sinks + its window: one group of every layer
    whose window is the longest any layer looks back (its sink blocks are kept too)."""
    if policies is not None:
        lookback = max(p.window for p in policies)
        return [LayerGroup(tuple(range(mc.num_layers)), lookback)]
    release = cfg.sliding_window_release and cfg.use_kv_cache and cfg.speculative != "draft"
    return kv_layer_groups(mc, release)


def auto_kv_bytes(max_len: int, page_bytes: int, num_groups: int, block_size: int, available: int | None) -> int:
    """The automatic pool: max_len tokens in every layer group (sliding groups release blocks,
    so this holds more than one full-length sequence), at most AUTO_KV_SHARE of the memory
    available now (the weights are in); where that cannot be read, at most a tenth of physical
    memory and 4 GiB."""
    want = num_groups * math.ceil(max_len / block_size) * page_bytes
    if available is not None:
        return int(min(want, AUTO_KV_SHARE * available))
    try:
        cap = min(4 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10)
    except (ValueError, OSError, AttributeError):
        cap = 2 << 30
    return min(want, cap)


def kv_page_bytes(cfg: CacheConfig, mc: ModelConfig, groups: list[LayerGroup], kv_dtype: torch.dtype) -> int:
    """Bytes of one page of the KV pool: block_size tokens of K and V for one layer group's layers."""
    heads, k_dim, v_dim = mc.kv_cache_layout  # MLA: latent + RoPE key
    per_token_head = KVCache.bytes_per_token_head(k_dim, kv_dtype, cfg.kv_cache_dtype, v_dim)
    return len(groups[0].layers) * heads * per_token_head * cfg.block_size


def kv_pool(cfg: CacheConfig, device: str, mc: ModelConfig, groups: list[LayerGroup], kv_dtype: torch.dtype,
            pad_page: bool, max_len: int) -> KVPool:
    """As many pages as kv_cache_gib holds, or the automatic budget (auto_kv_bytes: CPU memory;
    on CUDA a fixed 2 GiB) when it is None; at least one page per layer group. `pad_page`: one
    page more past the block manager's pool, which a captured decode step's padding rows write into."""
    heads, k_dim, v_dim = mc.kv_cache_layout  # MLA: latent + RoPE key
    page_bytes = kv_page_bytes(cfg, mc, groups, kv_dtype)
    if cfg.kv_cache_gib is not None:
        budget = cfg.kv_cache_gib * 2**30
    elif torch.device(device).type == "cpu":
        budget = auto_kv_bytes(max_len, page_bytes, len(groups), cfg.block_size, available_memory_bytes())
    else:
        budget = 2 << 30
    num_blocks = max(len(groups), int(budget // page_bytes))
    cache = KVCache(mc.num_layers, (num_blocks + int(pad_page)) * cfg.block_size, heads, k_dim,
                    kv_dtype, device, layer_groups=[g.layers for g in groups],
                    kv_dtype=cfg.kv_cache_dtype, v_head_dim=v_dim, kv_source=mc.kv_source,
                    kv_layers=mc.kv_layers)
    return KVPool(cache, page_bytes, num_blocks)


def kv_cache_args(cfg: CacheConfig, mc: ModelConfig, groups: list[LayerGroup], kv_dtype: torch.dtype,
                  num_slots: int) -> dict:
    """KVCache's arguments (but the device) for a pool of `num_slots` slots as `kv_pool` builds
    it: what a tensor-parallel worker builds at its local heads, page for page."""
    heads, k_dim, v_dim = mc.kv_cache_layout
    return dict(num_layers=mc.num_layers, num_slots=num_slots, num_kv_heads=heads, head_dim=k_dim, dtype=kv_dtype,
                layer_groups=[g.layers for g in groups], kv_dtype=cfg.kv_cache_dtype, v_head_dim=v_dim,
                kv_source=mc.kv_source, kv_layers=mc.kv_layers)


def block_manager(cfg: CacheConfig, streaming: StreamingConfig, num_blocks: int,
                  groups: list[LayerGroup], states: StateCache | None = None) -> BlockManager:
    """Prefix caching needs a KV cache to hit; sink_tokens is 0 unless streaming (StreamingConfig checks).
    A hybrid model (`states`: its recurrent state pool) gets no prefix caching: a cached prefix
    holds the attention layers' K/V but no recurrent state at its end, so a hit would skip tokens
    the Mamba layers never saw (turned off with a log line, as vLLM did before it saved states)."""
    prefix = cfg.enable_prefix_caching and cfg.use_kv_cache
    if prefix and states is not None:
        log.info("prefix caching is off: the model has recurrent layers, whose state a cached prefix does not hold")
        prefix = False
    return BlockManager(num_blocks, cfg.block_size, enable_prefix_caching=prefix,
                        group_windows=[g.window for g in groups], sink_tokens=streaming.attention_sinks,
                        num_state_slots=0 if states is None else states.num_slots)


def cap_max_model_len(max_len: int, bm: BlockManager, cfg: SchedulerConfig, keep_all: bool) -> int:
    """A lone sequence must always be able to run to its end: cap the context to what the
    pool holds for one sequence at its peak (`keep_all`: a separate draft cache, which may lag
    the target, holds sliding-window release back: then every group keeps every block)."""
    cap = bm.max_tokens_per_seq(cfg.max_num_batched_tokens, keep_all=keep_all)
    if cap is not None and max_len > cap:
        # A sequence can never outgrow the pool; cap the context rather than fail mid-request.
        log.warning("max_model_len %d exceeds what the KV pool holds for one sequence (%d tokens); capping it "
                    "(raise --kv-cache-gib)", max_len, cap)
        return cap
    return max_len


def log_pool(cfg: CacheConfig, groups: list[LayerGroup], num_blocks: int, cache: KVCache) -> None:
    bs = cfg.block_size
    sliding = [g for g in groups if g.window is not None]
    layout = (f"{len(groups)} layer groups of {len(groups[0].layers)} layers: {len(groups) - len(sliding)} full, "
              f"{len(sliding)} sliding (window {sliding[0].window}, blocks outside it are released)"
              if sliding else "one layer group, every layer keeps every block")
    log.info("KV pool (%s): %d pages x %d tokens = %d page-tokens, %d tokens of all layers (%.2f GiB); %s",
             cfg.kv_cache_dtype, num_blocks, bs, num_blocks * bs, num_blocks // len(groups) * bs,
             cache.nbytes / 2**30, layout)


def log_memory(model: torch.nn.Module, cache: KVCache, states: StateCache | None = None) -> None:
    """What the engine holds, planned at start: weights as stored, the fast paths' copies, the KV
    pool, a hybrid model's recurrent state pool."""
    weights, copies = stored_weight_bytes(model), fast_path_nbytes(model)
    state = 0 if states is None else states.nbytes
    state_part = "" if states is None else f", state pool {state / 1e9:.2f} GB"
    log.info("memory: weights %.2f GB, fast-path copies %.2f GB, KV pool %.2f GB%s; %.2f GB in all",
             weights / 1e9, copies / 1e9, cache.nbytes / 1e9, state_part,
             (weights + copies + cache.nbytes + state) / 1e9)


def scheduler(cfg: SchedulerConfig, spec: SpeculativeConfig, bm: BlockManager, max_len: int) -> Scheduler:
    """Slots past a decode's token are reserved only when a drafter will fill them, or for the
    further steps of multi-step decoding."""
    lookahead = spec.num_speculative_tokens if spec.enabled else cfg.num_scheduler_steps - 1
    return Scheduler(bm, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                     max_model_len=max_len, enable_chunked_prefill=cfg.enable_chunked_prefill,
                     num_lookahead_slots=lookahead)


def cuda_graphs_fit(cfg: EngineConfig, mc: ModelConfig, policies: list[StreamPolicy] | None) -> bool:
    """The configuration has the decode steps a graph captures: float weights and the model's own
    paged attention over an unquantized pool (the kernels that read lengths from memory), unless
    enforce_eager; not under tensor parallelism (a captured step would hold the all-reduces)."""
    return (not cfg.enforce_eager and not cfg.compile and not cfg.parallel_config.enabled
            and cfg.weights == "float" and cfg.kv_cache_dtype == "auto" and cfg.use_kv_cache
            and policies is None and not mc.mla and not mc.is_hybrid and mc.moe is None)


def capture_cuda_graphs(model: torch.nn.Module, cache: KVCache, cfg: EngineConfig, max_len: int,
                        pad_block: int) -> DecodeGraphs:
    """Decode steps of each batch bucket captured once; padding rows write into page `pad_block`."""
    t = time.perf_counter()
    graphs = DecodeGraphs(model, cache, cfg.block_size, max_len, cfg.max_num_seqs, pad_block=pad_block,
                          num_steps=cfg.num_scheduler_steps)
    graphs.capture()
    steps = f" (and runs of {graphs.num_steps} steps)" if graphs.num_steps > 1 else ""
    log.info("CUDA graphs: decode steps%s of %s sequences captured in %.1f s", steps, graphs.buckets,
             time.perf_counter() - t)
    return graphs
