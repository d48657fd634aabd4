"""EngineConfig and its parts: each part validates its own fields and names the bad one; the
engine-wide config hands every part the values it was given and checks what spans parts."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve.config import (CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, StreamingConfig,
                            WeightsConfig)


def test_parts_carry_the_values_given_to_the_engine_config():
    cfg = EngineConfig(block_size=8, kv_cache_gib=0.5, kv_cache_dtype="int8", max_num_seqs=3,
                       max_num_batched_tokens=64, enable_chunked_prefill=False, weights="int8", pack_weights=False,
                       speculative="ngram", num_speculative_tokens=2, ngram_max=3, attention_sinks=4,
                       streaming_window=64)
    assert cfg.cache_config == CacheConfig(block_size=8, kv_cache_gib=0.5, kv_cache_dtype="int8")
    assert cfg.scheduler_config == SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64,
                                                   enable_chunked_prefill=False)
    assert cfg.weights_config == WeightsConfig(weights="int8", pack_weights=False) and cfg.weights_config.low_bit
    assert cfg.speculative_config == SpeculativeConfig(speculative="ngram", num_speculative_tokens=2, ngram_max=3)
    assert cfg.streaming_config == StreamingConfig(attention_sinks=4, streaming_window=64)
    assert cfg.streaming_config.enabled and cfg.speculative_config.enabled
    # A replaced field rebuilds the parts; the parts are not constructor arguments.
    assert dataclasses.replace(cfg, max_num_seqs=5).scheduler_config.max_num_seqs == 5
    assert "scheduler_config" not in EngineConfig.field_names() and "max_num_seqs" in EngineConfig.field_names()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache_config.block_size = 4


def test_defaults_are_resolved_before_the_parts_are_made():
    cfg = EngineConfig(weights="fp32")
    assert cfg.dtype == "float32" and cfg.weights_config.weights == "float"
    assert cfg.cache_config.kv_cache_gib is cfg.kv_cache_gib is None  # automatic: the engine sizes the pool


@pytest.mark.parametrize("make,field", [
    (lambda: CacheConfig(block_size=0), "block_size"),
    (lambda: CacheConfig(kv_cache_gib=True), "kv_cache_gib"),
    (lambda: CacheConfig(kv_cache_dtype="int3"), "kv_cache_dtype"),
    (lambda: CacheConfig(use_kv_cache=1), "use_kv_cache"),
    (lambda: SchedulerConfig(max_num_seqs="8"), "max_num_seqs"),
    (lambda: SchedulerConfig(max_model_len=0), "max_model_len"),
    (lambda: WeightsConfig(weights="int3"), "weights"),
    (lambda: WeightsConfig(weights="int4", compile=True), "compile"),
    (lambda: WeightsConfig(weights="gguf", gguf_mmap="yes"), "gguf_mmap"),
    (lambda: SpeculativeConfig(speculative="medusa"), "speculative"),
    (lambda: SpeculativeConfig(ngram_min=5, ngram_max=2), "ngram_min"),
    (lambda: SpeculativeConfig(speculative="draft"), "speculative_model"),
    (lambda: SpeculativeConfig(self_draft_bits=4), "self_draft"),
    (lambda: StreamingConfig(attention_sinks=2), "attention_sinks"),
    (lambda: StreamingConfig(streaming_window=-1), "streaming_window"),
])
def test_each_part_validates_its_own_fields(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("kwargs,field", [
    (dict(weights="int8", device="cuda"), "device"),
    (dict(weights="int8", speculative="self", self_draft_bits=8), "self_draft_bits"),
    (dict(speculative="ngram", use_kv_cache=False), "use_kv_cache"),
    (dict(streaming_window=8, use_kv_cache=False), "use_kv_cache"),
    (dict(streaming_window=8, speculative="self"), "streaming_window"),
    (dict(max_num_seqs=0), "max_num_seqs"),  # a part's own check, reached through EngineConfig
])
def test_engine_config_checks_what_spans_parts(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)
