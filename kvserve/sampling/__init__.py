"""Token sampling, incremental detokenization and stop conditions."""

from kvserve.sampling.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer
from kvserve.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRequest,
    ScreenedRows,
    apply_penalties,
    filter_logits,
)
from kvserve.sampling.stop import StopChecker, StopResult

__all__ = [
    "IncrementalDetokenizer",
    "Sampler",
    "SamplerOutput",
    "SamplingRequest",
    "ScreenedRows",
    "StopChecker",
    "StopResult",
    "StreamDetokenizer",
    "apply_penalties",
    "filter_logits",
    "make_detokenizer",
]
