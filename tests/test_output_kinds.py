"""RequestOutputKind: DELTA outputs carry only what is new and add up to the CUMULATIVE ones;
FINAL_ONLY gives a single output, the same as the last CUMULATIVE one."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve.loading import load_model
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from tests.server_harness import make_engine
from tests.tiny_models import make_model

PROMPTS = [[2, 5, 6, 9, 11], [2, 40, 41]]
PARAMS = SamplingParams(temperature=0.9, seed=11, max_tokens=24, logprobs=2, n=2, stop=["zz"])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_kinds")
    make_model("llama", folder)
    return load_model(folder)


def _outputs(tiny_llama, kind: RequestOutputKind) -> dict[str, list]:
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, dataclasses.replace(PARAMS, output_kind=kind), request_id=f"r{i}")
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_delta_and_final_only_agree_with_cumulative(tiny_llama):
    cumulative = _outputs(tiny_llama, RequestOutputKind.CUMULATIVE)
    delta = _outputs(tiny_llama, RequestOutputKind.DELTA)
    final = _outputs(tiny_llama, RequestOutputKind.FINAL_ONLY)
    for rid, outs in cumulative.items():
        last = outs[-1]
        assert len(delta[rid]) == len(outs) > 2
        assert len(final[rid]) == 1 and final[rid][0].finished
        for c in last.outputs:
            pieces = [o.outputs[c.index] for o in delta[rid]]
            assert "".join(p.text for p in pieces) == c.text
            assert sum((p.token_ids for p in pieces), []) == c.token_ids
            assert sum((p.logprobs for p in pieces), []) == c.logprobs
            assert [p.delta_token_ids for p in pieces] == [o.outputs[c.index].delta_token_ids for o in outs]
            f = final[rid][0].outputs[c.index]
            assert (f.text, f.token_ids, f.logprobs, f.finish_reason) == (c.text, c.token_ids, c.logprobs,
                                                                          c.finish_reason)
            assert f.delta_token_ids == c.token_ids  # all of it is new to a FINAL_ONLY reader
        assert final[rid][0].metrics.num_output_tokens == last.metrics.num_output_tokens


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
