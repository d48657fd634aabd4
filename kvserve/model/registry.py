"""Model family lookup."""
from __future__ import annotations

from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.deepseek import DeepseekForCausalLM
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM

_FAMILIES: dict[str, type[CausalLM]] = {
    "deepseek": DeepseekForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if cfg.family not in _FAMILIES:
        raise ValueError(f"no model implementation for family {cfg.family!r}")
    return _FAMILIES[cfg.family]
