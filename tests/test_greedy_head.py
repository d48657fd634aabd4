"""Greedy tokens through the int8 screen of the head (kernels/greedy_head.c, accel/greedy_head.py):
bitwise the argmax of the fp32 logits the panel kernel computes (first index among equal maxima),
on random heads, planted ties, outliers, rows the screen cannot settle, and Gemma's real head."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kvserve import kernels
from kvserve.accel.greedy_head import (
    GreedyHead,
    drop_head_screen,
    greedy_tokens,
    head_screen,
    screen_head,
)
from kvserve.accel.panels import Panels
from kvserve.accel.prepare import prepare_model

needs_screen = pytest.mark.skipif(
    kernels.pack_panels(torch.zeros(1, 1)) is None
    or kernels.pack_head_screen(kernels.pack_panels(torch.zeros(1, 2)), 1) is None,
    reason="panel / screen kernels unavailable (no compiler, or no AVX2)")


def _full_argmax(x: torch.Tensor, panels: Panels) -> torch.Tensor:
    """The oracle: argmax over every fp32 logit of the packed head (what the sampler picks)."""
    return kernels.argmax_rows(panels.matmul(x))


def _screen(w: torch.Tensor, x: torch.Tensor, cap: int = kernels.SCREEN_CAP) -> tuple[torch.Tensor, Panels]:
    panels = Panels.pack(w)
    screen = kernels.pack_head_screen(panels.packed, panels.rows)
    return kernels.screen_argmax(x, panels.packed, panels.rows, screen, cap=cap), panels


@needs_screen
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_head_with_a_non_finite_weight_gets_no_screen(bad):
    """The screen's bounds need finite weights: one NaN or infinity anywhere (found while the
    screen is packed) and there is none; the caller computes full logits."""
    w = torch.randn(300, 40, generator=torch.Generator().manual_seed(1))
    assert kernels.pack_head_screen(Panels.pack(w).packed, 300) is not None
    w[217, 31] = bad
    assert kernels.pack_head_screen(Panels.pack(w).packed, 300) is None


@needs_screen
@pytest.mark.parametrize("v, k, m", [(1000, 64, 1), (4099, 33, 7), (517, 640, 13), (3001, 96, 23), (20000, 128, 64),
                                     (16, 2, 3)])
def test_screen_equals_the_full_argmax(v, k, m):
    g = torch.Generator().manual_seed(v + k + m)
    w = torch.randn(v, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g) * 3
    x[:, 0] *= 40  # an outlier channel, as final hidden states have
    got, panels = _screen(w, x)
    assert (got >= 0).all()
    assert torch.equal(got, _full_argmax(x, panels))


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[M, V] bool -> [M, ceil(V / 32)] int32 words, xgrammar's layout (bit v % 32 of word v // 32)."""
    m, v = allowed.shape
    bits = torch.zeros(m, -(-v // 32) * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    words = (bits.view(m, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@needs_screen
@pytest.mark.parametrize("v, k, m", [(1000, 64, 5), (4099, 33, 7), (20000, 128, 13)])
def test_a_masked_screen_equals_the_argmax_of_the_masked_logits(v, k, m):
    """A grammar's mask: each row's argmax over its allowed tokens, the logits with
    `apply_token_bitmask` applied (the oracle): every token, random halves, a few far from the
    unmasked argmax, the last partial panel alone, one token; a row allowing none is left at -1."""
    g = torch.Generator().manual_seed(v + k)
    w = torch.randn(v, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g) * 3
    x[:, 0] *= 40
    panels = Panels.pack(w)
    screen = kernels.pack_head_screen(panels.packed, panels.rows)
    allowed = torch.rand(m, v, generator=g) < 0.5
    allowed[0] = True
    allowed[1] = False
    allowed[1, torch.randint(v, (5,), generator=g)] = True
    allowed[2] = False
    allowed[2, v - (v % 16 or 16):] = True  # the last panel's tokens only
    allowed[3] = False
    allowed[3, v // 2] = True
    allowed[4] = False
    mask = _bitmask(allowed)
    got = kernels.screen_argmax(x, panels.packed, panels.rows, screen, mask)
    logits = panels.matmul(x)
    kernels.apply_token_bitmask(logits, mask, list(range(m)))
    want = kernels.argmax_rows(logits)
    assert got[4] == -1 and got[3] == v // 2
    assert torch.equal(got[:4], want[:4]) and torch.equal(got[5:], want[5:])
    assert got[1] != _full_argmax(x[1:2], panels)[0]  # the mask, not the logits alone, chose it
    with pytest.raises(ValueError, match="allowed"):
        kernels.screen_argmax(x, panels.packed, panels.rows, screen, mask[:, 1:])


@needs_screen
def test_exact_ties_take_the_first_index_and_near_ties_are_told_apart():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 96, generator=g) * 0.05
    x = torch.randn(4, 96, generator=g)
    for i in range(4):  # rows aligned with a token: a clear winner ...
        w[100 + i] = x[i] / x[i].norm()
    w[2900:2904] = w[100:104]  # ... tied bitwise by a later copy (the first index must win)
    w[1500] = w[101]
    w[1500, 5] = torch.nextafter(w[1500, 5], torch.tensor(10.0) * w[1500, 5].sign())  # one ulp more
    got, panels = _screen(w, x)
    assert torch.equal(got, _full_argmax(x, panels))
    assert got[0] == 100 and got[2:].tolist() == [102, 103]


@needs_screen
def test_rows_the_screen_cannot_settle_are_left_to_the_caller():
    w = torch.randn(500, 32) * 0.05
    w[200:400] = w[7]  # 201 bitwise ties at the top for a row aligned with token 7
    x = torch.stack([w[7] * 10, torch.zeros(32), torch.full((32,), float("nan")), torch.randn(32)])
    got, _ = _screen(w, x[:1], cap=8)
    assert got.tolist() == [-1]  # more than 8 candidates
    got, panels = _screen(w, x)
    # With room for the candidates: the first of the ties; a zero row (every logit ties) and a
    # non-finite row are left to the full logits.
    assert got.tolist() == [7, -1, -1, _full_argmax(x[3:], panels)[0]]


@needs_screen
def test_screen_with_fewer_threads_than_asked():
    """The OpenMP runtime may start fewer threads than asked (OMP_THREAD_LIMIT, nested regions):
    the slots of threads that never ran must not count. Every logit is negative here."""
    code = """
import torch
from kvserve import kernels
from kvserve.accel.panels import Panels
g = torch.Generator().manual_seed(0)
w = torch.randn(3000, 64, generator=g) * 0.05 - 1.0
x = torch.rand(3, 64, generator=g) + 0.5
p = Panels.pack(w)
s = kernels.pack_head_screen(p.packed, p.rows)
tok = torch.empty(3, dtype=torch.int64)
kernels.kernel_lib("greedy_head").screen_argmax(
    x.data_ptr(), p.packed.data_ptr(), p.packed.shape[2], s.q.data_ptr(), s.scale.data_ptr(), s.c1.data_ptr(),
    s.c2.data_ptr(), None, 0, tok.data_ptr(), 3, 3000, 64, 4096, 4)
want = kernels.argmax_rows(p.matmul(x))
assert torch.equal(tok, want), (tok, want)
"""
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_THREAD_LIMIT": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _tiny(folder, tied: bool):
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    make_model("llama", folder, tie_word_embeddings=tied)
    model = load_model(folder, "float32", "cpu").model
    prepare_model(model, "cpu")
    return model


@needs_screen
@pytest.mark.parametrize("tied", [True, False])
def test_model_greedy_tokens_equal_the_argmax_of_compute_logits(tmp_path, tied):
    model = _tiny(tmp_path / "m", tied)
    assert isinstance(head_screen(model), GreedyHead)
    h = torch.randn(9, model.config.hidden_size) * 2
    h[4] = 0  # unsettled by the screen: computed in full
    with torch.inference_mode():
        want = kernels.argmax_rows(model.compute_logits(h))
        assert torch.equal(greedy_tokens(model, h), want)
    head = model.lm_head_weight
    with torch.no_grad():  # an in-place change (pruning, SmoothQuant): screen and panels rebuilt
        head.mul_(-1)
    with torch.inference_mode():
        want = kernels.argmax_rows(model.compute_logits(h))
        assert torch.equal(greedy_tokens(model, h), want)


@needs_screen
def test_no_screen_without_a_packed_fp32_head(tmp_path):
    model = _tiny(tmp_path / "m", True)
    drop_head_screen(model)
    assert greedy_tokens(model, torch.randn(2, model.config.hidden_size)) is None
    holder = nn.Sequential(nn.Linear(8, 8))
    prepare_model(holder, "cpu")  # not a CausalLM: nothing to screen
    assert head_screen(holder) is None


@needs_screen
def test_gemma_generation_through_the_screen_equals_the_full_logits(gemma_llm, monkeypatch):
    from kvserve import SamplingParams

    model = gemma_llm.engine.runner.model
    assert isinstance(head_screen(model), GreedyHead)
    calls = []
    real = kernels.screen_argmax
    monkeypatch.setattr(kernels, "screen_argmax", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    prompts = ["The capital of France is", "def fibonacci(n):", "Robert Boulter is an English film and television"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in gemma_llm.generate(prompts, greedy)]
    assert calls and max(calls) == 3
    # A sampled request in the batch: the step takes the full logits; the greedy rows agree.
    sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True)
    mixed = gemma_llm.generate(prompts + ["Once upon a time"], [greedy] * 3 + [sampled])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == got
    drop_head_screen(model)
    try:
        n = len(calls)
        assert [o.outputs[0].token_ids for o in gemma_llm.generate(prompts, greedy)] == got
        assert len(calls) == n
    finally:
        screen_head(model)  # the shared engine keeps its screen


@needs_screen
def test_greedy_speculative_verification_through_the_screen(gemma, monkeypatch):
    """Plain greedy drafts are verified from the screen's argmax rows (no logits): the same
    tokens as plain decoding, and the drafts are still accepted."""
    from kvserve import LLM, SamplingParams
    from tests.test_speculative import PROMPTS

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]  # an input-grounded prompt (n-gram drafts hit) and a free one
    want = [o.outputs[0].token_ids for o in LLM(loaded=gemma, kv_cache_gib=0.25).generate(prompts, greedy)]
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, speculative="ngram", num_speculative_tokens=4)
    calls = []
    real = kernels.screen_argmax
    monkeypatch.setattr(kernels, "screen_argmax", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert max(calls) > len(prompts)  # verification rows went through the screen
    # A request asking for logprobs: its steps take the full logits, the tokens stay the same.
    with_lp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    n = len(calls)
    out = llm.generate(prompts[0], with_lp)[0].outputs[0]
    assert out.token_ids == want[0] and len(out.logprobs) == 24 and len(calls) == n


@needs_screen
def test_greedy_under_grammars_through_the_masked_screen(gemma_llm, monkeypatch):
    """Greedy rows under a JSON schema, a regex and a choice (beside an unconstrained greedy row)
    take their tokens from the screen with their grammars' masks, not from full logits: the same
    tokens as the full logits masked by the sampler (the engine told it has no screen), and every
    constrained step through the screen. A sampled constrained row puts its step back on the
    full logits."""
    from kvserve import SamplingParams
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.sampling_params import StructuredOutputsParams as SO

    masked = []
    real = kernels.screen_argmax
    monkeypatch.setattr(kernels, "screen_argmax",
                        lambda *a, **k: masked.append(a[4] is not None) or real(*a, **k))
    prompts = ["A user record as JSON:", "Email:", "The best city is", "The capital of France is"]
    constraints = [SO(json={"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name", "age"]}, disable_any_whitespace=True), SO(regex=r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"),
                   SO(choice=["Paris", "London", "New York"]), None]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in constraints]
    got = gemma_llm.generate(prompts, params)
    assert sum(masked) >= max(len(o.outputs[0].token_ids) for o in got) - 1  # (the first tokens: prefill)
    assert [o.outputs[0].finish_reason for o in got[1:3]] == ["stop"] * 2
    assert got[2].outputs[0].text in ("Paris", "London", "New York")
    n = len(masked)
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "has_greedy_screen", property(lambda self: False))
        want = gemma_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert not any(masked[n:])
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=constraints[1])
    n = len(masked)
    mixed = [o.outputs[0].token_ids for o in gemma_llm.generate(prompts[:2], [params[0], sampled])]
    assert mixed[0] == got[0].outputs[0].token_ids
    assert sum(masked[n:]) <= len(mixed[0]) - len(mixed[1])  # only the steps after the sampled row ended


