"""EngineConfig: every knob of the engine, validated at construction."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

DEVICES = ("cpu", "cuda")


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
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_gib: float | None = None  # KV pool budget; None = _default_kv_cache_gib()
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    use_kv_cache: bool = True  # False: recompute the whole sequence every step (the O(T^2) baseline)
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or None, got {type(self.model).__name__}")
        dev = str(self.device).split(":")[0]
        if dev not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        from kvserve.loading.loader import DTYPES  # validation only

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
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "use_kv_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _positive_int(self, name: str) -> None:
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
