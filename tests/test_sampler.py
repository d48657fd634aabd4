"""Sampler against oracles: argmax, softmax frequencies, brute-force filters, hand penalties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import kernels
from kvserve.sampling import Sampler, SamplingRequest, apply_penalties, filter_logits
from kvserve.sampling import sampler as sampler_module
from kvserve.sampling_params import SamplingParams

EOS = 2


@pytest.fixture(autouse=True)
def _single_thread():
    """These tensors are tiny: intra-op threads only add sync overhead, which reaches
    milliseconds per op on a busy shared CPU. Restored afterwards for other test files."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def req(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
) -> SamplingRequest:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRequest(params or SamplingParams(), prompt or [], output or [], gen)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


# ---------------------------------------------------------------- greedy + logprobs


def test_greedy_equals_argmax_of_raw_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 5000)
    logits[3, 17] = logits[3, 4000] = 50.0  # tie: must match torch.argmax (first index)
    out = Sampler([EOS])(logits, [req(greedy()) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[3] == 17


def test_greedy_on_bf16_logits_equals_fp32_argmax() -> None:
    """bf16 logits (a bf16 model) are not upcast for greedy rows; ties are frequent in bf16."""
    torch.manual_seed(1)
    logits = (torch.randn(16, 262144) * 3).bfloat16()
    logits[:, 100] = logits[:, 200] = logits.max()  # a tie at the top of every row
    out = Sampler([EOS])(logits, [req(greedy()) for _ in range(16)])
    assert out.token_ids == logits.float().argmax(-1).tolist() == [100] * 16
    mixed = Sampler([EOS])(logits, [req(greedy(logprobs=2))] + [req(greedy()) for _ in range(15)])
    assert mixed.token_ids == out.token_ids and mixed.logprobs[0] is not None


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 300) * 3
    reqs = [
        req(SamplingParams(temperature=0.5, top_k=5, logprobs=5, repetition_penalty=1.5), prompt=[1, 2, 3]),
        req(greedy(presence_penalty=1.0, logprobs=0), output=[4, 4]),
        req(SamplingParams(temperature=1.3, top_p=0.8), seed=3),
    ]
    out = Sampler([EOS])(logits, reqs)
    ref = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(out.token_ids[:2]):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert out.logprobs[2] is None  # not asked for: not computed
    vals, ids = ref[0].topk(5)
    assert list(out.top_logprobs[0]) == ids.tolist()
    assert list(out.top_logprobs[0].values()) == pytest.approx(vals.tolist(), abs=1e-5)
    assert out.top_logprobs[1] == {}
    assert out.top_logprobs[2] is None


# ---------------------------------------------------------------- distributions


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_sampling_matches_softmax_with_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5]])
    params = SamplingParams(temperature=0.7)
    draws = 40_000
    torch.manual_seed(1234)
    out = Sampler([99])(logits.expand(draws, -1), [req(params) for _ in range(draws)])
    expected = torch.softmax(logits[0].double() / 0.7, dim=-1)
    freq = _frequencies(out.token_ids, 6)
    # std of a frequency <= sqrt(0.25 / 40000) = 0.0025: 0.012 is ~5 sigma.
    assert (freq - expected).abs().max() < 0.012
    chi2 = (((freq - expected) ** 2) / expected).sum().item() * draws
    assert chi2 < 30.0  # 5 dof: p ~ 1.5e-5


def test_seeded_generator_samples_the_right_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -0.5]])
    gen = torch.Generator().manual_seed(7)
    sampler = Sampler([99])
    r = SamplingRequest(SamplingParams(temperature=1.0), [], [], gen)
    tokens = [sampler(logits, [r]).token_ids[0] for _ in range(3000)]
    expected = torch.softmax(logits[0].double(), dim=-1)
    assert (_frequencies(tokens, 4) - expected).abs().max() < 0.045  # ~5 sigma