def _screen_top_k(w: torch.Tensor, x: torch.Tensor, top_k: list[int], cap: int = kernels.SCREEN_CAP,
                  touched: list[list[int]] | None = None):
    panels = Panels.pack(w)
    screen = kernels.pack_head_screen(panels.packed, panels.rows)
    logits, left = kernels.screen_top_k(x, panels.packed, panels.rows, screen, top_k, touched, cap=cap)
    return logits, left, panels.matmul(x)


def _holds_the_top_k(logits: torch.Tensor, full: torch.Tensor, k: int) -> None:
    """The oracle's top k (ties with the k-th kept) and every token within 2^-20 of the k-th are
    present with the full logits' values, bitwise; every other token is -inf or its full logit."""
    kth = full.topk(k).values[-1]
    near = full >= kth - kth.abs() * 2.0**-20
    kept = logits > float("-inf")
    assert bool(kept[near].all())
    assert torch.equal(logits[kept], full[kept])


@needs_screen
@pytest.mark.parametrize("v, k, m", [(1000, 64, 1), (4099, 33, 7), (20000, 128, 13), (3001, 96, 23)])
def test_top_k_screen_keeps_each_rows_top_k_with_the_full_logits(v, k, m):
    g = torch.Generator().manual_seed(v + k + m)
    w = torch.randn(v, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g) * 3
    x[:, 0] *= 40  # an outlier channel, as final hidden states have
    top_k = [[1, 40, kernels.SCREEN_MAX_TOP_K, 7, 50][i % 5] for i in range(m)]
    logits, left, full = _screen_top_k(w, x, top_k)
    assert left == []
    for i in range(m):
        _holds_the_top_k(logits[i], full[i], top_k[i])
        assert (logits[i] > float("-inf")).sum() < v // 2  # the point: few exact logits
    with pytest.raises(ValueError, match="top_k"):
        _screen_top_k(w, x, [0] * m)
    with pytest.raises(ValueError, match="top_k"):
        _screen_top_k(w, x, [kernels.SCREEN_MAX_TOP_K + 1] * m)


