"""Bamba, a hybrid of Mamba2 and attention layers: a tiny random checkpoint written by
transformers must give HF's logits and greedy tokens through kvserve's model and batching engine
(ragged batches, chunked prefill, decode, preemption, n > 1 forks), and the recurrent state pool
must hand every slot back (finish, abort, preemption)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.engine.state_slots import StateSlots
from kvserve.loading import load_model
from kvserve.loading.errors import ModelLoadError
from kvserve.loading.footprint import state_pool_footprint
from kvserve.model.attention import KVCache
from kvserve.model.state_cache import StateCache
from kvserve.sequence import Sequence
from tests.tiny_models import hf_greedy, make_model, random_prompts

LOGIT_TOL = 1e-4  # max abs logit difference to HF (fp32)
# Page bytes of the tiny model: one attention layer x 2 KV heads x (16 + 16) x 4 B x 16 tokens.
PAGE_BYTES = 1 * 2 * 32 * 4 * 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bamba")
    hf = make_model("bamba", folder)
    return folder, hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def chunked_logits(loaded, ids: list[int], cuts: list[int], slot: int = 2, block_size: int = 16) -> torch.Tensor:
    """Logits at every position of `ids` fed in steps [cuts[i], cuts[i+1]) through the runner, the
    recurrent state carried in state slot `slot` of a 4-slot pool (1-token steps take the decode path)."""
    cfg = loaded.config
    blocks = -(-len(ids) // block_size)
    kv = KVCache(cfg.num_layers, blocks * block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                 kv_layers=cfg.kv_layers)
    states = StateCache(cfg.mamba_layers, 4, cfg.mamba_conv_dim, cfg.mamba_d_conv, cfg.mamba_n_heads,
                        cfg.mamba_head_dim, cfg.mamba_d_state, torch.float32)
    runner = ModelRunner(loaded.model, kv, block_size=block_size, state_cache=states)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        inp = StepInput(ids[a:b], a, list(range(blocks)), num_logits=b - a, state_slot=slot)
        out.append(runner.execute([inp]).float())
    return torch.cat(out)


# ---------------------------------------------------------------- the model against HF


def test_prompt_logits_match_hf_in_chunks(tiny):
    """One pass, and the same prompt split into prefill chunks and single-token (decode) steps
    that continue the saved conv and SSM states: HF's logits at every position."""
    folder, hf = tiny
    loaded = load_model(folder)
    assert loaded.config.family == "bamba" and loaded.config.mamba_layers == (0, 2, 3)
    ids = random_prompts([40])[0]
    ref = hf_logits(hf, ids)
    for cuts in ([0, 40], [0, 5, 6, 20, 21, 22, 40], [0, 1, 2, 3, 17, 33, 40]):
        ours = chunked_logits(loaded, ids, cuts)
        diff = (ours - ref).abs().max().item()
        assert diff < LOGIT_TOL, f"cuts {cuts}: max abs logit diff {diff}"


def test_engine_greedy_ragged_chunked_matches_hf(tiny):
    """A ragged batch of prompts, prefilled in chunks of at most 16 tokens beside running decodes."""
    folder, hf = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_batched_tokens=16)
    ps = random_prompts([5, 17, 30, 9])
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for p, out in zip(ps, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 20)
    stats = llm.engine.stats()
    assert stats["state_slots_free"] == stats["state_slots_total"] == 64