def test_filtered_distribution_is_renormalized_softmax() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0, 2.8]])
    params = SamplingParams(temperature=1.0, top_k=3)
    draws = 30_000
    torch.manual_seed(5)
    out = Sampler([99])(logits.expand(draws, -1), [req(params) for _ in range(draws)])
    kept = torch.tensor([0, 1, 6])
    expected = torch.zeros(7, dtype=torch.float64)
    expected[kept] = torch.softmax(logits[0, kept].double(), dim=-1)
    assert (_frequencies(out.token_ids, 7) - expected).abs().max() < 0.015


# ---------------------------------------------------------------- filters vs brute force


def _reference_keep(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Brute force in float64: which tokens survive temperature, top-k, top-p, min-p."""
    x = row.double() / p.temperature
    order = sorted(range(len(x)), key=lambda i: -x[i].item())
    keep = set(order)
    if 0 < p.top_k < len(x):
        kth = x[order[p.top_k - 1]].item()
        keep = {i for i in keep if x[i].item() >= kth}
    if p.top_p < 1.0:
        probs = torch.softmax(torch.where(torch.tensor([i in keep for i in range(len(x))]), x, -torch.inf), -1)
        mass, new_keep = 0.0, set()
        for i in order:  # most likely first, until the mass reaches p
            if i not in keep or mass >= p.top_p:
                continue
            new_keep.add(i)
            mass += probs[i].item()
        keep = new_keep
    if p.min_p > 0.0:
        probs = torch.softmax(torch.where(torch.tensor([i in keep for i in range(len(x))]), x, -torch.inf), -1)
        keep = {i for i in keep if probs[i].item() >= p.min_p * probs.max().item()}
    return keep


FILTER_PARAMS = [
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.2, top_p=0.5),
    SamplingParams(temperature=0.5, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=2.0, top_k=20, top_p=0.7, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=-1, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=1000),  # k >= vocab: disabled
    SamplingParams(temperature=1.0),
]


def test_filter_kept_sets_equal_brute_force() -> None:
    torch.manual_seed(2)
    logits = torch.randn(len(FILTER_PARAMS), 64) * 2
    filtered = filter_logits(logits, FILTER_PARAMS)
    for i, p in enumerate(FILTER_PARAMS):
        kept = set(torch.nonzero(filtered[i] > -torch.inf).flatten().tolist())
        assert kept == _reference_keep(logits[i], p), p


@pytest.mark.parametrize("scale", [0.05, 5.0])  # flat: full-sort fallback; peaked: top-1024 path
def test_top_p_large_vocab_equals_brute_force(scale: float) -> None:
    torch.manual_seed(6)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.3, min_p=0.01), SamplingParams(top_k=3000, top_p=0.95)]
    logits = torch.randn(len(params), 4096) * scale
    filtered = filter_logits(logits, params)
    for i, p in enumerate(params):
        kept = set(torch.nonzero(filtered[i] > -torch.inf).flatten().tolist())
        assert kept == _reference_keep(logits[i], p), p
        # survivors keep their (temperature-scaled) logit
        assert torch.equal(filtered[i][list(kept)], logits[i][list(kept)] / p.temperature)


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    filtered = filter_logits(logits, [SamplingParams(top_k=2)])
    assert (filtered[0] > -torch.inf).tolist() == [False, True, True, True, False]


def test_samples_never_leave_the_kept_set() -> None:
    torch.manual_seed(3)
    rows = len(FILTER_PARAMS)
    logits = torch.randn(rows, 64) * 2
    keep = [_reference_keep(logits[i], p) for i, p in enumerate(FILTER_PARAMS)]
    sampler = Sampler([99])
    reqs = [req(p) for p in FILTER_PARAMS]
    for _ in range(200):
        out = sampler(logits, reqs)
        for i, tok in enumerate(out.token_ids):
            assert tok in keep[i]


def test_no_full_sort_without_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args, **kwargs):
        raise AssertionError("vocabulary sorted without top_p")

    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "argsort", no_sort)
    monkeypatch.setattr(torch.Tensor, "argsort", no_sort)
    logits = torch.randn(3, 262_144)
    reqs = [req(greedy()), req(SamplingParams(temperature=0.9, min_p=0.05)), req(SamplingParams(top_k=40))]
    out = Sampler([1])(logits, reqs)
    assert out.token_ids[0] == logits[0].argmax().item()


def test_top_p_on_peaked_logits_does_not_sort_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args, **kwargs):
        raise AssertionError("full sort although the top candidates hold the mass")

    logits = torch.randn(2, 262_144)
    logits[:, :10] += 20.0
    monkeypatch.setattr(torch, "sort", no_sort)
    out = Sampler([1])(logits, [req(SamplingParams(top_p=0.9)), req(SamplingParams(top_p=0.5), seed=0)])
    assert all(t < 10 for t in out.token_ids)


def test_rounding_overflow_never_picks_a_filtered_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """u * total may round up to the total: the sample must stay on a kept token."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones_like(real_rand(*a, **k)))
    logits = torch.tensor([[0.0, 1.0, -torch.inf, -torch.inf], [0.0, 1.0, 5.0, -30.0]])
    params = [SamplingParams(), SamplingParams(top_k=2)]
    assert Sampler([9])(logits, [req(p) for p in params]).token_ids == [1, 2]


def _oracle_token(row: torch.Tensor, p: SamplingParams, u: float) -> int:
    """Brute force in float64: the kept set (top-k keeps ties at the k-th value; top-p walks the
    tokens by logit, ties by index, while the mass before each is below p), then the first token
    whose cumulative kept mass exceeds u * total."""
    x = row.double() / torch.tensor(p.temperature, dtype=torch.float32).double()
    order = sorted(range(len(x)), key=lambda i: (-x[i].item(), i))
    keep = torch.ones(len(x), dtype=torch.bool)
    if 0 < p.top_k < len(x):
        keep &= x >= x[order[p.top_k - 1]]
    e = (x - x.max()).exp()
    if p.top_p < 1.0:
        target = float(torch.tensor(p.top_p, dtype=torch.float32)) * e[keep].sum().item()
        walked, before = torch.zeros_like(keep), 0.0
        for i in order:
            if not keep[i] or before >= target:
                break
            walked[i] = True
            before += e[i].item()
        keep = walked
    if p.min_p > 0.0:
        keep &= e >= p.min_p
    cdf = torch.where(keep, e, 0.0).cumsum(0)
    token = int(torch.searchsorted(cdf, u * cdf[-1].item(), right=True))
    return token if token < len(x) else int(keep.nonzero().max())  # u * total rounded up: the last kept


KERNEL_PARAMS = [*FILTER_PARAMS, SamplingParams(temperature=0.3, top_k=300, top_p=0.99),
                 SamplingParams(temperature=0.7, top_p=0.9, top_k=100, min_p=0.05)]


needs_sampling_kernel = pytest.mark.skipif(kernels.kernel_lib("sampling") is None, reason="no C compiler")


@needs_sampling_kernel
@pytest.mark.parametrize("vocab,scale", [(64, 2.0), (4097, 0.05), (4097, 3.0), (4097, 12.0)])
def test_sampling_kernel_draws_the_float64_oracle_token(vocab: int, scale: float) -> None:
    """kernels/sampling.c against brute force: random rows (flat to peaked), ten draws a row, 0
    among them. (A draw within ~1e-12 of 1 lands among tail tokens whose masses differ between
    fp32 and float64 exponentials: there the two disagree within rounding.)"""
    gen = torch.Generator().manual_seed(vocab + int(scale * 100))
    logits = torch.randn(len(KERNEL_PARAMS), vocab, generator=gen) * scale
    rows = list(range(len(KERNEL_PARAMS)))
    for draw in range(10):
        u = (torch.tensor([0.0, 0.999], dtype=torch.float64).repeat(len(rows))[: len(rows)] if draw == 0
             else torch.rand(len(rows), generator=gen, dtype=torch.float64))
        tokens = kernels.sample_rows(logits, rows, [p.temperature for p in KERNEL_PARAMS],
                                     [p.top_k if p.top_k < vocab else 0 for p in KERNEL_PARAMS],
                                     [p.top_p for p in KERNEL_PARAMS], [p.min_p for p in KERNEL_PARAMS], u)
        want = [_oracle_token(logits[i], p, u[i].item()) for i, p in enumerate(KERNEL_PARAMS)]
        assert tokens.tolist() == want, (draw, u.tolist())


@needs_sampling_kernel
def test_sampling_kernel_keeps_ties_and_skips_masked_tokens() -> None:
    """Whole-number logits tie often (top-k keeps every tie at the k-th value, top-p cuts ties by
    index); -inf tokens (a grammar's mask) are never drawn; rows are read in place."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-3, 4, (6, 300), generator=gen).float()
    logits[:, ::3] = float("-inf")
    params = [SamplingParams(top_k=7), SamplingParams(top_p=0.4), SamplingParams(top_k=50, top_p=0.6),
              SamplingParams(temperature=0.5, min_p=0.3), SamplingParams(top_k=1), SamplingParams(temperature=3.0)]
    rows = [5, 0, 3, 1, 4, 2]
    for _ in range(20):
        u = torch.rand(len(rows), generator=gen, dtype=torch.float64)
        tokens = kernels.sample_rows(logits, rows, [p.temperature for p in params], [p.top_k for p in params],
                                     [p.top_p for p in params], [p.min_p for p in params], u)
        assert tokens.tolist() == [_oracle_token(logits[r], p, u[j].item()) for j, (r, p) in enumerate(zip(rows, params))]
        assert all(t % 3 for t in tokens.tolist())


@needs_sampling_kernel
def test_rows_the_kernel_leaves_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN row or one with no finite logit gives what the torch path gives it; the other rows
    of the batch still come from the kernel, drawing from the same generators."""
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(5))
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    params = [SamplingParams(top_p=0.8), SamplingParams(), SamplingParams(top_k=5), SamplingParams(min_p=0.1)]

    def draw() -> list[int]:
        return Sampler([EOS])(logits, [req(p, seed=i) for i, p in enumerate(params)]).token_ids

    calls = []
    monkeypatch.setattr(sampler_module, "filter_logits", lambda x, ps: calls.append(len(ps)) or filter_logits(x, ps))
    got = draw()
    assert calls == [2]  # the NaN row and the -inf row
    monkeypatch.setattr(kernels, "sample_rows", lambda *a, **k: None)
    assert draw() == got
    assert calls == [2, 4]  # the torch path: every row at once


