"""Embedding requests (vLLM's names): how a prompt's final hidden states become one vector.

`PoolerConfig` is the engine's setting (`EngineConfig.pooler_config`, `kvserve serve
--pooler-config`); `PoolingParams` is one request's. The hidden states pooled are the last
layer's after the final norm, the rows the LM head reads.
"""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN")


@dataclass(frozen=True)
class PoolerConfig:
    """`pooling_type`: "LAST" (the last prompt token's hidden state, what a causal model has seen
    the whole prompt at; vLLM's default for decoder models) or "MEAN" (the average over every
    prompt token). `normalize`: scale each embedding to unit L2 norm (vLLM's default for embed)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        kind = self.pooling_type
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {kind!r}")
        object.__setattr__(self, "pooling_type", kind.upper())
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")

    @classmethod
    def of(cls, value: "PoolerConfig | dict | None") -> "PoolerConfig":
        """A config from itself, a dict of its fields (the CLI's JSON) or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a PoolerConfig or a dict, got {type(value).__name__}")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config has unknown key(s) {sorted(unknown)}; known: pooling_type, normalize")
        return cls(**value)


@dataclass
class PoolingParams:
    """One embedding request. `normalize` None: the engine's PoolerConfig decides. `dimensions`:
    the embedding's size, accepted only as the model's own hidden size (no Matryoshka truncation:
    a model not trained for it gives meaningless shorter vectors)."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer or None, got {d!r}")
