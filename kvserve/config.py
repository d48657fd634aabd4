"""EngineConfig: every knob of the engine, validated at construction."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from kvserve.loading.loader import DTYPES
from kvserve.model.attention import KV_CACHE_DTYPES

DEVICES = ("cpu", "cuda")
SPECULATIVE = ("ngram", "draft", "self")
WEIGHTS = ("float", "int8", "int4")


def _default_kv_cache_gib() -> float:
    """A tenth of physical memory, capped at 4 GiB: ample for a 270M model on a laptop."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2.0
    return round(min(4.0, total / 2**30 / 10), 2)


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or HF folder; None = the bundled Gemma 3 270M
    device: str = "cpu"
    # Weights and activations: "auto" is float32 on the CPU (exact against HF transformers) and
    # bfloat16 on CUDA (half the bytes each decode step reads; tensor cores).
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_gib: float | None = None  # KV pool budget; None = _default_kv_cache_gib()
    # How the pool stores K/V: "auto" (the model's dtype), "int8" or "fp8" (e4m3), both with one
    # fp32 scale per token and KV head, dequantized when attention reads them.
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    use_kv_cache: bool = True  # False: recompute the whole sequence every step (the O(T^2) baseline)
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    # Weights as computed: "float" (as loaded, in `dtype`), or quantized when the engine starts,
    # RTN onto the CPU low-bit kernels (kvserve/weights/linear.py): "int8" per output channel,
    # symmetric; "int4" asymmetric, groups of 128 (64 or 32 where 128 does not divide a width).
    # Every linear layer, the LM head and the token embedding included. A model handed in as
    # `loaded` is copied first, not changed.
    weights: str = "float"
    # CPU fp32: keep every weight matrix (the tied LM head too) also packed for the decode-step
    # kernel (kvserve/accel/panels.py): 1.2-4x MKL for steps of 1-128 sequences, for one more
    # copy of the fp32 weights in memory. A model handed in as `loaded` gets its copies too. The
    # packed head also gets an int8 screen for greedy steps (kvserve/accel/greedy_head.py).
    pack_weights: bool = True
    # Every full forward pass through torch.compile (inductor), dynamic in the token count, with
    # each layer's K/V write and paged attention one opaque op (kvserve/accel/compiled.py). The
    # body's matmuls are then PyTorch's (of the packed copies only the LM head's is kept); the
    # first step of each shape class (one token, several) pays the compile. Float weights only.
    compile: bool = False
    # Sliding-window layers give back the KV blocks that fall wholly out of their window (one
    # block table per layer group, see kvserve/model/config.py `kv_layer_groups`). False = every
    # layer keeps every block (one table), the behaviour before; also off without a KV cache
    # and with a separate draft model (speculative="draft").
    sliding_window_release: bool = True
    # Speculative decoding: None (off), "ngram" (prompt lookup), "draft" (a smaller model sharing
    # the tokenizer) or "self" (the target's own first layers: early exit).
    speculative: str | None = None
    num_speculative_tokens: int = 4  # k: tokens proposed (and verified in one pass) per step
    speculative_model: str | None = None  # the draft model for speculative="draft"
    ngram_min: int = 1  # prompt lookup: shortest suffix n-gram to match
    ngram_max: int = 4  # longest suffix n-gram to match (tried first)
    # speculative="self": a copy of the target in this dtype (default bfloat16 for a float32
    # target), and/or an early exit after self_draft_layers layers (default: all layers for a
    # copy, a third of them without one).
    self_draft_dtype: str | None = None
    self_draft_layers: int | None = None
    # speculative="self": a low-bit copy instead (the lecture's compressed model as its own
    # draft): RTN int4 (group 128) or int8 (per channel) of every linear, the LM head included.
    self_draft_bits: int | None = None
    # StreamingLLM: every layer keeps the first `attention_sinks` tokens plus the last
    # `streaming_window` (a sliding layer: its last min(native window, sinks + window), no
    # sinks); keys are rotated by their rank in that cache, so generation can run past the
    # model's context with constant KV memory. None = off (the model's own attention).
    attention_sinks: int = 0
    streaming_window: int | None = None
    # CUDA: run decode steps eagerly, never through captured CUDA graphs (vLLM's flag). Graphs
    # are captured at start-up, one per batch-size bucket, for plain decode steps.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or None, got {type(self.model).__name__}")
        dev = str(self.device).split(":")[0]
        if dev not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

        if self.dtype == "auto":
            self.dtype = "bfloat16" if dev == "cuda" else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            self._positive_int(name)
        for name in ("max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                self._positive_int(name)
        if self.kv_cache_gib is None:
            self.kv_cache_gib = _default_kv_cache_gib()
        if isinstance(self.kv_cache_gib, bool) or not isinstance(self.kv_cache_gib, (int, float)) or not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be a positive number, got {self.kv_cache_gib!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "use_kv_cache", "sliding_window_release",
                     "pack_weights", "compile", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        self._check_weights()
        self._check_speculative()
        self._check_streaming()

    def _check_weights(self) -> None:
        if self.weights == "fp32":  # the issue's / llama.cpp's name for unquantized fp32 weights
            if self.dtype not in ("float32", "fp32"):
                raise ValueError(f"weights 'fp32' contradicts dtype {self.dtype!r}: use weights='float'")
            self.weights = "float"
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.weights == "float":
            return
        if self.compile:
            raise ValueError(f"compile covers float weights; weights {self.weights!r} run on kvserve's C int kernels "
                             f"(drop compile, or use weights='float')")
        if str(self.device).split(":")[0] != "cpu":
            raise ValueError(f"weights {self.weights!r} run on PyTorch's CPU int8 / int4 kernels: device must be "
                             f"'cpu', got {self.device!r}")
        if self.speculative == "self":
            raise ValueError(f"speculative='self' builds its own draft copy from float weights; it does not "
                             f"combine with weights {self.weights!r} (use self_draft_bits for a low-bit draft)")

    def _check_streaming(self) -> None:
        a = self.attention_sinks
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ValueError(f"attention_sinks must be an integer >= 0, got {a!r}")
        if self.streaming_window is None:
            if a:
                raise ValueError("attention_sinks needs streaming_window (StreamingLLM keeps sinks + a recent window)")
            return
        self._positive_int("streaming_window")
        if not self.use_kv_cache:
            raise ValueError("streaming_window needs the KV cache (use_kv_cache=True)")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"streaming_window works with speculative=None or 'ngram', not {self.speculative!r} "
                             "(a draft model would need its own streaming cache)")

    def _check_speculative(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE} or None, got {self.speculative!r}")
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            self._positive_int(name)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if self.self_draft_layers is not None:
            self._positive_int("self_draft_layers")
        if self.self_draft_dtype is not None:
            if self.self_draft_dtype not in DTYPES:
                raise ValueError(f"self_draft_dtype must be one of {sorted(DTYPES)}, got {self.self_draft_dtype!r}")
        if self.self_draft_bits is not None and self.self_draft_bits not in (4, 8):
            raise ValueError(f"self_draft_bits must be 4 or 8, got {self.self_draft_bits!r}")
        if self.speculative != "self" and (self.self_draft_dtype or self.self_draft_layers or self.self_draft_bits):
            raise ValueError("self_draft_dtype / self_draft_layers / self_draft_bits are only used with "
                             "speculative='self'")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError("speculative_model is required with speculative='draft' (a GGUF file or HF folder)")
        if self.speculative_model is not None and self.speculative != "draft":
            raise ValueError("speculative_model is only used with speculative='draft'")
        if self.speculative is not None and not self.use_kv_cache:
            raise ValueError("speculative decoding needs the KV cache (use_kv_cache=True)")

    def _positive_int(self, name: str) -> None:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