@needs_sampling_kernel
@pytest.mark.parametrize("scale", [0.05, 3.0])
def test_filtered_softmax_is_the_torch_distribution(scale: float) -> None:
    """The kernel's distributions (what speculative decoding's rejection rule reads): the kept set
    of the float64 brute force, the torch path's probabilities within fp32 rounding; a NaN row
    the torch path's."""
    logits = torch.randn(len(KERNEL_PARAMS), 4097, generator=torch.Generator().manual_seed(21)) * scale
    logits[2, :7] = float("-inf")
    logits[4, 9] = float("nan")
    got = sampler_module.filtered_softmax(logits, KERNEL_PARAMS)
    want = filter_logits(logits, KERNEL_PARAMS).softmax(dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9, equal_nan=True)
    for i, p in enumerate(KERNEL_PARAMS):
        if i != 4:
            assert set(got[i].nonzero().flatten().tolist()) == _reference_keep(logits[i], p), p


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    r = req(greedy(repetition_penalty=2.0), prompt=[0, 1], output=[1, 3])
    out = apply_penalties(logits, [r], [EOS])
    assert out.tolist() == [[1.0, -2.0, 0.5, -6.0, 1.0, 0.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]]  # input untouched


def test_frequency_presence_penalty_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    r = req(greedy(frequency_penalty=0.5, presence_penalty=0.25), prompt=[5, 5, 5], output=[1, 4, 4, 4])
    out = apply_penalties(logits, [r], [EOS])
    # token 1: once -> -0.5 - 0.25; token 4: three times -> -1.5 - 0.25; prompt ignored.
    assert out[0].tolist() == pytest.approx([2.0, -1.75, 0.5, -3.0, -0.75, 0.0])


