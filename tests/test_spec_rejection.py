"""Speculative rejection sampling: output distribution equals the target's, greedy equals argmax.

The statistical tests run a whole speculative generation loop over a small Markov "model"
(V = 6 tokens, next-token logits depend on the previous token), batched over many sequences,
and compare the joint distribution of the first three emitted tokens with the target chain's
by a chi-square test. Seeds are fixed, so every run is identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

from kvserve.sampling import Sampler, SamplingRequest
from kvserve.sampling_params import SamplingParams
from kvserve.speculative import (
    SpecVerifyResult,
    processed_probs,
    rejection_sample,
    sample_probs,
)

V = 6
Verify = Callable[..., SpecVerifyResult]


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors: intra-op threads only add overhead. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts [C] to probs [C] (sum 1); cells expecting < 5
    draws are pooled. An outcome of probability 0 that occurs gives p-value 0."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small & (probs > 0)].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small & (probs > 0)].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((len(exp) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))  # chi-square survival function


def table_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token probabilities of every context row: [V, V] -> [V, V]."""
    return processed_probs(logits, [params] * logits.shape[0])


# ------------------------------------------------------------ speculative generation harness

TARGET = torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 1.5
CLOSE_DRAFT = TARGET + 0.7 * torch.randn(V, V, generator=torch.Generator().manual_seed(2))
BAD_DRAFT = torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 2.0

PARAMS = {
    "t0.7-topk4": SamplingParams(temperature=0.7, top_k=4),
    "t1.4-topp0.8": SamplingParams(temperature=1.4, top_p=0.8),
    "t1-minp0.2": SamplingParams(temperature=1.0, min_p=0.2),
}


# An n-gram-like deterministic proposer: a fixed next token per previous token. Mostly the
# close draft's argmax; after token 4 it proposes 3, which no target params can produce.
DETERMINISTIC_NEXT = CLOSE_DRAFT.argmax(dim=-1)
DETERMINISTIC_NEXT[4] = 3


def deterministic_draft(ctx: torch.Tensor) -> torch.Tensor:
    """[N] previous tokens -> [N] proposed tokens."""
    return DETERMINISTIC_NEXT[ctx]


def generate(
    verify: Verify, draft: str, params: SamplingParams, k: int, n: int, seed: int,
) -> tuple[torch.Tensor, float]:
    """Run speculative decoding from token 0 for n sequences until each has 3 new tokens.

    draft: "close" / "bad" (sampled from the processed draft table, dense q) or "onehot"
    (deterministic_draft, q = None). Returns (first 3 emitted tokens [n, 3], acceptance rate).
    """
    torch.manual_seed(seed)  # unseeded sequences use the global RNG
    draft_gen = torch.Generator().manual_seed(seed + 1)
    tables = {"close": CLOSE_DRAFT, "bad": BAD_DRAFT}
    q_table = None if draft == "onehot" else table_probs(tables[draft], params)
    out: list[list[int]] = [[] for _ in range(n)]
    last = torch.zeros(n, dtype=torch.long)
    accepted = proposed = 0
    for _ in range(3):  # every step emits at least one token
        ctx = [last]
        for _ in range(k):
            if q_table is None:
                ctx.append(deterministic_draft(ctx[-1]))
            else:
                ctx.append(torch.multinomial(q_table[ctx[-1]], 1, generator=draft_gen).squeeze(1))
        contexts = torch.stack(ctx, dim=1)  # [n, k + 1]: the context of each target row
        drafts = contexts[:, 1:]
        target = TARGET[contexts].reshape(n * (k + 1), V)
        probs = [None] * n if q_table is None else list(q_table[contexts[:, :k]].unbind(0))
        res = verify(target, drafts.tolist(), probs, [params] * n, [None] * n)
        for seq, toks in zip(out, res.token_ids):
            seq.extend(toks)
        accepted += sum(res.num_accepted)
        proposed += n * k
        last = torch.tensor([seq[-1] for seq in out])
    return torch.tensor([seq[:3] for seq in out]), accepted / max(proposed, 1)


def joint_pvalue(tokens: torch.Tensor, params: SamplingParams) -> float:
    """Chi-square p-value of tokens [n, 3] against the target chain's joint law from token 0."""
    p = table_probs(TARGET, params).double()
    expected = p[0][:, None, None] * p[:, :, None] * p[None, :, :]  # [a, b, c]
    counts = torch.bincount(tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2], minlength=V**3)
    return chi2_pvalue(counts, expected)


N_STAT = 12000


