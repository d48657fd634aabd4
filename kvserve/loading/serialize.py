"""ModelConfig <-> JSON-able dict, for the conversion cache and for written model folders."""
from __future__ import annotations

import dataclasses

from kvserve.model.config import ModelConfig, MoEConfig, RopeConfig


def config_to_dict(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["rope"] = {t: {"theta": r.theta, "scaling": r.scaling_dict} for t, r in cfg.rope.items()}
    return d


def _scaling(raw: dict | None) -> tuple | None:
    """RopeConfig.scaling from its JSON form (lists, such as freq_factors' factors, as tuples)."""
    if not raw:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in raw.items()))


def config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope"] = {t: RopeConfig(r["theta"], _scaling(r["scaling"])) for t, r in d["rope"].items()}
    if d.get("moe") is not None:
        d["moe"] = MoEConfig(**d["moe"])
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(d) - fields
    if unknown:
        raise KeyError(f"unknown config keys {sorted(unknown)}")
    return ModelConfig(**d)