def test_all_penalties_combined_order() -> None:
    logits = torch.tensor([[4.0, -2.0, 1.0]])
    r = req(greedy(repetition_penalty=2.0, frequency_penalty=1.0), prompt=[0], output=[1, 1])
    # repetition first (4 -> 2, -2 -> -4), then frequency (-4 - 2 = -6).
    assert apply_penalties(logits, [r], [EOS]).tolist() == [[2.0, -6.0, 1.0]]


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    sampler = Sampler([EOS])
    assert sampler(logits, [req(greedy())]).token_ids == [0]
    assert sampler(logits, [req(greedy(repetition_penalty=1.2), output=[0])]).token_ids == [1]


def test_no_penalty_returns_same_tensor() -> None:
    logits = torch.randn(2, 10)
    assert apply_penalties(logits, [req(), req(greedy())], [EOS]) is logits


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 6)
    logits[0, EOS] = 10.0
    logits[0, 4] = 9.0
    logits[0, 1] = 8.0
    sampler = Sampler([EOS])
    params = greedy(min_tokens=2, stop_token_ids=[4], ignore_eos=True, logprobs=0)
    assert sampler(logits, [req(params, output=[0])]).token_ids == [1]
    assert sampler(logits, [req(params, output=[0, 0])]).token_ids == [EOS]
    # logprob is still taken from the raw logits.
    out = sampler(logits, [req(params, output=[0])])
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item(), abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(rep=st.sampled_from([1.0, 0.5, 1.3]), presence=st.sampled_from([0.0, 0.7, -0.4]),
       frequency=st.sampled_from([0.0, 0.3, -1.0]), min_tokens=st.integers(0, 3),
       bias=st.dictionaries(st.integers(0, 39), st.floats(-5, 5, allow_nan=False), max_size=3),
       stops=st.lists(st.integers(0, 60), max_size=3), prompt=st.lists(st.integers(0, 39), max_size=12),
       output=st.lists(st.integers(0, 39), max_size=6), seed=st.integers(0, 2**16))
