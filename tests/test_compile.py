"""EngineConfig.compile: the forward pass through torch.compile (kvserve/accel/compiled.py) computes
what the eager engine computes: the same greedy tokens, log-probabilities to fp32 rounding, over
prompts, chunked prefill mixed with decode rows, and speculative verification."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.model.attention import Attention
from tests.tiny_models import make_model

PROMPTS = [[1, 5, 9, 200, 17], [1, 8], [1, 300, 301, 302, 7, 7, 7, 9, 10], [1] + list(range(40, 100))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    for kind in ("llama", "gemma3"):
        make_model(kind, root / kind)
    return root


@pytest.fixture
def attention_calls(monkeypatch):
    """How many times the compiled graph's opaque attention op ran (its eager half)."""
    calls = []
    real = Attention.attend_written
    monkeypatch.setattr(Attention, "attend_written", lambda self, *a: calls.append(self.layer) or real(self, *a))
    return calls


def _same_outputs(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(g.outputs[0].logprobs, w.outputs[0].logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_compiled_forward_equals_eager(tiny, kind, attention_calls):
    # A small token budget: prompts prefill in chunks while other sequences decode (mixed steps),
    # then one- and several-row decode steps: both of the graph's shape classes.
    args = dict(model=str(tiny / kind), kv_cache_gib=0.05, max_num_batched_tokens=24)
    eager = LLM(**args)
    compiled = LLM(**args, compile=True)
    assert eager.engine.runner.compiled is None and compiled.engine.runner.compiled is not None
    want = eager.generate(PROMPTS, GREEDY)
    assert attention_calls == []  # the eager engine never enters the op
    _same_outputs(compiled.generate(PROMPTS, GREEDY), want)
    num_layers = compiled.engine.model_config.num_layers
    assert attention_calls and len(attention_calls) % num_layers == 0
    assert attention_calls[:num_layers] == list(range(num_layers))
    _same_outputs([compiled.generate(p, GREEDY)[0] for p in PROMPTS], [eager.generate(p, GREEDY)[0] for p in PROMPTS])


def test_step_graph_run_eagerly_computes_the_same(tiny, attention_calls):
    # What runs if dynamo falls back (recompile limit, an untraceable op): the graph's Python.
    args = dict(model=str(tiny / "gemma3"), kv_cache_gib=0.05, max_num_batched_tokens=24)
    want = LLM(**args).generate(PROMPTS, GREEDY)
    fallback = LLM(**args, compile=True)
    fallback.engine.runner.compiled = fallback.engine.loaded.model.step_graph
    _same_outputs(fallback.generate(PROMPTS, GREEDY), want)
    assert attention_calls


def test_compiled_speculative_verification_keeps_the_tokens(tiny):
    args = dict(model=str(tiny / "llama"), kv_cache_gib=0.05, speculative="ngram", num_speculative_tokens=3)
    repetitive = [[1, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], [1, 20, 21, 20, 21, 20, 21]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=args["model"], kv_cache_gib=0.05).generate(repetitive, params)]
    spec = LLM(**args, compile=True)
    assert [o.outputs[0].token_ids for o in spec.generate(repetitive, params)] == want
    assert spec.engine.spec_stats["num_draft_tokens"] > 0


def test_compile_option_is_validated(tiny):
    with pytest.raises(ValueError, match="compile must be a bool"):
        EngineConfig(compile="yes")
    with pytest.raises(ValueError, match="compile covers float weights"):
        EngineConfig(compile=True, weights="int8")
    make_model("deepseek_v3", tiny / "mla")
    with pytest.raises(ValueError, match="compile: layer 0 has MLAttention"):
        LLM(model=str(tiny / "mla"), kv_cache_gib=0.05, compile=True)


def test_the_attention_op_needs_a_step():
    import kvserve.accel.compiled  # noqa: F401  (registers the op)

    q = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="outside a step"):
        torch.ops.kvserve.step_attention(q, None, None, 0)


def test_cli_compile_flag():
    import kvserve.cli as cli

    for argv in (["generate", "hello"], ["serve"]):
        assert cli.decoding_config(cli.build_parser().parse_args(argv))["compile"] is False
        assert cli.decoding_config(cli.build_parser().parse_args(argv[:1] + ["--compile"] + argv[1:]))["compile"]
    for bench in ("latency", "throughput"):
        assert cli.build_parser().parse_args(["bench", bench, "--compile"]).compile is True