@pytest.mark.parametrize(
    ("params_name", "draft", "k"),
    [
        ("t0.7-topk4", "close", 1),
        ("t0.7-topk4", "bad", 3),
        ("t1.4-topp0.8", "bad", 1),
        ("t1.4-topp0.8", "onehot", 3),
        ("t1-minp0.2", "onehot", 1),
        ("t1-minp0.2", "close", 3),
    ],
)
def test_joint_distribution_equals_target(params_name: str, draft: str, k: int) -> None:
    params = PARAMS[params_name]
    tokens, rate = generate(rejection_sample, draft, params, k, N_STAT, seed=10 + k)
    assert 0.05 < rate < 0.99  # both branches (accept and reject) are exercised
    assert joint_pvalue(tokens, params) > 1e-4


def _first_rows(drafts: Sequence[Sequence[int]]) -> list[int]:
    """The first target row of each sequence."""
    starts, pos = [], 0
    for d in drafts:
        starts.append(pos)
        pos += len(d) + 1
    return starts


def _always_accept(target, drafts, probs, params, generators) -> SpecVerifyResult:
    """Broken verifier: keeps every draft, then samples the bonus row."""
    bonus_rows = torch.tensor([s + len(d) for s, d in zip(_first_rows(drafts), drafts)])
    bonus = sample_probs(processed_probs(target[bonus_rows], params), generators).tolist()
    tokens = [list(d) + [b] for d, b in zip(drafts, bonus)]
    return SpecVerifyResult(tokens, [len(d) for d in drafts])


def _resample_from_p(target, drafts, probs, params, generators) -> SpecVerifyResult:
    """Broken verifier: after a rejection, draws from p instead of the residual max(0, p - q)."""
    res = rejection_sample(target, drafts, probs, params, generators)
    rows = [s + n for s, n in zip(_first_rows(drafts), res.num_accepted)]
    fresh = sample_probs(processed_probs(target[torch.tensor(rows)], params), generators).tolist()
    for i, (d, n) in enumerate(zip(drafts, res.num_accepted)):
        if n < len(d):
            res.token_ids[i][-1] = fresh[i]
    return res


@pytest.mark.parametrize("broken", [_always_accept, _resample_from_p])
@pytest.mark.parametrize("params", [PARAMS["t0.7-topk4"], SamplingParams(temperature=1.2)])
def test_chi_square_catches_a_broken_verifier(broken: Verify, params: SamplingParams) -> None:
    """Without filtering every outcome is possible: the test must fail on the frequencies."""
    tokens, _ = generate(broken, "bad", params, 3, N_STAT, seed=13)
    assert joint_pvalue(tokens, params) < 1e-8


# ------------------------------------------------------------ acceptance rates


def _single_step(
    q: torch.Tensor | None, params: SamplingParams, n: int, seed: int
) -> tuple[list[int], torch.Tensor]:
    """n sequences, k = 1, all scoring TARGET rows 0 (draft row) and 1 (bonus row).

    q: [V] dense draft probabilities (drafts sampled from it) or None (draft token 2, one-hot).
    Returns (num_accepted, drafts [n])."""
    torch.manual_seed(seed)
    if q is None:
        drafts = torch.full((n,), 2)
    else:
        gen = torch.Generator().manual_seed(seed + 1)
        drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    target = TARGET[:2].repeat(n, 1)
    probs = [None] * n if q is None else [q.view(1, V)] * n
    res = rejection_sample(target, [[t] for t in drafts.tolist()], probs, [params] * n, [None] * n)
    return res.num_accepted, drafts


@pytest.mark.parametrize("params_name", list(PARAMS))
def test_acceptance_rate_is_the_overlap_of_p_and_q(params_name: str) -> None:
    params, n = PARAMS[params_name], 20000
    p = table_probs(TARGET, params)[0]
    q = table_probs(BAD_DRAFT, params)[0]
    accepted, _ = _single_step(q, params, n, seed=5)
    alpha = float(torch.minimum(p, q).sum())
    rate = sum(accepted) / n
    assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / n) + 1e-9
    accepted, _ = _single_step(None, params, n, seed=6)  # one-hot draft on token 2: p(2)
    alpha = float(p[2])
    assert abs(sum(accepted) / n - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / n) + 1e-9


def test_draft_equal_to_target_is_always_accepted() -> None:
    params, n, k = PARAMS["t1.4-topp0.8"], 3000, 3
    logits = torch.randn(n * (k + 1), V, generator=torch.Generator().manual_seed(7))
    p = processed_probs(logits, [params] * len(logits)).view(n, k + 1, V)
    q = p[:, :k]  # the draft is the target itself
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=torch.Generator().manual_seed(8))
    res = rejection_sample(
        logits, drafts.view(n, k).tolist(), list(q.unbind(0)), [params] * n, [None] * n
    )
    assert res.num_accepted == [k] * n
    assert all(len(t) == k + 1 for t in res.token_ids)


