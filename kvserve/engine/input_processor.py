"""What LLMEngine.add_request checks and prepares before a request is queued: the prompt as
validated token ids, the request's own arguments, its samples as Sequences with their RNGs.

Every refusal is a ValueError raised before the engine holds any state for the request, so a
bad request never reaches the scheduler (the server answers it with a 400).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvserve.pooling_params import PoolerConfig, PoolingParams
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


def check_request_args(params: SamplingParams | PoolingParams | None, cache_salt: str | None,
                       deadline: float | None) -> SamplingParams | PoolingParams:
    """The request's params (default SamplingParams()), its cache salt and deadline, by type:
    callers other than the server (which validates its JSON) may pass anything."""
    params = params or SamplingParams()
    if not isinstance(params, (SamplingParams, PoolingParams)):
        raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
        raise ValueError(f"deadline must be a number (the engine clock's seconds), got {deadline!r}")
    return params


def check_token_args(params: SamplingParams | PoolingParams, vocab_size: int, hidden_size: int) -> None:
    """What needs the model: logit_bias ids inside the vocabulary, an embedding's dimensions."""
    if isinstance(params, PoolingParams):
        if params.dimensions is not None and params.dimensions != hidden_size:
            raise ValueError(f"dimensions must be this model's embedding size {hidden_size} (it cannot "
                             f"shorten its embeddings), got {params.dimensions}")
        return
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias has token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


def check_prompt_fits(ids: list[int], max_model_len: int, pooling: bool = False) -> None:
    """A prompt must leave at least one position to generate into (an embedding's may fill the
    context: it generates nothing)."""
    if pooling:
        if len(ids) > max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the context window (max_model_len) "
                             f"{max_model_len}")
        return
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
    """The request's n samples, each with its own RNG and the request's cache salt. The first
    one, which computes the prompt, collects its prompt logprobs when asked."""
    seqs = [Sequence(next(seq_ids), request_id, list(ids), params, arrival, index=i) for i in range(params.n)]
    for s in seqs:
        if cache_salt is not None:
            s.cache_salt = ("salt", cache_salt)
        s.generator = sample_generator(params, s.index, device, engine_seed)
    if params.prompt_logprobs is not None:
        seqs[0].prompt_logprobs = [None]
        seqs[0].skip_reading_prefix_cache = True
    return seqs


def pooling_sequence(seq_id: int, request_id: str, ids: list[int], params: PoolingParams, config: PoolerConfig,
                     arrival: float, cache_salt: str | None) -> Sequence:
    """An embedding request's one sequence: the engine's pooling with the request's settings.
    MEAN reads every prompt row, so it computes its prompt whole (no prefix-cache hit)."""
    # Its SamplingParams only size it for the scheduler: the prompt and the token it never samples.
    seq = Sequence(seq_id, request_id, list(ids), SamplingParams(max_tokens=1, temperature=0.0), arrival)
    normalize = config.normalize if params.normalize is None else params.normalize
    seq.pooling = PoolerConfig(config.pooling_type, normalize)
    seq.skip_reading_prefix_cache = config.pooling_type == "MEAN"
    if cache_salt is not None:
        seq.cache_salt = ("salt", cache_salt)
    return seq