def test_engine_logprobs_match_hf(tiny):
    """Prompt logprobs (chunked prefill rows) and sampled tokens' logprobs against HF's log-softmax."""
    folder, hf = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_batched_tokens=12)
    p = random_prompts([26])[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                                           prompt_logprobs=1))[0]
    full = p + out.outputs[0].token_ids
    ref = torch.log_softmax(hf_logits(hf, full), dim=-1)
    for pos in range(1, len(p)):
        got = out.prompt_logprobs[pos][p[pos]].logprob
        assert abs(got - ref[pos - 1, p[pos]].item()) < LOGIT_TOL, pos
    for j, (token, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert abs(lp - ref[len(p) - 1 + j, token].item()) < LOGIT_TOL, j


def test_engine_bf16_stays_near_hf_fp32(tiny):
    """bf16 weights, K/V and conv states (the SSM state stays fp32): prompt and decode logprobs
    within bf16's reach of HF's fp32 numbers (a dtype slip in the mixer would be far off)."""
    folder, hf = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_batched_tokens=12, dtype="bfloat16")
    assert llm.engine.state_cache.conv[0].dtype == torch.bfloat16
    assert llm.engine.state_cache.ssm[0].dtype == torch.float32
    p = random_prompts([26])[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1,
                                           prompt_logprobs=1))[0]
    full = p + out.outputs[0].token_ids
    ref = torch.log_softmax(hf_logits(hf, full), dim=-1)
    got = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))] + out.outputs[0].logprobs
    want = [ref[i - 1, full[i]].item() for i in range(1, len(full))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.1


def test_engine_preemption_recomputes_state(tiny):
    """A KV pool of 8 pages for 3 sequences of up to 4 pages each: sequences are preempted and
    recompute their state from the prompt, and still give HF's tokens; every slot comes back."""
    folder, hf = tiny
    llm = LLM(str(folder), kv_cache_gib=8 * PAGE_BYTES / 2**30, max_num_batched_tokens=16)
    assert llm.engine.num_blocks == 8
    ps = random_prompts([30, 25, 28], seed=3)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    for p, out in zip(ps, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 24)
    assert stats["state_slots_free"] == stats["state_slots_total"]
    llm.engine.block_manager.check_invariants([])


def test_n2_forks_the_state(tiny):
    """n = 2 samples fork sample 0's state after the prompt: each equals an n = 1 run with its own
    seed (seed + index), so the child's copied state is exactly the parent's."""
    folder, _ = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_batched_tokens=16)
    p = random_prompts([21], seed=5)[0]
    both = llm.generate([p], SamplingParams(n=2, temperature=1.0, seed=42, max_tokens=16, ignore_eos=True))[0]
    one = [llm.generate([p], SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True))[0]
           for s in (42, 43)]
    assert [c.token_ids for c in both.outputs] == [o.outputs[0].token_ids for o in one]
    assert both.outputs[0].token_ids != both.outputs[1].token_ids  # two real samples, not one copied
    stats = llm.engine.stats()
    assert stats["state_slots_free"] == stats["state_slots_total"]


def test_no_kv_cache_same_tokens(tiny):
    folder, hf = tiny
    p = random_prompts([20], seed=9)[0]
    out = LLM(str(folder), kv_cache_gib=0.01, use_kv_cache=False).generate(
        [p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, p, 10)


# ---------------------------------------------------------------- the state pool's books


def test_abort_and_finish_give_every_slot_back(tiny):
    """Slots are taken at admission and returned on abort (running or waiting) and finish."""
    folder, _ = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_seqs=4, max_num_batched_tokens=16)
    engine = llm.engine
    assert engine.stats()["state_slots_total"] == 4
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts([12, 15, 20, 9, 11], seed=4)]
    for _ in range(10):  # chunked prefill admits them over a few steps
        engine.step()
        if engine.scheduler.num_running == 4:
            break
    assert engine.stats()["state_slots_free"] == 0  # four running, the fifth waits for a slot
    assert engine.scheduler.num_waiting == 1
    engine.abort(ids[1])
    engine.abort(ids[4])  # a waiting one
    engine.block_manager.check_invariants(engine.scheduler.running)
    assert engine.stats()["state_slots_free"] == 1
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.check_invariants(engine.scheduler.running)
    assert engine.stats()["state_slots_free"] == 4
    engine.block_manager.check_invariants([])


def test_failed_pass_restores_the_states(tiny, monkeypatch):
    """A pass that raises in a late layer leaves every continuing sequence's state as before it,
    so the engine's rerun (a sequence at a time) computes the same tokens."""
    folder, hf = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_batched_tokens=16)
    engine = llm.engine
    mixer = engine.loaded.model.layers[3].mamba  # the last Mamba layer: layers 0 and 2 ran before it
    calls = {"n": 0}
    real = mixer.forward

    def flaky(x, rec):
        calls["n"] += 1
        if calls["n"] == 4:  # the 4th pass: both sequences decoding
            assert rec.decode_rows is not None and rec.decode_rows.numel() == 2
            raise RuntimeError("injected")
        return real(x, rec)

    monkeypatch.setattr(mixer, "forward", flaky)
    ps = random_prompts([7, 10], seed=8)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert calls["n"] > 4
    for p, out in zip(ps, outs):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 12)


