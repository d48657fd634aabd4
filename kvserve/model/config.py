"""Architecture description shared by every model family.

Loaders (GGUF metadata, HF config.json) translate their own vocabulary into this one
dataclass, so the model code never looks at a file format.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type.

    `scaling` is None (default RoPE) or a dict as in HF's `rope_scaling`, e.g.
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192} or {"rope_type": "linear", "factor": 8.0}.
    """

    theta: float
    scaling: tuple[tuple[str, float | str], ...] | None = None

    @property
    def scaling_dict(self) -> dict | None:
        return dict(self.scaling) if self.scaling is not None else None


@dataclass
class ModelConfig:
    family: str  # "gemma3" or "llama" (llama, mistral, qwen2, qwen3 share one implementation)
    model_type: str  # as the source called it, for messages
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: list[str]
    rope: dict[str, RopeConfig]  # keyed by layer type
    attn_scale: float
    sliding_window: int | None = None
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    add_bos_token: bool = True
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        for t in self.layer_types:
            if t not in (FULL, SLIDING):
                raise ValueError(f"unknown layer type {t!r}")
            if t not in self.rope:
                raise ValueError(f"no rope parameters for layer type {t!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    def window(self, layer: int) -> int | None:
        """Tokens a query at this layer may see (itself included), None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + head + self.num_layers * per_layer

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """K and V for one token in every layer (no sliding-window savings)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element
