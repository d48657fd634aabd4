"""Decode steps through the CUDA-graph runner (kvserve/engine/cuda_graphs.py).

Off CUDA the runner captures nothing and runs the same step eagerly on the same static tensors
(pinned-buffer layout, padding rows writing into their own page, block tables with stale tails,
metadata built over the static tensors). Here it is switched on for CPU engines and held to the
plain engine's outputs: greedy and seeded sampling, batches that need padding, the Gemma model's
six KV layer groups. On an H200 the check script (kvserve/tools/bench/cuda_check.py) compares the captured
graphs' greedy tokens with the CPU engine's."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.cuda_graphs import DecodeGraphs, batch_buckets
from kvserve.engine.llm_engine import LLMEngine
from kvserve.loading import load_model
from tests.tiny_models import make_model


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_multi_step_buffers_hold_every_steps_positions_slots_and_lengths():
    """The host writes all K steps' inputs: row i at position start + min(k, steps_i - 1) in step
    k, its slot from its own table until its last step and the padding page's after, its length
    position + 1; padding rows sit at position 0 on the padding page. Checked against a plain
    per-row loop over two KV layer groups with different tables."""
    from types import SimpleNamespace

    import torch

    bs, pad, K, B = 4, 99, 3, 4
    model = torch.nn.Linear(1, 1)
    graphs = DecodeGraphs(model, SimpleNamespace(num_groups=2), block_size=bs, max_model_len=32, max_num_seqs=B,
                          pad_block=pad, num_steps=K)
    g = graphs._capture(B, K)
    rows = [SimpleNamespace(token_ids=[11], start_pos=6, tables=[[5, 7, 2], [8, 3, 9]]),  # 3 steps, crosses a block
            SimpleNamespace(token_ids=[12], start_pos=0, tables=[[4], [6]])]  # 1 step, then idle
    steps = [3, 1]
    graphs._fill(g, rows, steps)
    longs = g.host_longs.view(-1)[B:].view(K, 3, B)  # per step: positions, slots of group 0, group 1
    lens = g.host_ints[:K * B].view(K, B)
    assert g.host_longs[0].tolist() == [11, 12, 0, 0]
    for k in range(K):
        for i in range(B):
            real = i < len(rows)
            pos = rows[i].start_pos + min(k, steps[i] - 1) if real else 0
            assert longs[k, 0, i] == pos and lens[k, i] == pos + 1, (k, i)
            for grp in range(2):
                active = real and k < steps[i]
                want = rows[i].tables[grp][pos // bs] * bs + pos % bs if active else pad * bs
                assert longs[k, 1 + grp, i] == want, (k, i, grp)


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Engines built inside use the graph runner on the CPU; yields the list of replayed step sizes."""
    monkeypatch.setattr(LLMEngine, "_cuda_graphs_apply", lambda self: self._cuda_graphs_fit())
    sizes: list[int] = []
    run = DecodeGraphs.run

    def counted(self, inputs):
        sizes.append(len(inputs))
        return run(self, inputs)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    return sizes


def _outputs(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]


def test_gemma_graph_steps_equal_the_plain_engine(gemma, graphs_on_cpu):
    prompts = ["The capital of France is", "Paged attention", "1, 2, 3, 4,", "Once upon a time"]
    plain = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=6)
    want = _outputs(plain, prompts[:3], PARAMS)
    graphed = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=6)
    engine = graphed.engine
    assert engine.runner.graphs is not None and engine.kv_cache.num_groups == 6
    # The padding page lies past the block manager's pool.
    assert engine.kv_cache.num_slots == (engine.num_blocks + 1) * engine.config.block_size
    assert _outputs(graphed, prompts[:3], PARAMS) == want
    assert {2, 3} <= set(graphs_on_cpu)  # a padded bucket (3 of 4), then two after the short one ends
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert _outputs(graphed, prompts, greedy) == _outputs(plain, prompts, greedy)
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_llama_graph_steps_equal_the_plain_engine(tmp_path, graphs_on_cpu, one_thread):
    make_model("llama", tmp_path)
    loaded = load_model(tmp_path)
    prompts = [[2, 5, 6, 7], [2, 9], [2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46],
               [2, 11, 12], [2, 100]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # past several blocks
    want = _outputs(LLM(loaded=loaded, kv_cache_gib=0.01, max_num_seqs=8), prompts, params)
    graphed = LLM(loaded=loaded, kv_cache_gib=0.01, max_num_seqs=8)
    assert _outputs(graphed, prompts, params) == want
    assert 5 in graphs_on_cpu


def test_enforce_eager_and_other_steps_skip_the_graphs(gemma, graphs_on_cpu):
    eager = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=4, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert eager.engine.kv_cache.num_slots == eager.engine.num_blocks * eager.engine.config.block_size
    quantized_kv = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=4, kv_cache_dtype="int8")
    assert quantized_kv.engine.runner.graphs is None  # the dequantizing path syncs: not capturable
    # Speculative verification steps (several logit rows a sequence) run eagerly.
    spec = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=4, speculative="ngram", num_speculative_tokens=2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = _outputs(LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=4), ["a b a b a b a b"], params)
    assert _outputs(spec, ["a b a b a b a b"], params) == want