@needs_screen
@pytest.mark.parametrize("v, k, m", [(4099, 33, 3), (20000, 128, 8)])
def test_top_k_screen_computes_touched_tokens_and_covers_the_top_k_after_their_change(v, k, m):
    """A row's touched tokens (those its penalties or biases change) get their logits bitwise, and
    whatever the change to them (all pushed far down, as a repetition penalty does to the row's
    best tokens; some raised from the bottom, as a logit bias can), the row still holds the top k
    of the changed full row and every token near its k-th."""
    g = torch.Generator().manual_seed(v + m)
    w = torch.randn(v, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g) * 3
    x[:, 0] *= 40
    full = Panels.pack(w).matmul(x)
    top_k = [[1, 5, 40, kernels.SCREEN_MAX_TOP_K][i % 4] for i in range(m)]
    touched = []
    for i in range(m):  # the row's 30 best, its 10 worst and 40 at random
        order = full[i].argsort(descending=True)
        picked = torch.cat([order[:30], order[-10:], torch.randperm(v, generator=g)[:40]]).unique()
        touched.append(picked.tolist() if i != 1 else [])
    logits, left, _ = _screen_top_k(w, x, top_k, touched=touched)
    assert left == []
    changes = [lambda t: t - 1000.0, lambda t: t + 1000.0, lambda t: t * torch.linspace(-2, 2, t.numel())]
    for i in range(m):
        t = torch.tensor(touched[i], dtype=torch.long)
        assert torch.equal(logits[i, t], full[i, t])
        for change in changes:
            want, got = full[i].clone(), logits[i].clone()
            want[t], got[t] = change(want[t]), change(got[t])
            _holds_the_top_k(got, want, top_k[i])
    w_bad = [[0, 0]] + [[]] * (m - 1)
    with pytest.raises(ValueError, match="distinct"):
        _screen_top_k(w, x, top_k, touched=w_bad)
    with pytest.raises(ValueError, match="touched"):
        _screen_top_k(w, x, top_k, touched=[[v]] + [[]] * (m - 1))
    with pytest.raises(ValueError, match="touched"):
        _screen_top_k(w, x, top_k, touched=[[]])