def _seq(i: int, n: int = 1, index: int = 0) -> Sequence:
    return Sequence(i, f"r{i}", [1, 2, 3], SamplingParams(n=n, temperature=1.0), 0.0, index=index)


def test_state_slots_reserve_forks():
    """Sample 0 of an n-sample request reserves its forks' slots; forks consume them; frees give
    everything back; a request wider than the pool is rejected by the scheduler."""
    slots = StateSlots(3)
    parent, child, other = _seq(0, n=2), _seq(1, n=2, index=1), _seq(2)
    assert slots.needed(parent) == 2
    slots.allocate(parent)
    assert slots.num_free == 1  # one held, one reserved for the fork
    slots.allocate(other)
    assert slots.num_free == 0 and slots.needed(_seq(3)) == 1
    slots.fork(parent, child)
    assert slots.take_copies() == [(parent.state_slot, child.state_slot)]
    slots.check_invariants([parent, child, other])
    for s in (parent, child, other):
        slots.free(s)
        slots.free(s)  # twice is safe
    assert slots.num_free == 3
    slots.check_invariants([])

    from kvserve.engine.scheduler import Scheduler
    bm = BlockManager(16, 4, enable_prefix_caching=False, num_state_slots=2)
    sched = Scheduler(bm, max_num_seqs=2)
    wide = _seq(5, n=3)
    sched.add(wide)
    out = sched.schedule()
    assert out.finished_with_error == [wide] and "3 recurrent state slots" in wide.error


def test_block_manager_refuses_prefix_caching_with_states():
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(16, 4, enable_prefix_caching=True, num_state_slots=2)


def test_engine_turns_prefix_caching_off(tiny, caplog):
    """Asked for prefix caching, a hybrid engine turns it off with a log line: a repeated prompt
    never hits (a hit would skip tokens the Mamba layers never saw) and gives the same tokens."""
    folder, _ = tiny
    with caplog.at_level("INFO", logger="kvserve.engine.builder"):
        llm = LLM(str(folder), kv_cache_gib=0.01, enable_prefix_caching=True)
    assert "prefix caching is off" in caplog.text
    assert not llm.engine.block_manager.enable_prefix_caching
    p = random_prompts([40], seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([p], params)[0].outputs[0].token_ids
    again = llm.generate([p], params)[0].outputs[0].token_ids
    assert first == again and llm.engine.stats()["prefix_cache_hits"] == 0


def test_memory_planning_counts_the_state_pool(tiny):
    folder, _ = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_seqs=6)
    cache = llm.engine.state_cache
    cfg = llm.engine.model_config
    conv, ssm = cfg.state_elements_per_layer()
    assert cache.nbytes == 6 * 3 * (conv + ssm) * 4
    assert state_pool_footprint(folder, 6, "auto") == cache.nbytes


# ---------------------------------------------------------------- refused input


def _edited(folder, tmp_path, **changes):
    dst = tmp_path / "edited"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field, value", [
    ("layers_block_type", ["mamba", "attention", "moe", "mamba"]),
    ("time_step_limit", [0.0, 10.0]),
    ("attn_layer_indices", [1, 9]),
    ("num_experts", 4),
])
def test_unsupported_config_is_refused_by_name(tiny, tmp_path, field, value):
    folder, _ = tiny
    with pytest.raises(ModelLoadError, match=field):
        load_model(_edited(folder, tmp_path, **{field: value}))


@pytest.mark.parametrize("option, value", [("speculative", "ngram"), ("streaming_window", 64)])
def test_unsupported_engine_options_are_refused(tiny, option, value):
    folder, _ = tiny
    with pytest.raises(ValueError, match="hybrid"):
        LLM(str(folder), kv_cache_gib=0.01, **{option: value})


# ---------------------------------------------------------------- the roofline tool's arithmetic