def test_penalties_change_only_the_touched_tokens(rep, presence, frequency, min_tokens, bias, stops, prompt, output,
                                                  seed) -> None:
    """What the head's screen relies on (sampler.touched_tokens): a row's logit_bias, min_tokens and
    penalties change no logit outside the tokens it lists."""
    params = SamplingParams(temperature=0.0, repetition_penalty=rep, presence_penalty=presence,
                            frequency_penalty=frequency, min_tokens=min_tokens, logit_bias=bias or None,
                            stop_token_ids=stops)
    r = req(params, prompt=prompt, output=output)
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(seed))
    changed = (apply_penalties(logits, [r], [EOS]) != logits)[0].nonzero().flatten().tolist()
    touched = sampler_module.touched_tokens(r, [EOS], 40)
    assert set(changed) <= set(touched) and touched == sorted(set(touched))
    assert all(0 <= t < 40 for t in touched)


# ---------------------------------------------------------------- reproducibility


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(4)
    vocab = 1000
    target = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01)
    sampler = Sampler([EOS])

    def run(companions: int, greedy_first: bool) -> list[int]:
        torch.manual_seed(companions)  # disturb the global RNG too
        seeded = req(params, seed=123)
        tokens = []
        for _ in range(20):
            others = [req(SamplingParams(temperature=0.7, top_k=3)) for _ in range(companions)]
            rows = [req(greedy())] + others + [seeded] if greedy_first else [seeded] + others
            logits = torch.randn(len(rows), vocab)
            pos = len(rows) - 1 if greedy_first else 0
            logits[pos] = target
            tokens.append(sampler(logits, rows).token_ids[pos])
        return tokens

    base = run(0, False)
    assert len(set(base)) > 1  # actually random
    assert run(5, False) == base
    assert run(3, True) == base


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler([EOS])
    a = [sampler(logits, [r]).token_ids[0] for r in [req(seed=1)] * 10]
    b = [sampler(logits, [r]).token_ids[0] for r in [req(seed=2)] * 10]
    assert a != b


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        Sampler([EOS])(torch.zeros(2, 5), [req()])