@pytest.fixture
def steps_on_cpu(graphs_on_cpu, monkeypatch):
    """As graphs_on_cpu, and yields the steps of every multi-step replay."""
    runs: list[list[int]] = []
    run_steps = DecodeGraphs.run_steps

    def counted(self, inputs, steps):
        runs.append(list(steps))
        return run_steps(self, inputs, steps)

    monkeypatch.setattr(DecodeGraphs, "run_steps", counted)
    return runs


def test_llama_multi_step_runs_equal_the_plain_engine(tmp_path, steps_on_cpu, one_thread):
    make_model("llama", tmp_path)
    loaded = load_model(tmp_path)
    prompts = [[2, 5, 6, 7], [2, 9], [2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46],
               [2, 11, 12], [2, 100]]
    # Lengths that are no multiple of the 4 steps: rows run short and idle in a run, and the
    # last tokens before max_tokens decode one step at a time; 40 tokens cross several blocks.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 7, 13, 2, 23)]
    plain = LLM(loaded=loaded, kv_cache_gib=0.01, max_num_seqs=8)
    want = _outputs(plain, prompts, params)
    multi = LLM(loaded=loaded, kv_cache_gib=0.01, max_num_seqs=8, num_scheduler_steps=4)
    engine = multi.engine
    assert _outputs(multi, prompts, params) == want
    assert steps_on_cpu and all(max(s) == 4 and min(s) >= 1 for s in steps_on_cpu)
    assert any(min(s) < 4 for s in steps_on_cpu)  # a row with fewer steps left idled in a run
    assert len(steps_on_cpu) < 40 // 4 + 3  # the long request took runs, not single steps
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # no reserved slot kept

    # A stop inside a run: the tokens after it are dropped, as the plain engine never makes them.
    stop_at = want[0][0][5]
    stopping = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_at])
    assert _outputs(multi, prompts[:1], stopping) == _outputs(plain, prompts[:1], stopping)
    assert _outputs(multi, prompts[:1], stopping)[0][0][-1] == stop_at
    assert engine.block_manager.num_free_blocks == engine.num_blocks

    # No max_tokens: runs until the context window is full, never past it.
    endless = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    capped = [LLM(loaded=loaded, kv_cache_gib=0.01, max_num_seqs=8, max_model_len=45, **kw) for kw in
              ({}, {"num_scheduler_steps": 4})]
    want = _outputs(capped[0], prompts[:2], endless)
    assert [len(o[0]) for o in want] == [45 - len(p) for p in prompts[:2]]
    assert _outputs(capped[1], prompts[:2], endless) == want


def test_multi_step_under_a_tight_pool(tmp_path, steps_on_cpu, one_thread):
    """Lookahead slots the pool cannot hold shrink a run (a row idles early, or the step decodes
    one token a sequence) and sequences are preempted and recomputed: the tokens stay the plain
    engine's, and every block comes back."""
    make_model("llama", tmp_path)
    loaded = load_model(tmp_path)
    prompts = [[2] + list(range(10 + i, 40 + i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(loaded=loaded, kv_cache_gib=0.01, max_num_seqs=8)
    want = _outputs(plain, prompts, params)
    # 14 pages of 16 tokens; the six sequences want 4 each by their end.
    tight = LLM(loaded=loaded, kv_cache_gib=14 * plain.engine.page_bytes / 2**30, max_num_seqs=8,
                num_scheduler_steps=4)
    engine = tight.engine
    assert engine.num_blocks == 14
    assert _outputs(tight, prompts, params) == want
    assert engine.stats()["num_preemptions"] > 0 and steps_on_cpu
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_gemma_multi_step_with_sampled_neighbours(gemma, steps_on_cpu):
    """Gemma's six KV layer groups (sliding-window tables); a batch holding a sampled or
    logprob-reporting request decodes one step at a time, equal to the plain engine."""
    prompts = ["The capital of France is", "Paged attention", "1, 2, 3, 4,"]
    plain = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=6)
    multi = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=6, num_scheduler_steps=3)
    greedy = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    assert _outputs(multi, prompts, greedy) == _outputs(plain, prompts, greedy)
    assert steps_on_cpu
    del steps_on_cpu[:]
    assert _outputs(multi, prompts, PARAMS) == _outputs(plain, prompts, PARAMS)
    assert not steps_on_cpu  # the seeded, logprob-reporting request decodes beside them throughout
    assert multi.engine.block_manager.num_free_blocks == multi.engine.num_blocks


def test_num_scheduler_steps_is_checked(gemma):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(num_scheduler_steps=2.5)
    with pytest.raises(ValueError, match="num_scheduler_steps must be at most 32"):
        LLM(num_scheduler_steps=10**6)
    with pytest.raises(ValueError, match="num_scheduler_steps 4 and speculative 'ngram'"):
        LLM(loaded=gemma, num_scheduler_steps=4, speculative="ngram")
    with pytest.raises(ValueError, match="num_scheduler_steps 4: multi-step decoding runs its steps in captured CUDA"):
        LLM(loaded=gemma, kv_cache_gib=0.25, num_scheduler_steps=4)  # the CPU: no graphs


def test_enforce_eager_must_be_a_bool():
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(enforce_eager="yes")
