"""NgramProposer: hand-made cases, validation, speed, and a property test against a naive scan."""

from __future__ import annotations

import random
import sys
import time
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.speculative import NgramProposer


def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Reference: try n from max_n down, scan start positions from the latest earlier one."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_continuation_of_the_suffix_match() -> None:
    assert NgramProposer(2).propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1]


def test_longest_n_is_preferred_over_a_more_recent_shorter_match() -> None:
    # [5, 6] matched at 0 wins over the more recent 1-gram [6] at 4.
    assert NgramProposer(2).propose([5, 6, 7, 9, 6, 8, 5, 6]) == [7, 9]
    # With max_n = 1 only the 1-gram counts: its most recent occurrence is at 4.
    assert NgramProposer(2, max_n=1).propose([5, 6, 7, 9, 6, 8, 5, 6]) == [8, 5]


def test_most_recent_occurrence_wins() -> None:
    assert NgramProposer(3).propose([1, 2, 9, 1, 2, 8, 1, 2]) == [8, 1, 2]


def test_min_n_is_respected() -> None:
    tokens = [4, 1, 7, 3, 1]  # only the 1-gram [1] recurs
    assert NgramProposer(2, min_n=1).propose(tokens) == [7, 3]
    assert NgramProposer(2, min_n=2).propose(tokens) == []


def test_k_truncates_and_the_context_end_stops_the_continuation() -> None:
    proposer = NgramProposer(5)
    assert proposer.propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # only 3 tokens follow the match
    assert proposer.propose([1, 2, 3, 1, 2], k=1) == [3]
    assert proposer.propose([1, 2, 3, 1, 2], k=0) == []


def test_match_overlapping_the_suffix() -> None:
    # [1, 2, 1] recurs at 0; what follows it is part of the suffix itself.
    assert NgramProposer(4).propose([1, 2, 1, 2, 1]) == [2, 1]
    # The most recent earlier occurrence of [7, 7, 7, 7] starts at 1: one token follows it.
    assert NgramProposer(4).propose([7, 7, 7, 7, 7, 7]) == [7]


def test_no_match_and_short_contexts() -> None:
    proposer = NgramProposer(3)
    assert proposer.propose([1, 2, 3, 4, 5]) == []
    assert proposer.propose([]) == []
    assert proposer.propose([1]) == []
    assert proposer.propose([1, 1]) == [1]


def test_byte_matches_across_token_boundaries_are_ignored() -> None:
    # int32 0x00010000 and the pair (0x01000000, 0) share bytes at an unaligned offset
    # (little-endian); the proposer must not mistake that for a token match.
    x, y = 0x00010000, 0x01000000
    proposer = NgramProposer(2, max_n=1)
    assert proposer.propose([y, 0, x]) == []
    assert proposer.propose([x, 5, y, 0, x]) == [5, y]


def test_accepts_an_int32_array() -> None:
    tokens = [1, 2, 9, 1, 2, 8, 1, 2]
    assert NgramProposer(3).propose(array("i", tokens)) == [8, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "min_n": 0}, "min_n"),
        ({"num_speculative_tokens": 2, "max_n": 0}, "max_n"),
        ({"num_speculative_tokens": 2, "min_n": 3, "max_n": 2}, "max_n"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)


def test_negative_k_is_rejected() -> None:
    with pytest.raises(ValueError, match="k must be"):
        NgramProposer(2).propose([1, 2, 1], k=-1)


def test_32k_context_is_fast() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(262144) for _ in range(32768)]
    tokens[1000:1004] = tokens[-4:]  # one genuine 4-gram match far from the end
    proposer = NgramProposer(5)
    assert proposer.propose(tokens) == tokens[1004:1009]
    no_match = tokens[:-1] + [262144 + 1]  # worst common case: every n searched in full
    timings = []
    for _ in range(20):
        start = time.perf_counter()
        proposer.propose(tokens)
        proposer.propose(no_match)
        timings.append((time.perf_counter() - start) / 2)
    timings.sort()
    # ~0.4 ms here; the bound is loose for a busy shared machine.
    assert timings[len(timings) // 2] < 5e-3


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(st.integers(0, 3), st.sampled_from([0x00010000, 0x01000000, 2**31 - 1])),
        max_size=40,
    ),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_matches_naive_reference(tokens: list[int], min_n: int, extra_n: int, k: int) -> None:
    max_n = min_n + extra_n
    proposer = NgramProposer(max(k, 1), min_n=min_n, max_n=max_n)
    assert proposer.propose(tokens, k=k) == naive_propose(tokens, k, min_n, max_n)


def test_unaligned_test_really_is_unaligned() -> None:
    """Guard for the boundary test above: on a little-endian host the bytes do collide."""
    if sys.byteorder != "little":
        pytest.skip("byte layout differs on big-endian hosts")
    x, y = 0x00010000, 0x01000000
    assert array("i", [y, 0]).tobytes().find(array("i", [x]).tobytes()) % 4 != 0