def test_roofline_counts_state_flat_next_to_kv():
    """Bamba-9B's preset: K/V for its 3 attention layers only, and 29 Mamba layers' state that is
    the same at every length; the all-attention model of the same shape caches 32 layers."""
    from dataclasses import replace

    from kvserve.tools.analysis import roofline as rl
    from kvserve.tools.analysis.presets import MODELS, shape_from_hf_config

    m = MODELS["bamba-9b"]
    assert m.attention_layers == 3 and m.kv_layers == 3
    assert rl.kv_bytes_per_token(m) == 3 * 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bf16
    conv = (128 * 64 + 2 * 128) * 3 * 2  # (inner + B + C channels) x (d_conv - 1) inputs, bf16
    ssm = 128 * 64 * 128 * 4  # heads x head_dim x d_state, fp32
    assert rl.state_bytes_per_sequence(m) == 29 * (conv + ssm) == 123_104_768
    for s in (1024, 4096, 16384):
        assert rl.cache_bytes_per_sequence(m, s) == s * 12288 + 123_104_768
    dense = replace(m, mamba_layers=0)
    assert rl.state_bytes_per_sequence(dense) == 0 and rl.kv_bytes_per_token(dense) == 32 * 4096
    assert rl.memory(m, 8, 16384) - rl.weight_memory(m) == 8 * (16384 * 12288 + 123_104_768)
    # hybrid memory grows ~10.7x slower with the length than the all-attention model's
    assert (rl.cache_bytes_per_sequence(dense, 16384) - rl.cache_bytes_per_sequence(dense, 1024)) == pytest.approx(
        32 / 3 * (rl.cache_bytes_per_sequence(m, 16384) - rl.cache_bytes_per_sequence(m, 1024)))
    ops = {op.name for op in rl.decode_costs(m, 4, 4096)}
    assert {"mamba_proj", "ssm_scan"} <= ops
    cfg = {"model_type": "bamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256, "mamba_n_heads": 128,
           "mamba_d_head": "auto", "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
           "attn_layer_indices": [9, 18, 27], "num_experts": 1}
    assert shape_from_hf_config(cfg, "bamba-9b") == m


def test_roofline_shape_of_the_tiny_checkpoint_matches_hf_and_the_engine(tiny):
    """The tiny model's shape: the roofline's parameter count is HF's exactly, and its state per
    sequence (fp32) is what one slot of the engine's state pool holds."""
    from dataclasses import replace

    from kvserve.tools.analysis import roofline as rl
    from kvserve.tools.analysis.presets import shape_from_model_config

    folder, hf = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01, max_num_seqs=3)
    shape = replace(shape_from_model_config(llm.engine.model_config, "tiny"), weight_bytes=4.0, kv_bytes=4.0)
    assert rl.num_params(shape) == sum(p.numel() for p in hf.parameters())
    assert rl.state_bytes_per_sequence(shape) == llm.engine.state_cache.slot_nbytes
    assert rl.kv_bytes_per_token(shape) * llm.engine.config.block_size == llm.engine.page_bytes


def test_ssm_decode_kernel_matches_the_torch_update(tiny):
    """kernels/ssm_decode.c against Mamba2Mixer's torch update: the same states and outputs up to
    the readout's summation order, a zero start where a slot holds no state (even NaN garbage),
    other slots untouched."""
    from kvserve.kernels import ssm_decode

    folder, _ = tiny
    mixer = load_model(folder).model.layers[0].mamba
    g = torch.Generator().manual_seed(0)
    H, P, N, n = mixer.num_heads, mixer.head_dim, mixer.d_state, 3
    pool = torch.randn(5, H, P, N, generator=g)
    pool[4] = float("nan")  # a slot whose old contents must not be read
    slots, has_state = torch.tensor([2, 4, 0]), torch.tensor([True, False, True])
    x, B, C = (torch.randn(n, H, k, generator=g) for k in (P, N, N))
    dt, A = mixer._dt(torch.randn(n, H, generator=g))
    ref_pool = pool.clone()
    ref = mixer._decode_ssm(ref_pool, slots, has_state, x, dt, A, B, C)
    got = ssm_decode(pool, slots, has_state, x, dt, A, B, C, mixer.D.float())
    assert got is not None  # KVSERVE_REQUIRE_KERNELS=1 in the test runs: a compiler is there
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert torch.equal(pool[[1, 3]], ref_pool[[1, 3]])


def test_roofline_cli_reports_the_state(capsys):
    from kvserve.cli import main

    assert main(["roofline", "--model", "bamba-9b", "--seq-len", "16384", "--batch", "1,8"]) == 0
    text = capsys.readouterr().out
    assert "| recurrent state per sequence (29 Mamba layers, any S) | 123,104,768 (123 MB) |" in text
    assert "| KV bytes per sequence (S = 16384) | 201,326,592 (201 MB) |" in text
    assert "3 of 32 layers (29 Mamba2)" in text and "ssm_scan" in text