@needs_screen
def test_the_sampler_draws_the_same_token_from_penalized_screened_rows():
    """Rows with repetition, presence and frequency penalties, logit biases and min_tokens, greedy
    or sampled under top-k: the sampler gives the same tokens from the screen's rows (with the
    tokens `Sampler.screened_top_k` lists) as from the full rows, the penalties applied to both."""
    from kvserve.sampling import Sampler
    from kvserve.sampling.sampler import SamplingRequest
    from kvserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(11)
    v = 20000
    w = torch.randn(v, 128, generator=g) * 0.05
    x = torch.randn(8, 128, generator=g) * 3
    x[:, 0] *= 40
    full = Panels.pack(w).matmul(x)
    best = full.argsort(dim=1, descending=True)
    eos = int(best[5, 0])  # row 5's best token is an end, banned under min_tokens
    settings = [dict(temperature=0, repetition_penalty=1.3), dict(temperature=0, repetition_penalty=0.7),
                dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1),
                dict(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
                dict(temperature=1.2, top_k=5, frequency_penalty=2.0),
                dict(temperature=0, min_tokens=10), dict(temperature=0.7, top_k=50),
                dict(temperature=1.0, top_k=128, min_p=0.05, presence_penalty=2.0)]
    sampler = Sampler(eos_token_ids=[eos])
    for seed in range(6):
        rows = []
        for i, kw in enumerate(settings):
            seen = best[i, :20][torch.randperm(20, generator=g)[:8]].tolist()  # some of its best tokens
            rows.append(dict(prompt=seen[:4] + [3, 4], output=seen[4:] + seen[4:6],
                             params=SamplingParams(**kw, logit_bias={int(best[i, -1]): 80.0} if i == 3 else None)))
        screened = sampler.screened_top_k([SamplingRequest(r["params"], r["prompt"], r["output"]) for r in rows], v,
                                          kernels.SCREEN_MAX_TOP_K, 4096)
        assert screened is not None and any(screened.touched)
        logits, left, _ = _screen_top_k(w, x, screened.top_k, touched=screened.touched)
        assert left == []
        tokens = []
        for source in (logits, full):
            reqs = [SamplingRequest(r["params"], r["prompt"], r["output"], torch.Generator().manual_seed(seed * 10 + i))
                    for i, r in enumerate(rows)]
            tokens.append(sampler(source, reqs).token_ids)
        assert tokens[0] == tokens[1]
        assert tokens[0][3] == int(best[3, -1])  # the biased token won
        assert tokens[0][5] != eos


