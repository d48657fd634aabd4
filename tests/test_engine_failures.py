"""A failure the engine can pin on one request ends that request alone: its samples finish with
"error" (status 500, a log reference, no exception text), its blocks are freed, and every other
request in the same steps produces exactly the tokens of a run without the failure."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.loading import load_model
from kvserve.sampling_params import RequestOutputKind
from tests.server_harness import make_engine
from tests.tiny_models import make_model

POISON = 7  # a prompt token the fake fault below cannot digest
GOOD = [[2, 5, 6, 9, 11], [2, 40, 41, 42], [2, 13, 14]]
BAD = [2, 3, POISON, 8]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_failures")
    make_model("llama", folder)
    return load_model(folder)


def _reference(tiny_llama, params: SamplingParams) -> list[list[list[int]]]:
    outs = LLM(loaded=tiny_llama, kv_cache_gib=0.01).generate(GOOD, params)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _run(engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, object]:
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(ids) <= set(finals) and not engine.requests
    return finals


def _assert_failed_alone(finals: dict, bad_id: str, expected: list, engine) -> None:
    bad = finals.pop(bad_id)
    assert bad.error is not None and bad.error_status == 500 and "log reference" in bad.error
    assert "simulated" not in bad.error
    assert all(c.finish_reason == "error" for c in bad.outputs)
    got = [[c.token_ids for c in finals[f"r{i}"].outputs] for i in range(len(expected))]
    assert got == expected
    assert all(o.error is None for o in finals.values())
    assert engine.block_manager.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),  # the greedy-screen pass
    SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=2, n=2),
], ids=["greedy", "sampled"])
def test_a_forward_pass_failing_on_one_request_fails_only_it(tiny_llama, params):
    """The batched pass raises; run alone, only the poisoned request's pass raises."""
    expected = _reference(tiny_llama, params)
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    calls = {"failed": 0}

    def poisoned(run):
        def wrapper(inputs, *args, **kwargs):
            if any(POISON in i.token_ids for i in inputs):
                calls["failed"] += 1
                raise RuntimeError("simulated kernel fault")
            return run(inputs, *args, **kwargs)
        return wrapper

    engine.runner.execute = poisoned(engine.runner.execute)
    engine.runner.execute_greedy = poisoned(engine.runner.execute_greedy)
    finals = _run(engine, GOOD[:2] + [BAD] + GOOD[2:], params)
    finals["bad"] = finals.pop("r2")
    finals["r2"] = finals.pop("r3")
    _assert_failed_alone(finals, "bad", expected, engine)
    assert calls["failed"] == 2  # the batched pass, then the poisoned request alone


def test_detokenizing_failing_for_one_request_fails_only_it(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    expected = _reference(tiny_llama, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)
    on_token = engine.output_processor.on_token

    def fragile(seq, token):
        if seq.request_id == "bad" and len(seq.output_token_ids) == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
        return on_token(seq, token)

    engine.output_processor.on_token = fragile
    engine.add_request(BAD, params, request_id="bad")
    finals, deltas = {}, {}
    for i, p in enumerate(GOOD):
        engine.add_request(p, params, request_id=f"r{i}")
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert len(deltas["bad"]) == 4  # every token generated is reported, the one it failed on too
    for i in range(len(GOOD)):  # DELTA outputs: the pieces add up to the whole
        assert deltas[f"r{i}"] == expected[i][0]
    _assert_failed_alone(finals, "bad", [[c.token_ids for c in finals[f"r{i}"].outputs] for i in range(3)], engine)


def test_sampling_failing_for_one_request_fails_only_it(tiny_llama):
    """Sequences sampled together are sampled one at a time after a failure; only the one that
    fails alone ends."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    expected = _reference(tiny_llama, params)
    engine = make_engine(tiny_llama, kv_cache_gib=0.01)

    class Fragile:
        def __init__(self, sampler):
            self._sampler = sampler

        def __call__(self, logits, requests):
            if any(r.params.seed == 666 for r in requests):
                raise FloatingPointError("simulated")
            return self._sampler(logits, requests)

        def __getattr__(self, name):
            return getattr(self._sampler, name)

    engine.sampler = Fragile(engine.sampler)
    engine.add_request(BAD, SamplingParams(temperature=0.8, seed=666, max_tokens=10), request_id="bad")
    finals = _run(engine, GOOD, params)
    _assert_failed_alone(finals, "bad", expected, engine)
