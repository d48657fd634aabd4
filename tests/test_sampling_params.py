"""SamplingParams: defaults, normalization and validation (every bad field names itself)."""

from __future__ import annotations

import math

import pytest

from kvserve.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.repetition_penalty == 1.0 and p.logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy


def test_stop_normalization() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_ints_become_floats() -> None:
    p = SamplingParams(temperature=0, top_p=1, presence_penalty=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.presence_penalty, float)


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)]
)
def test_greedy_threshold(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_p=1e-9),
        dict(min_p=1.0),
        dict(max_tokens=None, min_tokens=100),
        dict(max_tokens=5, min_tokens=5),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(repetition_penalty=1e-3),
        dict(seed=0),
        dict(stop_token_ids=[0]),
    ],
)
def test_valid_edges(kwargs: dict) -> None:
    SamplingParams(**kwargs)


INVALID = [
    ("n", dict(n=0)),
    ("n", dict(n=True)),
    ("n", dict(n=2.0)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature="1")),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=1.5)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.1)),
    ("seed", dict(seed="42")),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens="16")),
    ("max_tokens", dict(max_tokens=16.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17)),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[1])),
    ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=["2"])),
    ("stop_token_ids", dict(stop_token_ids=3)),
    ("ignore_eos", dict(ignore_eos=1)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=math.inf)),
    ("frequency_penalty", dict(frequency_penalty=-2.1)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=True)),
    ("include_stop_str_in_output", dict(include_stop_str_in_output="yes")),
    ("skip_special_tokens", dict(skip_special_tokens=None)),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[f"{f}={v}" for f, v in INVALID])
def test_invalid_field_raises_naming_it(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_message_format() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)