@needs_screen
def test_top_k_screen_keeps_ties_and_near_ties_of_the_kth():
    """Bitwise copies of the k-th token (top-k keeps every token tied with it) and a copy one ulp
    below (a temperature's division may round the two to one quotient) are all kept."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3000, 96, generator=g) * 0.05
    x = torch.randn(2, 96, generator=g)
    full = Panels.pack(w).matmul(x)
    kth = int(full[0].topk(10).indices[-1])
    w[2990:2993] = w[kth]
    w[1200] = w[kth]
    while Panels.pack(w[1200:1201]).matmul(x[:1])[0, 0] >= full[0, kth]:  # a few ulps lower
        w[1200, 0] = torch.nextafter(w[1200, 0], -10 * x[0, 0].sign())
    logits, left, full = _screen_top_k(w, x, [10, 10])
    assert left == []
    assert full[0, kth] - full[0, 1200] < full[0, kth].abs() * 2.0**-20
    assert bool((logits[0, [kth, 2990, 2991, 2992, 1200]] > float("-inf")).all())
    _holds_the_top_k(logits[0], full[0], 10)
    _holds_the_top_k(logits[1], full[1], 10)


@needs_screen
def test_top_k_rows_the_screen_cannot_settle_are_left_to_the_caller():
    w = torch.randn(500, 32) * 0.05
    x = torch.stack([torch.randn(32), torch.zeros(32), torch.full((32,), float("nan")), torch.randn(32)])
    logits, left, full = _screen_top_k(w, x, [5, 5, 5, 20], cap=8)
    assert 1 in left and 2 in left and 3 in left  # a zero row, a NaN row, more than 8 candidates
    logits, left, full = _screen_top_k(w, x, [5, 5, 5, 5])
    assert left == [1, 2]
    _holds_the_top_k(logits[0], full[0], 5)
    _holds_the_top_k(logits[3], full[3], 5)


@needs_screen
def test_the_sampler_draws_the_same_token_from_the_screens_rows():
    """What the screen's rows are for: under temperature, top-k, top-p and min-p the sampler (its C
    kernel and its torch path) draws from a screened row the token it draws from the full row for
    the same uniform number."""
    from kvserve.sampling.sampler import filter_logits, sample_rows
    from kvserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(5)
    w = torch.randn(20000, 128, generator=g) * 0.05
    x = torch.randn(8, 128, generator=g) * 3
    x[:, 0] *= 40
    top_k = [1, 2, 5, 20, 40, 50, 100, 128]
    logits, left, full = _screen_top_k(w, x, top_k)
    assert left == []
    for t, p, mp in [(1.0, 1.0, 0.0), (0.3, 1.0, 0.0), (0.8, 0.95, 0.05), (2.5, 0.5, 0.0), (1.0, 1.0, 0.3)]:
        params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp) for k in top_k]
        for seed in range(10):
            draws = []
            for rows in (logits, full):
                gens = [torch.Generator().manual_seed(100 * seed + i) for i in range(8)]
                draws.append(sample_rows(rows, list(range(8)), params, gens))
            assert torch.equal(draws[0], draws[1])
        assert torch.equal(filter_logits(logits, params).softmax(-1), filter_logits(full, params).softmax(-1))


def test_which_rows_the_screen_serves():
    """Greedy rows (k = 1) and top-k rows up to the screen's largest k, penalties and logit biases
    included (their touched tokens listed, within the step's budget), with one random or penalized
    row at least; a row with a grammar or logprobs, or random without top-k, takes the full logits
    for the whole step."""
    from kvserve.sampling import Sampler
    from kvserve.sampling.sampler import SamplingRequest
    from kvserve.sampling_params import SamplingParams

    def req(prompt=(1, 2, 900), out=(3, 3), **kw):
        return SamplingRequest(SamplingParams(**kw), list(prompt), list(out))

    sampler = Sampler(eos_token_ids=[1])
    greedy, topk = req(temperature=0), req(temperature=0.7, top_k=50)
    got = sampler.screened_top_k([greedy, topk, req(temperature=1, top_k=128, top_p=0.9)], 1000, 128, 2048)
    assert got.top_k == [1, 50, 128] and got.touched == [[], [], []]
    assert sampler.screened_top_k([greedy, greedy], 1000, 128, 2048) is None  # the greedy screen's
    for other in (req(temperature=1), req(temperature=1, top_k=129), req(temperature=1, top_k=20, logprobs=2)):
        assert sampler.screened_top_k([topk, other], 1000, 128, 2048) is None
    assert sampler.screened_top_k([topk], 50, 128, 2048) is None  # top-k of the whole vocabulary: no cut
    # Penalized rows list the tokens their penalties change (in the vocabulary): the seen tokens for a
    # repetition penalty, the generated ones for presence / frequency, the banned ends under
    # min_tokens, the biased ones.
    rows = [req(temperature=1, top_k=20, repetition_penalty=1.1), req(temperature=0, presence_penalty=0.5),
            req(temperature=1, top_k=20, min_tokens=5, stop_token_ids=[7, 5000]),
            req(temperature=0, logit_bias={5: 1.0, 999: -2.0}), req(temperature=0, frequency_penalty=-0.5, out=())]
    got = sampler.screened_top_k(rows, 1000, 128, 2048)
    assert got.top_k == [20, 1, 20, 1, 1]
    assert got.touched == [[1, 2, 3, 900], [3], [1, 7], [5, 999], []]
    assert sampler.screened_top_k([greedy, req(temperature=0, repetition_penalty=1.2)], 1000, 128, 2048) is not None
    # A step's budget of touched tokens, and a prompt too long to count.
    assert sampler.screened_top_k(rows, 1000, 128, 8) is None  # 4 + 1 + 2 + 2 tokens
    assert sampler.screened_top_k(rows, 1000, 128, 9) is not None
    long = req(prompt=range(10, 10 + 4 * 8 + 64), temperature=0, repetition_penalty=1.1)
    assert sampler.screened_top_k([long], 1000, 128, 8) is None
    biased = req(prompt=range(10, 10 + 4 * 8 + 64), temperature=0, logit_bias={5: 1.0})  # reads no prompt
    assert sampler.screened_top_k([biased], 1000, 128, 8).touched == [[5]]


@needs_screen
def test_gemma_top_k_sampling_through_the_screen_equals_the_full_logits(gemma_llm, monkeypatch):
    """Seeded top-k requests (HF's default 50, llama.cpp's chain) beside greedy ones draw the same
    tokens with the screen as with the full logits; a step with a row the screen cannot serve
    (temperature alone, logprobs), or with more rows than it serves, computes every logit."""
    from kvserve import SamplingParams
    from kvserve.engine.model_runner import ModelRunner

    calls = []
    real = kernels.screen_top_k
    monkeypatch.setattr(kernels, "screen_top_k", lambda *a, **k: calls.append(len(a[4])) or real(*a, **k))
    prompts = ["The capital of France is", "def fibonacci(n):", "Robert Boulter is an English film and television",
               "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=50, max_tokens=16, seed=1, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, max_tokens=16, seed=2,
                             ignore_eos=True),
              SamplingParams(temperature=1.5, top_k=128, max_tokens=16, seed=3, ignore_eos=True, n=2)]
    got = [[c.token_ids for c in o.outputs] for o in gemma_llm.generate(prompts, params)]
    assert calls and max(calls) == 5  # n=2: two sequences from the second step on
    monkeypatch.setattr(ModelRunner, "screen_top_k", property(lambda self: (0, 0, 0)))
    n = len(calls)
    assert [[c.token_ids for c in o.outputs] for o in gemma_llm.generate(prompts, params)] == got
    assert len(calls) == n
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "screen_top_k", lambda *a, **k: calls.append(len(a[4])) or real(*a, **k))
    n = len(calls)
    gemma_llm.generate(prompts[:2], [SamplingParams(temperature=0.7, top_k=50, max_tokens=4, seed=1, ignore_eos=True),
                                     SamplingParams(temperature=0.7, max_tokens=4, seed=1, ignore_eos=True)])
    gemma_llm.generate(prompts[:1], SamplingParams(temperature=0.7, top_k=5, max_tokens=4, logprobs=2))
    assert len(calls) == n
    # More rows than the screen serves at once (its survivors' logits then cost more than the head).
    rows = kernels.SCREEN_TOP_K_MAX_ROWS + 1
    gemma_llm.generate([f"{p} {i}" for i in range(rows) for p in prompts[:1]],
                       SamplingParams(temperature=0.7, top_k=5, max_tokens=3, seed=1, ignore_eos=True))
    assert len(calls) == n


@needs_screen
def test_gemma_penalized_requests_through_the_screen_equal_the_full_logits(gemma_llm, monkeypatch):
    """Greedy and top-k requests with a repetition penalty (Ollama's defaults among them), presence
    and frequency penalties, a logit bias and min_tokens give the same tokens through the screen,
    their touched tokens computed beside the top-k, as with the full logits."""
    from kvserve import SamplingParams
    from kvserve.engine.model_runner import ModelRunner

    touched = []
    real = kernels.screen_top_k
    monkeypatch.setattr(kernels, "screen_top_k", lambda *a, **k: touched.append(sum(map(len, a[5]))) or real(*a, **k))
    prompts = ["The capital of France is", "def fibonacci(n):", "Robert Boulter is an English film and television",
               "Once upon a time"]
    eos = gemma_llm.engine.sampler.eos_token_ids[0]
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1, max_tokens=24, seed=4,
                             ignore_eos=True),
              SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={eos: 30.0},
                             min_tokens=20, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=50, frequency_penalty=1.0, max_tokens=24, seed=5, ignore_eos=True)]
    got = [o.outputs[0].token_ids for o in gemma_llm.generate(prompts, params)]
    assert touched and max(touched) > 0
    assert got[2][:20].count(eos) == 0 and got[2][20:] == [eos] * 4  # min_tokens, then the bias
    plain = gemma_llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert plain[0].outputs[0].token_ids != got[0]  # the penalty changed the text
    n = len(touched)
    monkeypatch.setattr(ModelRunner, "screen_top_k", property(lambda self: (0, 0, 0)))
    assert [o.outputs[0].token_ids for o in gemma_llm.generate(prompts, params)] == got
    assert len(touched) == n
