"""What LLMEngine.add_request checks and prepares before a request is queued: the prompt as
validated token ids, the request's own arguments, its samples as Sequences with their RNGs.

Every refusal is a ValueError raised before the engine holds any state for the request, so a
bad request never reaches the scheduler (the server answers it with a 400).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence


def tokenize(prompt: str | list[int], tokenizer, vocab_size: int) -> list[int]:
    """Text or token ids -> validated token ids (every id must index the embedding)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:  # a tokenizer with added tokens beyond the model's embedding
            raise ValueError(f"prompt encodes to token id {bad[0]}, which the model's vocabulary "
                             f"[0, {vocab_size}) does not have")
        return ids
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids contains {bad[0]!r}, outside the vocabulary [0, {vocab_size})")
    return ids


def check_request_args(params: SamplingParams | None, cache_salt: str | None,
                       deadline: float | None) -> SamplingParams:
    """The request's params (default SamplingParams()), its cache salt and deadline, by type:
    callers other than the server (which validates its JSON) may pass anything."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
        raise ValueError(f"deadline must be a number (the engine clock's seconds), got {deadline!r}")
    return params


def check_prompt_fits(ids: list[int], max_model_len: int) -> None:
    """A prompt must leave at least one position to generate into."""
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the context window (max_model_len) is "
                         f"{max_model_len}, leaving no room for output")


def sample_generator(params: SamplingParams, index: int, device: str,
                     engine_seed: int | None = None) -> torch.Generator | None:
    """One RNG per sample, so a seeded request gives the same tokens whatever runs beside it;
    `engine_seed` stands in for a request without a seed (EngineConfig.seed). None (the global
    RNG) when greedy or neither is set."""
    seed = params.seed if params.seed is not None else engine_seed
    if seed is None or params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(seed + index)


def new_sequences(seq_ids: Iterator[int], request_id: str, ids: list[int], params: SamplingParams,
                  arrival: float, cache_salt: str | None, device: str,
                  engine_seed: int | None = None) -> list[Sequence]:
    """The request's n samples, each with its own RNG and the request's cache salt."""
    seqs = [Sequence(next(seq_ids), request_id, list(ids), params, arrival, index=i) for i in range(params.n)]
    for s in seqs:
        if cache_salt is not None:
            s.cache_salt = ("salt", cache_salt)
        s.generator = sample_generator(params, s.index, device, engine_seed)
    return seqs