def test_empty_residual_falls_back_to_p() -> None:
    """q == p and a draft token outside p's support (q(x) = 0): always rejected, and the
    residual max(0, p - q) is all zero, so the token comes from p."""
    params, n = SamplingParams(temperature=1.0, top_k=3), 6000
    logits = TARGET[:2]
    p = processed_probs(logits, [params, params])
    outside = int(p[0].argmin())
    assert p[0, outside] == 0
    res = rejection_sample(
        logits.repeat(n, 1), [[outside]] * n, [p[:1]] * n, [params] * n, [None] * n
    )
    assert res.num_accepted == [0] * n
    tokens = torch.tensor([t[0] for t in res.token_ids])
    assert chi2_pvalue(torch.bincount(tokens, minlength=V), p[0]) > 1e-4


# ------------------------------------------------------------ greedy


def greedy_reference(logits: torch.Tensor, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Plain greedy decoding through the Sampler, row by row, stopping at the first mismatch."""
    sampler, out, row = Sampler(eos_token_ids=[]), [], 0
    request = SamplingRequest(SamplingParams(temperature=0.0), [], [])
    for d in drafts:
        best = sampler(logits[row : row + len(d) + 1], [request] * (len(d) + 1)).token_ids
        emitted = []
        for draft, top in zip(d, best):
            if draft != top:
                break
            emitted.append(draft)
        out.append(emitted + [best[len(emitted)]])
        row += len(d) + 1
    return out


def test_greedy_hand_made() -> None:
    g = SamplingParams(temperature=0.0)
    rows = [
        [0, 0, 9, 0, 0],  # seq 0: argmax 2 == draft 2
        [0, 0, 0, 9, 0],  # argmax 3 == draft 3
        [0, 0, 0, 0, 9],  # argmax 4 != draft 1: correction 4
        [9, 0, 0, 0, 0],  # (unused bonus row)
        [0, 9, 0, 0, 0],  # seq 1: argmax 1 == draft 1
        [0, 0, 9, 0, 0],  # bonus 2
        [0, 0, 0, 9, 0],  # seq 2: k = 0, argmax 3
        [0, 5, 5, 1, 0],  # seq 3: tie between 1 and 2: the first index (1) != draft 2
        [0, 0, 0, 0, 0],  # (unused)
    ]
    drafts = [[2, 3, 1], [1], [], [2]]
    logits = torch.tensor(rows, dtype=torch.float32)
    res = rejection_sample(logits, drafts, [None] * 4, [g] * 4, [None] * 4)
    assert res.token_ids == [[2, 3, 4], [1, 2], [3], [1]]
    assert res.num_accepted == [2, 1, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_plain_greedy_decoding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    ks = [0, 1, 2, 3, 4, 5] * 5
    # Coarse integer logits: many ties, so the first-index rule matters.
    logits = torch.randint(0, 4, (sum(k + 1 for k in ks), 7), generator=gen).to(dtype)
    argmax = logits.float().argmax(dim=-1).tolist()
    drafts, row = [], 0
    for i, k in enumerate(ks):  # drafts follow the argmax for i % 4 tokens, then diverge
        d = [argmax[row + j] if j < i % 4 else (argmax[row + j] + 1) % 7 for j in range(k)]
        drafts.append(d)
        row += k + 1
    g = SamplingParams(temperature=0.0)
    res = rejection_sample(logits, drafts, [None] * len(ks), [g] * len(ks), [None] * len(ks))
    assert res.token_ids == greedy_reference(logits.float(), drafts)
    assert res.num_accepted == [min(k, i % 4) for i, k in enumerate(ks)]


def test_mixed_batch_greedy_and_seeded_rows_unaffected_by_each_other() -> None:
    greedy_p, rand_p = SamplingParams(temperature=0.0), PARAMS["t0.7-topk4"]
    logits = torch.randn(4 * 3, V, generator=torch.Generator().manual_seed(4))
    drafts = [[1, 2], [0, 3], [4, 4], [2, 0]]
    q = processed_probs(TARGET[:2], [rand_p] * 2)
    probs = [None, q, None, q]
    params = [greedy_p, rand_p, greedy_p, rand_p]

    def gens() -> list[torch.Generator | None]:
        return [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]

    mixed = rejection_sample(logits, drafts, probs, params, gens())
    alone = [
        rejection_sample(
            logits[3 * i : 3 * i + 3], [drafts[i]], [probs[i]], [params[i]], [gens()[i]]
        )
        for i in range(4)
    ]
    assert mixed.token_ids == [a.token_ids[0] for a in alone]
    assert mixed.token_ids[0] == greedy_reference(logits[0:3], [drafts[0]])[0]


# ------------------------------------------------------------ seeds


def test_seeded_results_repeat_and_do_not_depend_on_the_batch() -> None:
    params = [PARAMS["t1.4-topp0.8"], PARAMS["t0.7-topk4"], PARAMS["t1-minp0.2"], SamplingParams()]
    ks = [3, 0, 2, 1]
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(sum(k + 1 for k in ks), V, generator=gen)
    drafts = [torch.randint(0, V, (k,), generator=gen).tolist() for k in ks]
    probs = [  # dense q for even sequences, one-hot (None) for odd ones
        torch.softmax(torch.randn(k, V, generator=gen), -1) if i % 2 == 0 else None
        for i, k in enumerate(ks)
    ]
    starts = [sum(k + 1 for k in ks[:i]) for i in range(len(ks))]

    def run(seqs: list[int], seed_base: int, unseeded_extra: bool = False) -> list[list[int]]:
        rows = torch.cat([logits[starts[i] : starts[i] + ks[i] + 1] for i in seqs])
        gens: list[torch.Generator | None] = [
            torch.Generator().manual_seed(seed_base + i) for i in seqs
        ]
        d, q, p = [drafts[i] for i in seqs], [probs[i] for i in seqs], [params[i] for i in seqs]
        if unseeded_extra:  # an unseeded copy of sequence 0 in front uses the global RNG
            rows = torch.cat([logits[:4], rows])
            d, q, p, gens = [drafts[0]] + d, [probs[0]] + q, [params[0]] + p, [None] + gens
        out = rejection_sample(rows, d, q, p, gens).token_ids
        return out[1:] if unseeded_extra else out

    full = run([0, 1, 2, 3], 100)
    assert run([0, 1, 2, 3], 100) == full
    for i in range(4):
        assert run([i], 100) == [full[i]]
    assert run([3, 1], 100, unseeded_extra=True) == [full[3], full[1]]
    seeds = {tuple(map(tuple, run([0, 1, 2, 3], base))) for base in range(100, 120)}
    assert len(seeds) > 1  # different seeds do give different results


def test_zero_drafts_equal_the_normal_sampler() -> None:
    """k = 0 is plain sampling: the same token as the Sampler with the same seed."""
    params = list(PARAMS.values()) + [SamplingParams(temperature=0.3)]
    logits = torch.randn(len(params), 50, generator=torch.Generator().manual_seed(11))
    for seed in range(20):
        reqs = [
            SamplingRequest(p, [], [], torch.Generator().manual_seed(seed * 10 + i))
            for i, p in enumerate(params)
        ]
        expected = Sampler(eos_token_ids=[])(logits, reqs).token_ids
        gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(len(params))]
        res = rejection_sample(logits, [[]] * len(params), [None] * len(params), params, gens)
        assert res.token_ids == [[t] for t in expected]


# ------------------------------------------------------------ helpers and validation


def test_processed_probs_is_the_sampler_processing() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(12)).bfloat16()
    params = list(PARAMS.values())
    p = processed_probs(logits, params)
    assert p.dtype == torch.float32 and p.shape == (3, 40)
    torch.testing.assert_close(p.sum(-1), torch.ones(3))
    assert (p[0] > 0).sum() == 4  # top_k=4
    with pytest.raises(ValueError, match="temperature"):
        processed_probs(logits, [SamplingParams(temperature=0.0)] * 3)


def test_sample_probs_skips_zero_mass_and_accepts_unnormalised_rows() -> None:
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0], [0.0, 0.0, 5.0, 0.0]])
    torch.manual_seed(0)
    tokens = torch.stack([sample_probs(probs, [None, None]) for _ in range(4000)])
    assert set(tokens[:, 0].tolist()) == {1, 3} and set(tokens[:, 1].tolist()) == {2}
    assert abs((tokens[:, 0] == 3).float().mean().item() - 0.75) < 0.04
    a = sample_probs(probs, [torch.Generator().manual_seed(3), None])
    b = sample_probs(probs, [torch.Generator().manual_seed(3), None])
    assert a[0] == b[0]


def test_validation_errors() -> None:
    r = SamplingParams()
    logits = torch.zeros(5, V)
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(logits, [[1, 2]], [None], [r], [None])  # needs 3 rows
    with pytest.raises(ValueError, match=r"draft_probs\[1\]"):
        rejection_sample(logits, [[1], [2, 3]], [None, torch.zeros(1, V)], [r, r], [None, None])
    with pytest.raises(ValueError, match=r"draft_probs\[0\]"):
        rejection_sample(logits[:2], [[1]], [torch.zeros(1, V + 1)], [r], [None])
    with pytest.raises(ValueError, match="params"):
        rejection_sample(logits[:2], [[1]], [None], [r, r], [None])
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits[:2], [[V]], [None], [r], [None])
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(torch.zeros(2), [[1]], [None], [r], [None])
