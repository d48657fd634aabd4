"""Speculative decoding building blocks: the lossless acceptance rule and an n-gram proposer."""

from kvserve.speculative.ngram import NgramProposer
from kvserve.speculative.rejection import (
    SpecVerifyResult,
    processed_probs,
    rejection_sample,
    sample_probs,
)

__all__ = [
    "NgramProposer",
    "SpecVerifyResult",
    "processed_probs",
    "rejection_sample",
    "sample_probs",
]
