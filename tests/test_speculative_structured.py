"""Speculative decoding under structured outputs (Gemma 3 270M, fp32): each draft position is
verified under the grammar's mask after the drafts before it. Oracles: greedy tokens and logprobs
equal plain constrained decoding (through the head's screen and through full logits), and sampled
outputs keep the masked target distribution (exact joint probabilities, chi-square)."""
from __future__ import annotations

import re

import pytest
import torch
import xgrammar as xgr

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve import kernels
from kvserve.sampling.structured import GrammarBackend, GrammarState
from tests.logits import all_position_logits
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


@pytest.mark.parametrize("spec", [dict(speculative="ngram", num_speculative_tokens=4),
                                  dict(speculative="self", num_speculative_tokens=2, self_draft_layers=14,
                                       self_draft_dtype="float32")], ids=["ngram", "self-early-exit"])
@pytest.mark.parametrize("logprobs", [None, 2], ids=["screen", "full-logits"])
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
# Words that do not start with "s": the target's favourite " seven" (p 0.84) is forbidden first,
# "..." after a word later.
STAT_REGEX = r"( [a-rt-z]+[,.]?){1,5}"


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


@pytest.mark.parametrize("proposer", ["top-tokens", "self-int4"])
def test_sampled_drafts_under_a_grammar_keep_the_masked_distribution(gemma, masked_joint, proposer):
    """top-tokens: point-mass drafts among the masked support and the forbidden " seven" (cut
    before it). self-int4: a draft model's samples (no cut: rows past a forbidden draft are never
    read), which propose " seven" most of the time."""
    seven = gemma.tokenizer.encode(" seven", add_special_tokens=False)
    assert len(seven) == 1 and all(key[0] != seven[0] for key in masked_joint)
    support = sorted({t for key in masked_joint for t in key} | set(seven))
    cfg = dict(speculative="self", num_speculative_tokens=2, self_draft_bits=4) if proposer == "self-int4" else \
        dict(speculative="ngram", num_speculative_tokens=2)
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=64, **cfg)
    if proposer == "top-tokens":
        llm.engine.drafter = TopTokensDrafter(support)
    out = llm.generate(STAT_PROMPT, SamplingParams(n=NUM_DRAWS, seed=1234, temperature=1.0, top_k=2, max_tokens=3,
                                                   ignore_eos=True,
                                                   structured_outputs=StructuredOutputsParams(regex=STAT_REGEX)))[0]
    counts: dict = {}
    for c in out.outputs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] >= NUM_DRAWS // 2  # the later tokens were speculated
    assert 0.05 * NUM_DRAWS < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    pvalue = _chi_square_pvalue(counts, masked_joint, NUM_DRAWS)
    assert pvalue > 1e-3, (pvalue, counts, masked_joint)
    _drained(llm)
