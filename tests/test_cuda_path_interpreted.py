"""The CUDA path end to end without a GPU. The engine runs a tiny Llama and a tiny Gemma 3 while
every tensor reports `is_cuda`, so each fast path the model files choose on CUDA takes its Triton
kernel through Triton's interpreter: the norms and residual adds, the q/k prologue with its K/V
write into the pool, the gated activation, paged prefill attention over chunks and paged decode
attention, its parts merged by the last to arrive. The matmuls stay on the CPU's kernels. Greedy
tokens must equal the plain CPU engine's, and every step's top log-probabilities agree to fp32
rounding.

The kernels' own tests hold each one to a reference; this one holds the way the engine calls them:
the step's metadata, block tables and slots as views, a sliding window's released blocks, the
layer groups. Where CUDA is present Triton compiles instead of interpreting, and the GPU check
(kvserve/tools/bench/cuda_check.py) covers this path."""
from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.accel.cuda_gemv import graph_capture, tune_small_batch_matmuls
from kvserve.accel.fused_linear import fuse_linear_projections
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kernels import triton_attention, triton_gemv, triton_ops
from kvserve.loading import load_model
from tests.tiny_models import make_model

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton compiles for a GPU here: the CUDA check runs this path")

SHAPES = {  # two layers, two query heads sharing one KV head (head_dim 32): a few interpreted programs
    "llama": dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
    "gemma3": dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   layer_types=["sliding_attention", "full_attention"]),
}
WRAPPERS = {triton_attention: ("paged_decode", "paged_prefill"),
            triton_ops: ("residual_norm", "qk_norm_rope", "gated_act"),
            triton_gemv: ("gemv", "gated_gemv")}


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """Calls of each Triton wrapper, and decode calls of more than one part (the merge)."""
    calls: Counter = Counter()

    def count(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            if name == "paged_decode":
                q, k_pool, max_len = args[0], args[1], kwargs.get("max_len")
                calls["decode in parts"] += triton_attention.decode_parts(q.shape[0], k_pool.shape[1], max_len,
                                                                          q.device) > 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for module, names in WRAPPERS.items():
        for name in names:
            count(module, name)
    return calls


def _outputs(llm: LLM, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def assert_same_outputs(got: list, want: list) -> None:
    """The same greedy tokens, and every step's top log-probabilities equal to fp32 agreement (the
    same roundings up to summation order)."""
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        for g_top, w_top in zip(g.top_logprobs, w.top_logprobs):
            assert g_top.keys() == w_top.keys()
            torch.testing.assert_close(torch.tensor(list(g_top.values())), torch.tensor([w_top[t] for t in g_top]),
                                       atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_the_cuda_paths_kernels_give_the_cpu_engines_tokens_and_logprobs(family, tmp_path, counted, monkeypatch, one_thread):
    make_model(family, tmp_path, **SHAPES[family])
    loaded = load_model(tmp_path)
    # A prompt past 64 positions (decode in parts) prefilled in two chunks; two short ones.
    prompts = [[2, 5, 6, 7], [2] + list(range(30, 96)), [2, 11, 12]]
    # Top-5 log-probabilities of every step: a tiny random model's greedy tokens survive errors
    # that its logits show.
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    engine = dict(loaded=loaded, kv_cache_gib=0.0005, max_num_seqs=4, max_num_batched_tokens=48)
    want = _outputs(LLM(**engine), prompts, params)
    assert not counted  # the plain engine: C kernels and PyTorch ops only
    llm = LLM(**engine)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    got = _outputs(llm, prompts, params)
    monkeypatch.undo()
    assert_same_outputs(got, want)
    for names in (WRAPPERS[triton_attention], WRAPPERS[triton_ops]):
        assert all(counted[name] > 0 for name in names), counted
    assert counted["decode in parts"] > 0, counted
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


class PreferATiling:
    """A stand-in for the CUDA-graph timer. Candidates come in a fixed order (cuBLAS, then the
    tilings at one row; cuBLAS, then the winner at four rows): the last tiling wins both, and
    nothing runs."""

    TIMES = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 10.0, 5.0]

    def __init__(self):
        self.calls = 0

    def __call__(self, run, calls: int) -> float:
        self.calls += 1
        return self.TIMES[(self.calls - 1) % len(self.TIMES)]


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_the_captured_decode_steps_kernels_give_the_cpu_engines_logprobs(family, tmp_path, counted, monkeypatch,
                                                                         one_thread):
    """The decode step the GPU replays: the graph runner's static buffers (block tables for every
    possible block, lengths read from memory, padding rows), attention in as many parts as a
    graph fixes without knowing the lengths, and the small-batch products through the Triton
    matrix-vector tilings the engine would have chosen, the down projection's with the
    activation in front. (The runner's CPU stand-in steps without capturing.)"""
    make_model(family, tmp_path, **SHAPES[family])
    loaded = load_model(tmp_path)
    prompts = [[2, 5, 6, 7], [2] + list(range(30, 96)), [2, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    engine = dict(loaded=loaded, kv_cache_gib=0.0005, max_num_seqs=4, max_num_batched_tokens=48, pack_weights=False)
    want = _outputs(LLM(**engine), prompts, params)
    fuse_linear_projections(loaded.model)  # what prepare_model does on CUDA
    records = tune_small_batch_matmuls(loaded.model, PreferATiling())
    assert {r["chosen"] for r in records} == {str(triton_gemv.CONFIGS[-1])}
    monkeypatch.setattr(LLMEngine, "_cuda_graphs_apply", lambda self: self._cuda_graphs_fit())
    replayed = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, inputs: replayed.append(len(inputs)) or run(self, inputs))
    llm = LLM(**engine)
    assert llm.engine.runner.graphs is not None
    counted.clear()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with graph_capture():  # (the small-batch choices apply where graphs are captured)
        got = _outputs(llm, prompts, params)
    monkeypatch.undo()
    assert replayed and max(replayed) == 3
    assert_same_outputs(got, want)
    for names in WRAPPERS.values():
        assert all(counted[name] > 0 for name in names), counted
    assert counted["decode in parts"] > 0, counted
