"""Speculative decoding where a row's processing depends on the tokens before it (Gemma 3 270M,
fp32): each draft position is verified under the grammar's mask, the penalties, the bias and
min_tokens that hold after the drafts before it. Oracles: greedy tokens and logprobs equal plain
decoding (through the head's screens and through full logits), and sampled outputs keep the
target distribution so processed (exact joint probabilities, chi-square)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import xgrammar as xgr

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve import kernels
from kvserve.engine.scheduler import ScheduledSeq
from kvserve.engine.step_batch import draft_requests
from kvserve.sampling.structured import GrammarBackend, GrammarState
from kvserve.sequence import Sequence
from kvserve.speculative.decoder import _processed_rows, under_grammar
from kvserve.speculative.proposers import Draft
from kvserve.speculative.rejection import rejection_sample
from tests.logits import all_position_logits
from tests.test_spec_rejection import chi2_pvalue
from tests.test_speculative import PROMPTS as SPEC_PROMPTS
from tests.test_speculative import NUM_DRAWS, STAT_PROMPT, TopTokensDrafter, _chi_square_pvalue, _drained


# ------------------------------------------------------------------ the masks of a draft
def test_draft_masks_walk_the_grammar_and_leave_the_matcher_where_it_was():
    a, b, c, stop = range(4)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "c", "</s>"], stop_token_ids=[stop])) \
        .compile_grammar(xgr.Grammar.from_regex("(ab)+c"))

    def mask_after(prefix):
        m = xgr.GrammarMatcher(compiled)
        assert all(m.accept_token(t) for t in prefix)
        row = torch.full((1, 1), -1, dtype=torch.int32)
        m.fill_next_token_bitmask(row, 0)
        return row[0].tolist()

    state = GrammarState(xgr.GrammarMatcher(compiled))
    cases = {(a, b, a, b, c, stop): 6, (a, a, b): 1, (a, b, c, stop, a): 4, (b,): 0, (): 0}
    for draft, valid in cases.items():
        masks, n = state.draft_masks(list(draft), 4)
        assert n == valid and masks.shape == (len(draft) + 1, 1)
        for j in range(n + 1):
            if j == 0 or draft[j - 1] != stop:
                assert masks[j].tolist() == mask_after(draft[:j]), (draft, j)
        assert (masks[n + 1:] == -1).all()  # never read: the draft at n is forbidden (or ended)
    # The matcher is where it started: the whole sentence from the beginning.
    assert all(state.accept(t) for t in (a, b, c, stop)) and state.terminated


def test_verification_rows_are_processed_per_position():
    """Row j of a draft: the penalties count drafts 0..j-1, the grammar's mask is its state after
    them, and a row min_tokens empties (the complete grammar allows only EOS) takes the mask alone."""
    a, b, c, eos = range(4)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "c", "</s>"], stop_token_ids=[eos])) \
        .compile_grammar(xgr.Grammar.from_regex("ab"))
    constrained = Sequence(0, "r0", [c], SamplingParams(temperature=0, min_tokens=3), 0.0)
    constrained.grammar = GrammarState(xgr.GrammarMatcher(compiled))
    penalized = Sequence(1, "r1", [c], SamplingParams(temperature=0, repetition_penalty=2.0), 0.0)
    items = [ScheduledSeq(constrained, 3, num_spec=2), ScheduledSeq(penalized, 3, num_spec=2)]
    drafts = [Draft([a, b]), Draft([a, b])]
    drafts[0].allowed, _ = constrained.grammar.draft_masks([a, b], 4)
    target = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).repeat(6, 1)
    got = _processed_rows(target, items, drafts, [eos])
    inf = float("-inf")
    assert got[:3].tolist() == [[1, inf, inf, inf], [inf, 2, inf, inf], [inf, inf, inf, 4]]
    assert got[3:].tolist() == [[1, 2, 1.5, 4], [0.5, 2, 1.5, 4], [0.5, 1, 1.5, 4]]  # c, then a, then b seen
    assert (target == torch.tensor([1.0, 2.0, 3.0, 4.0])).all()  # the raw rows, for logprobs


@pytest.mark.parametrize("sampled", [False, True], ids=["point-mass", "sampled"])
def test_a_forbidden_draft_leaves_the_masked_distribution(sampled):
    """The grammar allows a or b (p 1/2 each after the mask) and forbids s, the target's favourite.
    Drafts of s: a point mass is cut before it and the row samples p; a sampled draft (q half on
    s, half on a) is not cut, and its residual after s is rejected, all b, makes up for the a
    drafts kept. Cutting it too would draw a 3/4 of the time."""
    a, b, s, eos = range(4)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "s", "</s>"], stop_token_ids=[eos])) \
        .compile_grammar(xgr.Grammar.from_regex("(a|b)(a|b)"))
    seq = Sequence(0, "r", [b], SamplingParams(temperature=1.0), 0.0)
    seq.grammar = GrammarState(xgr.GrammarMatcher(compiled))
    target = torch.tensor([[0.0, 0.0, 3.0, -1.0]]).repeat(2, 1)
    q = torch.tensor([[0.5, 0.0, 0.5, 0.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        if sampled:
            draft = Draft([int(torch.multinomial(q[0], 1, generator=gen))], q.clone())
        else:
            draft = Draft([s if torch.rand(1, generator=gen) < 0.5 else a])
        under_grammar(draft, seq.grammar, 4)
        k = len(draft.token_ids)
        assert k == (1 if sampled or draft.token_ids == [a] else 0)
        item = ScheduledSeq(seq, 1 + k, num_spec=k)
        scored = _processed_rows(target[:k + 1], [item], [draft], [eos])
        res = rejection_sample(scored, [draft.token_ids], [draft.probs], [seq.params], [gen])
        counts[res.token_ids[0][0]] += 1
    assert counts[s] == counts[eos] == 0
    assert chi2_pvalue(counts[:2], torch.tensor([0.5, 0.5])) > 1e-3, counts


# ------------------------------------------------------------------ greedy: the same tokens
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "friends": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                       "maxItems": 4}},
          "required": ["name", "friends"], "additionalProperties": False}
CHAT = "<bos><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
REQUESTS = [
    (CHAT.format("Describe a person and four friends as JSON."), StructuredOutputsParams(json=PERSON)),
    ("Count: one, two, three, one, two, three, one, two,", StructuredOutputsParams(regex=r"( (one|two|three),){4,12}")),
    (CHAT.format("Pick a color."), StructuredOutputsParams(choice=["red and blue", "green and red and blue"])),
]


def _greedy(logprobs: int | None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so, logprobs=logprobs)
            for _, so in REQUESTS] + [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]


PROMPTS = [p for p, _ in REQUESTS] + ["One, two, three, four, five, six, one, two, three,"]


@pytest.fixture(scope="module")
def plain(gemma):
    llm = LLM(loaded=gemma, kv_cache_gib=0.25)
    return {lp: llm.generate(PROMPTS, _greedy(lp)) for lp in (None, 2)}


NGRAM = dict(speculative="ngram", num_speculative_tokens=4)
EARLY_EXIT = dict(speculative="self", num_speculative_tokens=2, self_draft_layers=14, self_draft_dtype="float32")


@pytest.mark.parametrize("spec, logprobs", [(NGRAM, None), (NGRAM, 2), (EARLY_EXIT, 2)],
                         ids=["ngram-screen", "ngram-full-logits", "early-exit-full-logits"])
def test_greedy_drafts_under_grammars_give_the_plain_tokens(gemma, plain, spec, logprobs):
    """Without logprobs every row takes the head's screen with its masks (one per draft position);
    with them the drafts are verified on full logits masked the same way, logprobs from the raw
    logits. A plain row decodes beside the constrained ones."""
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, **spec)
    outs = llm.generate(PROMPTS, _greedy(logprobs))
    for a, b in zip(plain[logprobs], outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
        if logprobs and a.outputs[0].logprobs is not None:  # (the plain row reports none)
            lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
            assert len(lp_a) == len(lp_b) and max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-3
    assert re.fullmatch(r"( (one|two|three),){4,12}", outs[1].outputs[0].text)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 20  # the constrained rows drafted, and kept drafts
    _drained(llm)


def test_point_mass_drafts_stop_before_a_token_the_grammar_forbids(gemma):
    """An n-gram draft that would copy a forbidden token is cut before it: it could not be kept."""
    llm = LLM(loaded=gemma, kv_cache_gib=0.1, speculative="ngram", num_speculative_tokens=4)
    so = StructuredOutputsParams(regex=r" (red|blue)( (red|blue)){0,9}\.")
    # The prompt repeats " green", which the n-gram lookup proposes and the grammar forbids.
    out = llm.generate("red green blue green red green blue green red", SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=so))[0].outputs[0]
    assert re.fullmatch(r" (red|blue)( (red|blue)){0,9}\.", out.text)
    green = set(llm.tokenizer.encode(" green", add_special_tokens=False))
    assert not green & set(out.token_ids)
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] == stats["spec_num_accepted_tokens"] or \
        stats["spec_num_draft_tokens"] < 4 * stats["spec_num_drafts"]
    _drained(llm)


# ------------------------------------------------------------------ sampled: the masked distribution
# A few words: the target's favourite " seven" (p 0.84) is forbidden first, "..." after a word
# later. (Words from a list: a mask over Gemma's vocabulary fills in ~10 us, against ~10 ms for
# a character class such as [a-z]+.)
STAT_REGEX = r"( (eight|nine|ten|and|or|so|on|more)[,.]?){1,5}"


def _sample_joint(gemma, drafter, params: SamplingParams, max_num_seqs: int = 64, prompt: str = STAT_PROMPT
                  ) -> tuple[dict, dict]:
    """params.n samples of the prompt's next three tokens through drafts, at most max_num_seqs
    at a time: (counts, engine stats with "top_k_screen_steps", the steps that took the screen)."""
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=max_num_seqs, speculative="ngram",
              num_speculative_tokens=2)
    llm.engine.drafter = drafter
    screened, runner = [0], llm.engine.runner
    execute_top_k = runner.execute_top_k

    def counting(*args, **kwargs):
        screened[0] += 1
        return execute_top_k(*args, **kwargs)

    runner.execute_top_k = counting
    n = min(params.n, max_num_seqs)  # requests of n draws (sample j of a request seeded seed + j)
    prompts = [prompt] * (params.n // n)
    outs = llm.generate(prompts, [dataclasses.replace(params, n=n, seed=params.seed + i * n)
                                  for i in range(len(prompts))])
    counts: dict = {}
    for c in (c for o in outs for c in o.outputs):
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    _drained(llm)
    return counts, {**llm.engine.stats(), "top_k_screen_steps": screened[0]}


@pytest.fixture(scope="module")
def masked_joint(gemma):
    """Exact P(t1, t2, t3) of the target at temperature 1, top-k 2, each position under the
    grammar's mask after the tokens before it (the sampler's order: the mask, then top-k)."""
    backend = GrammarBackend(gemma.tokenizer, gemma.config.vocab_size)
    compiled = backend.compile(StructuredOutputsParams(regex=STAT_REGEX))
    ids = gemma.tokenizer.encode(STAT_PROMPT)

    def top2(path: list[int]) -> dict[int, float]:
        state = backend.new_state(compiled)
        assert all(state.accept(t) for t in path)
        row = all_position_logits(gemma, ids + path)[-1:].float().contiguous()
        bitmask = torch.full(xgr.get_bitmask_shape(1, row.shape[1]), -1, dtype=torch.int32)
        state.fill(bitmask, 0)
        kernels.apply_token_bitmask(row, bitmask, [0])
        vals, idx = row[0].topk(2)
        return dict(zip(idx.tolist(), vals.softmax(-1).tolist()))

    joint = {}
    for t1, p1 in top2([]).items():
        for t2, p2 in top2([t1]).items():
            for t3, p3 in top2([t1, t2]).items():
                joint[(t1, t2, t3)] = p1 * p2 * p3
    return joint


class HalfSampledDrafter(TopTokensDrafter):
    """Random drafts among `tokens`: point masses for the even samples, for the odd ones samples
    from a distribution of their own (uniform over `tokens`) handed over as q, a draft model's
    kind of proposal."""

    def __init__(self, tokens: list[int], vocab: int, seed: int = 0):
        super().__init__(tokens, seed)
        self.q = torch.zeros(vocab)
        self.q[tokens] = 1 / len(tokens)

    def propose(self, seqs, ks):
        return [Draft(d.token_ids, self.q.expand(len(d.token_ids), -1).clone() if s.index % 2 else None)
                for s, d in zip(seqs, super().propose(seqs, ks))]


def test_sampled_drafts_under_a_grammar_keep_the_masked_distribution(gemma, masked_joint):
    """Drafts among the masked support and the forbidden " seven" (the target's favourite): point
    masses are cut before " seven", sampled drafts are not (the rows past a forbidden draft are
    never read)."""
    seven = gemma.tokenizer.encode(" seven", add_special_tokens=False)
    assert len(seven) == 1 and all(key[0] != seven[0] for key in masked_joint)
    support = sorted({t for key in masked_joint for t in key} | set(seven))
    counts, stats = _sample_joint(gemma, HalfSampledDrafter(support, gemma.config.vocab_size), SamplingParams(
        n=NUM_DRAWS, seed=1234, temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex=STAT_REGEX)))
    assert stats["spec_num_draft_tokens"] >= NUM_DRAWS // 2  # the later tokens were speculated
    assert 0.05 * NUM_DRAWS < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    pvalue = _chi_square_pvalue(counts, masked_joint, NUM_DRAWS)
    assert pvalue > 1e-3, (pvalue, counts, masked_joint)


# ------------------------------------------------------------------ penalties, bias, min_tokens
def test_draft_rows_count_the_drafts_before_them_as_output(gemma):
    llm = LLM(loaded=gemma, kv_cache_gib=0.05)
    rid = llm.engine.add_request([2, 5, 6], SamplingParams(repetition_penalty=1.2, max_tokens=4))
    seq = llm.engine.requests[rid].seqs[0]
    seq.append_token(7, 0.0)
    rows = draft_requests(seq, [8, 9])
    assert [r.output_token_ids for r in rows] == [[7], [7, 8], [7, 8, 9]]
    assert all(r.prompt_token_ids == [2, 5, 6] and r.params is seq.params for r in rows)
    assert seq.output_token_ids == [7]
    llm.engine.abort(rid)


PENALIZED = [
    SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.2),
    SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.6, frequency_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=40, logit_bias={1001: 4.0, 506: -3.0}),
    SamplingParams(temperature=0, max_tokens=40, min_tokens=30, repetition_penalty=1.05),
]
GROUNDED = SPEC_PROMPTS[0]  # "repeat the document": prompt-lookup drafts are kept even under penalties


@pytest.fixture(scope="module")
def plain_penalized(gemma):
    llm = LLM(loaded=gemma, kv_cache_gib=0.25)
    return [llm.generate(GROUNDED, p)[0].outputs[0] for p in PENALIZED]


@pytest.mark.parametrize("together", [False, True], ids=["alone-screen", "batched-full-logits"])
def test_greedy_drafts_under_penalties_give_the_plain_tokens(gemma, plain_penalized, together):
    """Alone, each request's 5 rows take the head's top-k screen with each row's touched tokens;
    together (20 rows) full logits. Penalties, bias and min_tokens apply per position either way."""
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, speculative="ngram", num_speculative_tokens=4)
    if together:
        outs = [o.outputs[0] for o in llm.generate([GROUNDED] * len(PENALIZED), PENALIZED)]
    else:
        outs = [llm.generate(GROUNDED, p)[0].outputs[0] for p in PENALIZED]
    for p, a, b in zip(PENALIZED, plain_penalized, outs):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason, p
    assert len(outs[3].token_ids) >= 30
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 40
    _drained(llm)


PENALTY_PROMPT = "a a a a a a a"  # the target repeats " a": penalties on its own output matter
PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=1.0, presence_penalty=0.5)


def penalized_joint(gemma, per_position: bool = True) -> dict:
    """Exact P(t1, t2, t3) at temperature 1, top-k 2, after HF's repetition penalty over the
    prompt and the tokens before each position, then OpenAI's frequency and presence penalties
    over the latter (per_position False: blind to the tokens before each position)."""
    ids = gemma.tokenizer.encode(PENALTY_PROMPT)

    def top2(path: list[int]) -> dict[int, float]:
        path = path if per_position else []
        row = all_position_logits(gemma, ids + path)[-1].float().clone()
        seen = torch.tensor(sorted(set(ids + path)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / PENALTIES["repetition_penalty"],
                                vals * PENALTIES["repetition_penalty"])
        if path:
            tokens, counts = torch.tensor(path).unique(return_counts=True)
            row[tokens] -= PENALTIES["frequency_penalty"] * counts.float() + PENALTIES["presence_penalty"]
        vals, idx = row.topk(2)
        return dict(zip(idx.tolist(), vals.softmax(-1).tolist()))

    return {(t1, t2, t3): p1 * p2 * p3 for t1, p1 in top2([]).items() for t2, p2 in top2([t1]).items()
            for t3, p3 in top2([t1, t2]).items()}


@pytest.mark.parametrize("max_num_seqs", [64, 2], ids=["full-logits", "screen"])
def test_sampled_drafts_under_penalties_keep_the_penalized_distribution(gemma, max_num_seqs):
    """Many draws at once verify on full logits; two at a time (6 rows) through the head's top-k
    screen, each row's touched tokens counting the drafts before it."""
    draws = NUM_DRAWS if max_num_seqs > 2 else NUM_DRAWS // 2  # (two draws a step: slower)
    joint = penalized_joint(gemma)
    support = sorted({t for key in joint for t in key})
    counts, stats = _sample_joint(gemma, TopTokensDrafter(support), SamplingParams(
        n=draws, seed=99, temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, **PENALTIES),
        max_num_seqs, PENALTY_PROMPT)
    assert 0.05 * draws < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert (stats["top_k_screen_steps"] > draws // 2) == (max_num_seqs == 2)
    pvalue = _chi_square_pvalue(counts, joint, draws)
    assert pvalue > 1e-3, (pvalue, counts, joint)
    # The check can fail: the same draws are not those of rows blind to the output's penalties.
    # (A verification that forgets the drafts before a row fails the unit tests above.)
    wrong = penalized_joint(gemma, per_position=False)
    assert set(counts) - set(wrong) or _chi_square_pvalue(counts, wrong, draws) < 1e-3
