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


def test_generate_builds_outputs_only_when_requests_finish(tiny_llama, monkeypatch):
    """LLM.generate returns finished requests only, so it runs the default CUMULATIVE kind as
    FINAL_ONLY (no per-step outputs); what it returns equals the last CUMULATIVE output."""
    from kvserve import LLM
    from kvserve.engine.output_processor import OutputProcessor

    cumulative = _outputs(tiny_llama, RequestOutputKind.CUMULATIVE)
    built = []
    completion = OutputProcessor._completion
    monkeypatch.setattr(OutputProcessor, "_completion", staticmethod(lambda s, kind: built.append(kind) or
                                                                      completion(s, kind)))
    outs = LLM(loaded=tiny_llama, kv_cache_gib=0.01).generate(PROMPTS, PARAMS)
    assert built == [RequestOutputKind.FINAL_ONLY] * 2 * len(PROMPTS)  # n=2: two samples a request, once
    for out, rid in zip(outs, ["r0", "r1"]):
        want = cumulative[rid][-1]
        assert [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs] == \
               [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in want.outputs]
    delta = dataclasses.replace(PARAMS, output_kind=RequestOutputKind.DELTA)
    built.clear()
    LLM(loaded=tiny_llama, kv_cache_gib=0.01).generate(PROMPTS[:1], delta)
    assert set(built) == {RequestOutputKind.DELTA} and len(built) > 2  # an explicit kind is kept
