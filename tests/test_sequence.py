"""Sequence.token_slice equals slicing the concatenated prompt + output (the hot path avoids it)."""
from hypothesis import given
from hypothesis import strategies as st

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence


@given(st.lists(st.integers(0, 99), min_size=1, max_size=20), st.lists(st.integers(0, 99), max_size=20),
       st.integers(0, 45), st.integers(0, 45))
def test_token_slice_matches_all_token_ids(prompt, output, a, b):
    seq = Sequence(0, "r", prompt, SamplingParams(), 0.0)
    seq.output_token_ids = list(output)
    start, end = min(a, b), max(a, b)
    assert seq.token_slice(start, end) == seq.all_token_ids[start:end]
