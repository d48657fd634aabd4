"""Model family lookup."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from kvserve.model.bamba import BambaForCausalLM
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.deepseek import DeepseekForCausalLM
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM

_FAMILIES: dict[str, type[CausalLM]] = {
    "bamba": BambaForCausalLM,
    "deepseek": DeepseekForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if cfg.family not in _FAMILIES:
        raise ValueError(f"no model implementation for family {cfg.family!r}")
    return _FAMILIES[cfg.family]


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "constant_", "zeros_",
          "ones_")


@contextmanager
def _no_init():
    """Module constructors skip torch.nn.init: tensors on the meta device hold no values, and
    there torch routes an init through torch._refs, whose first use imports torch._dynamo (with
    sympy and triton: ~1 s and ~150 MB resident, for nothing)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def empty_model(cfg: ModelConfig) -> CausalLM:
    """The model's modules with tensors on the meta device (shapes only), for a loader to fill."""
    with torch.device("meta"), _no_init():
        return model_class(cfg)(cfg)
