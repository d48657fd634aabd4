"""A request's n samples draw their first tokens from their parent's logits row a parent at a
time: the sampler never sees n copies of the whole batch's rows (64 prompts x n 128 of a
262k vocabulary would be 8 GB of fp32), and seeded samples stay reproducible."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.loading import load_model
from kvserve.sampling.sampler import Sampler
from tests.tiny_models import make_model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def test_forked_samples_are_drawn_a_parent_at_a_time(tmp_path, monkeypatch):
    make_model("llama", tmp_path)
    loaded = load_model(tmp_path)
    prompts = [[2, 5, 6], [2, 7, 8, 9], [2, 10], [2, 11, 12, 13, 14]]
    params = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True, logprobs=1)
    seen: list[int] = []
    real = Sampler.__call__

    def recorded(self, logits, requests):
        seen.append(logits.shape[0])
        return real(self, logits, requests)

    monkeypatch.setattr(Sampler, "__call__", recorded)
    outs = LLM(loaded=loaded, kv_cache_gib=0.01).generate(prompts, params)
    # Step 1 computes all four prompts and forks their samples: one parent's 8 at a time (not one
    # call on 32 gathered rows); later steps sample the 32 sequences' own rows together.
    assert seen[:4] == [8, 8, 8, 8] and seen[4:] == [32] * 3
    assert all(len(o.outputs) == 8 and all(len(c.token_ids) == 4 for c in o.outputs) for o in outs)
    again = LLM(loaded=loaded, kv_cache_gib=0.01).generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outs]
