"""EngineConfig: every knob of the engine, validated at construction.

`EngineConfig` is the flat surface users set (`LLM(**kwargs)`, the CLI flags); it resolves the
defaults, hands each part of the engine its own config (`cache_config`, `scheduler_config`,
`weights_config`, `speculative_config`, `streaming_config`), each of which validates its own
fields, and checks the combinations that span parts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from kvserve.loading.hub import parse_hub_name
from kvserve.loading.loader import DTYPES
from kvserve.model.attention import KV_CACHE_DTYPES
from kvserve.pooling_params import PoolerConfig
from kvserve.reasoning import PARSERS as REASONING_PARSERS

DEVICES = ("cpu", "cuda")
SPECULATIVE = ("ngram", "draft", "self")
# How many draft tokens a sequence asks for: always num_speculative_tokens, or HF transformers'
# assisted-generation heuristic (+2 after a step that kept every draft, -1 after one that did
# not; between 1 and num_speculative_tokens)
SPEC_SCHEDULES = ("constant", "heuristic")
WEIGHTS = ("float", "int8", "int4", "gguf")
GGUF_ACTIVATIONS = ("int8", "float")
# Multi-step decoding unrolls this many steps into every captured graph (start-up time and graph
# memory grow with it; past a few dozen steps the host's share of a token is already gone).
MAX_SCHEDULER_STEPS = 32


def _positive_int(owner: object, name: str, optional: bool = False) -> None:
    v = getattr(owner, name)
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _flag(owner: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(owner, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(owner, name)!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: page size, budget, storage format, prefix caching, release of blocks
    that leave a sliding window; `use_kv_cache=False` is the recompute-everything baseline."""

    block_size: int = 16
    kv_cache_gib: float | None = None  # None: automatic (kvserve/engine/builder.py auto_kv_bytes)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    use_kv_cache: bool = True
    sliding_window_release: bool = True

    def __post_init__(self) -> None:
        _positive_int(self, "block_size")
        gib = self.kv_cache_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0):
            raise ValueError(f"kv_cache_gib must be a positive number, got {gib!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _flag(self, "enable_prefix_caching", "use_kv_cache", "sliding_window_release")


@dataclass(frozen=True)
class SchedulerConfig:
    """One step's budget: sequences, tokens, the context cap (None: the model's), chunked prefill."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        _positive_int(self, "max_num_seqs")
        _positive_int(self, "max_num_batched_tokens")
        _positive_int(self, "max_model_len", optional=True)
        _positive_int(self, "num_scheduler_steps")
        if self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps must be at most {MAX_SCHEDULER_STEPS} (each step is captured "
                             f"into every CUDA graph), got {self.num_scheduler_steps}")
        _flag(self, "enable_chunked_prefill")


@dataclass(frozen=True)
class WeightsConfig:
    """How the weights are computed with (EngineConfig's comments say what each setting does)."""

    weights: str = "float"
    gguf_activations: str = "int8"
    gguf_mmap: bool = False
    pack_weights: bool = True
    compile: bool = False

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {GGUF_ACTIVATIONS}, got {self.gguf_activations!r}")
        _flag(self, "pack_weights", "compile", "gguf_mmap")
        if self.weights != "float" and self.compile:
            raise ValueError(f"compile covers float weights; weights {self.weights!r} run on kvserve's C kernels "
                             f"(drop compile, or use weights='float')")

    @property
    def low_bit(self) -> bool:
        return self.weights != "float"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: the proposer (None: off) and its settings."""

    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    self_draft_dtype: str | None = None
    self_draft_layers: int | None = None
    self_draft_bits: int | None = None
    num_speculative_tokens_schedule: str = "constant"
    draft_vocab: str | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE} or None, got {self.speculative!r}")
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            _positive_int(self, name)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        _positive_int(self, "self_draft_layers", optional=True)
        if self.self_draft_dtype is not None and self.self_draft_dtype not in DTYPES:
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
        if self.num_speculative_tokens_schedule not in SPEC_SCHEDULES:
            raise ValueError(f"num_speculative_tokens_schedule must be one of {SPEC_SCHEDULES}, "
                             f"got {self.num_speculative_tokens_schedule!r}")
        _positive_int(self, "draft_vocab_size", optional=True)
        if self.draft_vocab_size is not None and self.draft_vocab is None:
            raise ValueError("draft_vocab_size keeps the first N ids of a draft_vocab file: give draft_vocab too")
        if self.draft_vocab is not None and self.speculative not in ("self", "draft"):
            raise ValueError("draft_vocab is only used with a draft model (speculative='self' or 'draft')")

    @property
    def enabled(self) -> bool:
        return self.speculative is not None


@dataclass(frozen=True)
class StreamingConfig:
    """StreamingLLM: sinks plus a recent window per layer (streaming_window None: off)."""

    attention_sinks: int = 0
    streaming_window: int | None = None

    def __post_init__(self) -> None:
        a = self.attention_sinks
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise ValueError(f"attention_sinks must be an integer >= 0, got {a!r}")
        if self.streaming_window is None and a:
            raise ValueError("attention_sinks needs streaming_window (StreamingLLM keeps sinks + a recent window)")
        _positive_int(self, "streaming_window", optional=True)

    @property
    def enabled(self) -> bool:
        return self.streaming_window is not None


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor_parallel_size ranks, each a process holding 1/N of every
    layer (kvserve/engine/parallel/)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _positive_int(self, "tensor_parallel_size")

    @property
    def enabled(self) -> bool:
        return self.tensor_parallel_size > 1


def _may_name_a_gguf(model: str | os.PathLike) -> bool:
    """A .gguf path, or a Hugging Face name (ORG/NAME:QUANT is one; what ORG/NAME holds is
    known once it is resolved, and the loader checks it then)."""
    return str(model).endswith(".gguf") or parse_hub_name(str(model)) is not None


@dataclass
class EngineConfig:
    # GGUF file or HF folder, or a Hugging Face name found in the HF cache: ORG/NAME (an HF
    # model), ORG/NAME:QUANT (the repository's .gguf file holding QUANT, e.g. Q4_K_M); a local
    # path wins over a name. None = the bundled Gemma 3 270M.
    model: str | None = None
    # A name not in the HF cache is downloaded (huggingface_hub) instead of being an error.
    allow_download: bool = False
    device: str = "cpu"
    # Weights and activations: "auto" is float32 on the CPU (exact against HF transformers) and
    # bfloat16 on CUDA (half the bytes each decode step reads; tensor cores). On the CPU "auto"
    # stays "auto" here: an HF folder saved in bfloat16 / float16 keeps its linear weights and
    # embedding in that dtype, computing in float32 (kvserve/weights/half.py); `compute_dtype`.
    dtype: str = "auto"
    block_size: int = 16
    # KV pool budget. None: enough for max_model_len tokens in every layer, at most half the memory
    # still available once the weights are loaded (kvserve/engine/builder.py auto_kv_bytes).
    kv_cache_gib: float | None = None
    # How the pool stores K/V: "auto" (the model's dtype; with weights "gguf" and int8
    # activations, llama.cpp's arithmetic, fp16 as llama.cpp's cache); "fp16" / "bf16" / "fp32"
    # (rounded on write, computed in the model's dtype); "int8" or "fp8" (e4m3), both with one
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
    # `loaded` is copied first, not changed. "gguf": a GGUF file's own quantized blocks, read
    # from the memory-mapped file by kvserve's block kernels (kvserve/weights/ggml.py), never
    # dequantized to a float copy (`model` must be a .gguf file).
    weights: str = "float"
    # weights "gguf": "int8" quantizes each activation row per 32 values for integer dot products
    # with the blocks (llama.cpp's arithmetic; the fast path); "float" computes the float model's
    # products (the blocks dequantized in registers; slower, the tests' exact reference).
    gguf_activations: str = "int8"
    # weights "gguf": False reads the blocks into the process's own memory in 2 MB pages (decode
    # streams them with a TLB miss per 2 MB, not per 4 KB: faster on large files); True computes
    # from the memory-mapped file's pages, which the page cache shares with every other process
    # serving the same file (replicas on one host) and which start without a copy.
    gguf_mmap: bool = False
    # CPU fp32: keep every weight matrix (the tied LM head too) also packed for the decode-step
    # kernel (kvserve/accel/panels.py): 1.2-4x MKL for steps of 1-128 sequences, for one more
    # copy of the fp32 weights in memory. A model handed in as `loaded` gets its copies too. The
    # packed head also gets an int8 screen for greedy steps (kvserve/accel/greedy_head.py).
    # CUDA: time Triton matrix-vector kernels against cuBLAS for each projection of 1-4 rows
    # inside CUDA graphs and keep the faster (kvserve/accel/cuda_gemv.py); False: cuBLAS.
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
    # "constant": k every step; "heuristic": each sequence's own k, +2 after a step that kept all
    # its drafts, -1 after one that did not (1..k; HF transformers' num_assistant_tokens_schedule)
    num_speculative_tokens_schedule: str = "constant"
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
    # speculative="self" or "draft": the draft's head scores only the tokens of this file (JSON
    # from `kvserve draft-vocab`: ids ranked by their frequency in a corpus), its first
    # draft_vocab_size of them when given. The head of a large vocabulary is most of a small
    # draft's step; drafts then never propose a token outside the subset, and stay lossless.
    draft_vocab: str | None = None
    draft_vocab_size: int | None = None
    # StreamingLLM: every layer keeps the first `attention_sinks` tokens plus the last
    # `streaming_window` (a sliding layer: its last min(native window, sinks + window), no
    # sinks); keys are rotated by their rank in that cache, so generation can run past the
    # model's context with constant KV memory. None = off (the model's own attention).
    attention_sinks: int = 0
    streaming_window: int | None = None
    # CUDA: run decode steps eagerly, never through captured CUDA graphs (vLLM's flag). Graphs
    # are captured at start-up, one per batch-size bucket, for plain decode steps.
    enforce_eager: bool = False
    # CUDA graphs: K > 1 decodes plain greedy sequences K tokens per scheduling step, K steps in
    # one captured graph (vLLM's multi-step scheduling), so the host's per-step work is paid once
    # per K tokens; text streams K tokens at a time. Steps that sample, report logprobs or follow
    # a grammar, and the last tokens before max_tokens, decode one step at a time.
    num_scheduler_steps: int = 1
    # The engine's seed (vLLM's --seed): a request without a seed of its own samples from one
    # drawn from this seed's stream in arrival order, so the same requests sent to an engine
    # with the same seed sample the same tokens, whatever ran beside them. None: such requests
    # share the process's torch random state.
    seed: int | None = None
    # Embedding requests (PoolingParams, /v1/embeddings): how the final hidden states become one
    # vector, a PoolerConfig or a dict of its fields (vLLM's `--pooler-config`): pooling_type
    # "LAST" (default) or "MEAN", normalize (default True). Made a PoolerConfig at construction.
    pooler_config: PoolerConfig | dict | None = None
    # Tensor parallelism (vLLM's --tensor-parallel-size): N processes (rank 0 is this one), each
    # holding its share of the attention heads, the MLP and the vocabulary, bound to its share of
    # the cores (gloo on the CPU, NCCL on CUDA). Float weights only.
    tensor_parallel_size: int = 1
    # A thinking model's reasoning format (vLLM's --reasoning-parser: "qwen3", "deepseek_r1", <think>
    # blocks; kvserve/reasoning.py). A structured-output request whose prompt opens a block thinks
    # unconstrained; its grammar applies from the token that closes the block. None: from the start.
    reasoning_parser: str | None = None
    # The parts, made by __post_init__ from the fields above (not constructor arguments).
    cache_config: CacheConfig = field(init=False, repr=False, compare=False)
    scheduler_config: SchedulerConfig = field(init=False, repr=False, compare=False)
    weights_config: WeightsConfig = field(init=False, repr=False, compare=False)
    speculative_config: SpeculativeConfig = field(init=False, repr=False, compare=False)
    streaming_config: StreamingConfig = field(init=False, repr=False, compare=False)
    parallel_config: ParallelConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path, a Hugging Face name or None, got {type(self.model).__name__}")
        dev = str(self.device).split(":")[0]
        if dev not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype == "auto" and dev == "cuda":
            self.dtype = "bfloat16"
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {self.dtype!r}")
        _positive_int(self, "num_threads", optional=True)
        _flag(self, "enforce_eager", "allow_download")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS} or None, got {self.reasoning_parser!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.pooler_config = PoolerConfig.of(self.pooler_config)
        if self.weights == "fp32":  # llama.cpp's name for unquantized fp32 weights
            if self.dtype not in ("float32", "fp32", "auto"):
                raise ValueError(f"weights 'fp32' contradicts dtype {self.dtype!r}: use weights='float'")
            self.dtype, self.weights = "float32", "float"
        if self.kv_cache_dtype == "auto" and self.weights == "gguf" and self.gguf_activations == "int8":
            # The pool llama.cpp keeps beside the same arithmetic: half an fp32 pool's bytes and
            # faster decode attention, for a per-position KL of ~3e-7 (docs/BENCHMARKS.md)
            self.kv_cache_dtype = "fp16"
        self.cache_config = CacheConfig(**self._values(CacheConfig))
        self.scheduler_config = SchedulerConfig(**self._values(SchedulerConfig))
        self.weights_config = WeightsConfig(**self._values(WeightsConfig))
        self.speculative_config = SpeculativeConfig(**self._values(SpeculativeConfig))
        self.streaming_config = StreamingConfig(**self._values(StreamingConfig))
        self.parallel_config = ParallelConfig(**self._values(ParallelConfig))
        self._check_combinations(dev)

    @property
    def compute_dtype(self) -> str:
        """The dtype activations (and, but for a kept 16-bit checkpoint, weights) are in."""
        return "float32" if self.dtype == "auto" else self.dtype

    def _values(self, part: type) -> dict:
        """This config's values of the fields `part` has (the same names)."""
        return {f.name: getattr(self, f.name) for f in fields(part)}

    def _check_combinations(self, dev: str) -> None:
        """What spans parts: low-bit weights, speculation and StreamingLLM against each other, the
        device and the KV cache."""
        if self.weights != "float" and dev != "cpu":
            raise ValueError(f"weights {self.weights!r} run on kvserve's CPU kernels: device must be "
                             f"'cpu', got {self.device!r}")
        if self.weights == "gguf" and self.model is not None and not _may_name_a_gguf(self.model):
            raise ValueError(f"weights 'gguf' reads a GGUF file's own blocks: model must be a .gguf file, "
                             f"got {str(self.model)!r}")
        copy = self.self_draft_bits is not None or self.self_draft_dtype not in (None, self.compute_dtype)
        if self.weights != "float" and self.speculative == "self" and copy:
            raise ValueError(f"speculative='self' with weights {self.weights!r} drafts on the target's own layers "
                             f"(self_draft_layers, or all of them with a draft_vocab): self_draft_dtype / "
                             f"self_draft_bits would build a copy from float weights")
        if self.num_scheduler_steps > 1 and self.speculative is not None:
            raise ValueError(f"num_scheduler_steps {self.num_scheduler_steps} and speculative "
                             f"{self.speculative!r} both decode several tokens a step: use one of them")
        if self.speculative is not None and not self.use_kv_cache:
            raise ValueError("speculative decoding needs the KV cache (use_kv_cache=True)")
        if self.streaming_window is not None:
            if not self.use_kv_cache:
                raise ValueError("streaming_window needs the KV cache (use_kv_cache=True)")
            if self.speculative not in (None, "ngram"):
                raise ValueError(f"streaming_window works with speculative=None or 'ngram', not {self.speculative!r} "
                                 "(a draft model would need its own streaming cache)")

        if self.parallel_config.enabled:
            self._check_parallel()

    # Options a tensor-parallel engine does not run (yet), by field.
    _NOT_PARALLEL = {
        "speculative": "speculative decoding",
        "compile": "torch.compile (compile)",
        "streaming_window": "StreamingLLM (streaming_window)",
    }

    def _check_parallel(self) -> None:
        n = self.tensor_parallel_size
        for name, what in self._NOT_PARALLEL.items():
            if getattr(self, name) not in (None, False):
                raise ValueError(f"{name}: {what} is not supported with tensor_parallel_size {n}")
        if self.weights != "float":
            raise ValueError(f"weights {self.weights!r} is not supported with tensor_parallel_size {n}: the "
                             "shards split float weights (weights='float')")

    @classmethod
    def field_names(cls) -> list[str]:
        """The constructor's arguments."""
        return [f.name for f in fields(cls) if f.init]
