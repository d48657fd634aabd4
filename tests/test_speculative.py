"""Speculative decoding inside the batching engine (Gemma 3 270M, fp32): greedy output equals
plain decoding for every proposer in mixed batches (prefix caching and chunked prefill on), the
sampled output distribution equals the target's (chi-square), rollback leaks no blocks."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from kvserve import LLM, SamplingParams, cli
from kvserve.config import EngineConfig
from kvserve.engine.block_manager import BlockManager
from kvserve.loading.loader import default_model_path
from kvserve.speculative.decoder import next_draft_length
from kvserve.weights.half import HalfLinear
from kvserve.weights.linear import QuantLinear
from kvserve.speculative.proposers import Draft
from tests.conftest import WIKITEXT
from tests.logits import all_position_logits


def _doc(start: int, chars: int) -> str:
    return (WIKITEXT / "wiki.test.raw").read_text(encoding="utf-8")[start:start + chars]


SYSTEM = ("You are a careful assistant. You repeat documents word for word when asked, you answer "
          "questions briefly, and you never invent facts that the document does not state.\n\n")
DOC = _doc(5000, 700)
PROMPTS = [
    SYSTEM + DOC + "\n\nRepeat the document above:\n" + DOC[:60],  # input-grounded: n-gram drafts hit
    SYSTEM + "List the first ten prime numbers:",  # shares the system prompt's blocks
    "The capital of France is",
    SYSTEM + _doc(9000, 300) + "\nSummary:",
]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=23, n=2),
        SamplingParams(temperature=0, max_tokens=30, stop=[" of the"]),
        SamplingParams(temperature=0, max_tokens=17, repetition_penalty=1.3),  # penalties at each position
    ]


@pytest.fixture(scope="module")
def plain(gemma):
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_batched_tokens=96)
    return llm.generate(PROMPTS, _mixed_params())


def _drained(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished()
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"


SPEC_CONFIGS = {
    "ngram": dict(speculative="ngram", num_speculative_tokens=4),
    "ngram-k1": dict(speculative="ngram", num_speculative_tokens=1, ngram_min=2, ngram_max=3),
    "self-bf16": dict(speculative="self", num_speculative_tokens=3),
    "self-early-exit": dict(speculative="self", num_speculative_tokens=2, self_draft_layers=6,
                            self_draft_dtype="float32"),
    "self-int4": dict(speculative="self", num_speculative_tokens=3, self_draft_bits=4),
    "draft": dict(speculative="draft", num_speculative_tokens=5, speculative_model=None),  # path filled below
    "ngram-heuristic": dict(speculative="ngram", num_speculative_tokens=6, num_speculative_tokens_schedule="heuristic"),
    # A bf16 copy whose head scores the tokens of WikiText-2's validation text (13404), most frequent first.
    "self-vocab": dict(speculative="self", num_speculative_tokens=3, draft_vocab=None),  # file filled below
}


@pytest.fixture(scope="module")
def draft_vocab_file(gemma, tmp_path_factory) -> str:
    """WikiText-2's validation text's 13404 distinct tokens, most frequent first (`kvserve draft-vocab`)."""
    out = tmp_path_factory.mktemp("draft_vocab") / "vocab.json"
    assert cli.main(["draft-vocab", "--corpus", str(WIKITEXT / "wiki.valid.tokens"), "--out", str(out)]) == 0
    return str(out)


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_greedy_speculative_equals_plain_in_mixed_batches(gemma, plain, name, request):
    cfg = dict(SPEC_CONFIGS[name])
    if cfg["speculative"] == "draft":
        cfg["speculative_model"] = str(default_model_path())  # the same weights: every draft agrees
    if "draft_vocab" in cfg:
        cfg["draft_vocab"] = request.getfixturevalue("draft_vocab_file")
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_batched_tokens=96, **cfg)
    drafted: set[int] = set()
    drafter = llm.engine.drafter
    llm.engine.drafter = type("Spy", (), {"propose": lambda self, seqs, ks: [
        drafted.update(d.token_ids) or d for d in drafter.propose(seqs, ks)]})()
    outs = llm.generate(PROMPTS, _mixed_params())
    for a, b in zip(plain, outs):
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
        assert [c.text for c in b.outputs] == [c.text for c in a.outputs]
        assert [c.finish_reason for c in b.outputs] == [c.finish_reason for c in a.outputs]
    lp_plain, lp_spec = plain[0].outputs[0].logprobs, outs[0].outputs[0].logprobs
    assert len(lp_spec) == len(lp_plain) and max(abs(x - y) for x, y in zip(lp_plain, lp_spec)) < 1e-3
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if name in ("ngram", "draft", "self-bf16", "self-vocab"):
        assert stats["spec_num_accepted_tokens"] > stats["spec_num_draft_tokens"] * 0.3
    if name == "self-bf16":  # 16-bit weights computed in fp32 on kvserve's half kernels
        assert any(isinstance(m, HalfLinear) for m in llm.engine.draft_runner.model.modules())
    if name == "self-int4":  # the RTN copy runs on kvserve's int kernels, as `--weights int4` does
        layers = [m for m in llm.engine.draft_runner.model.modules() if isinstance(m, QuantLinear)]
        assert layers and all(m._gemv is not None for m in layers)
    if name == "self-vocab":  # drafts come from the subset alone
        allowed = set(json.loads(open(cfg["draft_vocab"]).read())["token_ids"])
        assert drafted and drafted <= allowed
    if name == "draft":  # the draft IS the target: greedy drafts are all accepted
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    _drained(llm)
    # The shared system prompt was found in the prefix cache (registered once both caches held it).
    assert stats["prefix_cache_hits"] > 0


def test_ngram_fewer_steps_on_an_input_grounded_prompt(gemma):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, speculative="ngram", num_speculative_tokens=6)
    steps = 0
    for _ in llm.stream(PROMPTS[0], params):
        steps += 1
    assert steps < 48 * 0.6  # most steps emit several tokens


@pytest.mark.parametrize("cfg", [dict(speculative="ngram", num_speculative_tokens=4),
                                 dict(speculative="self", num_speculative_tokens=3)], ids=["ngram", "self-bf16"])
def test_drafts_cut_to_keep_penalized_steps_on_the_screen(gemma, cfg):
    """Four penalized greedy requests, k drafts each, would verify 4 (k + 1) > 8 rows on the full
    head; the drafts are cut to 8 rows so the step keeps the head's top-k screen (a separate
    draft pool then holds only the kept drafts' K/V). Tokens equal plain decoding."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.1)
    prompts = [PROMPTS[0], PROMPTS[3], SYSTEM + DOC[:300] + "\n\nRepeat the document above:\n", PROMPTS[1]]
    want = [o.token_ids for o in LLM(loaded=gemma, kv_cache_gib=0.25).generate(prompts, params)]
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, **cfg)
    drafter = llm.engine.drafter
    asked, rows, runner = [], [], llm.engine.runner
    llm.engine.drafter = type("Spy", (), {"propose": lambda self, seqs, ks: (asked.append(list(ks)),
                                                                             drafter.propose(seqs, ks))[1]})()
    execute_top_k, execute = runner.execute_top_k, runner.execute
    runner.execute_top_k = lambda inputs, *a: (rows.append(("screen", sum(i.num_logits for i in inputs))),
                                               execute_top_k(inputs, *a))[1]
    runner.execute = lambda inputs: (rows.append(("full", sum(i.num_logits for i in inputs))), execute(inputs))[1]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert any(len(ks) == 4 and sum(ks) > 4 for ks in asked)  # drafts past 8 rows were asked for ...
    decodes = [r for r in rows if r[1] > 1]
    assert decodes and all(r == ("screen", 8) for r in decodes if r[1] >= 8), rows  # ... and cut to fit in them
    _drained(llm)


class RecordingDrafter:
    """Proposes the given continuation (the plain greedy tokens) from each sequence's position, or
    random ids where `wrong`; records the draft lengths asked for."""

    def __init__(self, continuation: list[int], wrong: bool):
        self.continuation, self.wrong, self.ks = continuation, wrong, []
        self.random = RandomDrafter(262144)

    def propose(self, seqs, ks):
        self.ks += ks
        if self.wrong:
            return self.random.propose(seqs, ks)
        return [Draft(self.continuation[len(s.output_token_ids):][:k]) for s, k in zip(seqs, ks)]


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
@pytest.mark.parametrize("wrong", [True, False], ids=["rejected", "accepted"])
def test_heuristic_schedule_shortens_rejected_drafts_and_keeps_accepted_ones(gemma, schedule, wrong):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(loaded=gemma, kv_cache_gib=0.1).generate(PROMPTS[2], params)[0].token_ids
    llm = LLM(loaded=gemma, kv_cache_gib=0.1, speculative="ngram", num_speculative_tokens=4,
              num_speculative_tokens_schedule=schedule)
    llm.engine.drafter = drafter = RecordingDrafter(want, wrong)
    assert llm.generate(PROMPTS[2], params)[0].token_ids == want
    stats = llm.engine.stats()
    assert (stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]) == (not wrong)
    if schedule == "constant" or not wrong:  # k each step (fewer only where max_tokens is near)
        assert drafter.ks[:3] == [4, 4, 4]
    else:  # one fewer after each rejection, never below one
        assert drafter.ks[:6] == [4, 3, 2, 1, 1, 1]
    _drained(llm)


@pytest.mark.parametrize("k, drafted, accepted, after", [
    (4, 4, 4, 4), (2, 2, 2, 4), (3, 3, 3, 4), (4, 4, 3, 3), (1, 1, 0, 1), (3, 2, 2, 4), (3, 0, 0, 3)])
def test_next_draft_length(k, drafted, accepted, after):
    assert next_draft_length(k, drafted, accepted, max_k=4) == after


# ----------------------------------------------------------------- output distribution
class RandomDrafter:
    """A deliberately bad proposer: uniformly random token ids."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, seqs, ks):
        return [Draft([self.rng.randrange(self.vocab) for _ in range(k)]) for k in ks]


class TopTokensDrafter(RandomDrafter):
    """Random drafts among a handful of plausible tokens: accepted often enough to matter."""

    def __init__(self, tokens: list[int], seed: int = 0):
        super().__init__(0, seed)
        self.tokens = tokens

    def propose(self, seqs, ks):
        return [Draft([self.rng.choice(self.tokens) for _ in range(k)]) for k in ks]


STAT_PROMPT = "One, two, three, four, five, six,"
STAT_PARAMS = dict(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)
NUM_DRAWS = 384


@pytest.fixture(scope="module")
def target_joint(gemma):
    """Exact P(t1, t2, t3) of the target under temperature 1, top-k 2: {(t1, t2, t3): prob}."""
    ids = gemma.tokenizer.encode(STAT_PROMPT)

    def top2(prefix: list[int]) -> dict[int, float]:
        row = all_position_logits(gemma, prefix)[-1].float()
        vals, idx = row.topk(2)
        return dict(zip(idx.tolist(), vals.softmax(-1).tolist()))

    joint = {}
    for t1, p1 in top2(ids).items():
        for t2, p2 in top2(ids + [t1]).items():
            for t3, p3 in top2(ids + [t1, t2]).items():
                joint[(t1, t2, t3)] = p1 * p2 * p3
    return joint


def _chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    assert set(counts) <= set(probs), f"tokens outside the target's top-k support: {set(counts) - set(probs)}"
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in probs.items())
    dof = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _draws(gemma, drafter_factory=None, **cfg) -> tuple[dict, dict]:
    llm = LLM(loaded=gemma, kv_cache_gib=0.25, max_num_seqs=64, **cfg)
    if drafter_factory is not None:
        llm.engine.drafter = drafter_factory(llm)
    out = llm.generate(STAT_PROMPT, SamplingParams(n=NUM_DRAWS, seed=1234, **STAT_PARAMS))[0]
    counts: dict = {}
    for c in out.outputs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    _drained(llm)
    return counts, llm.engine.stats()


# "early-exit": a real draft model (the target's first 14 of 18 layers) whose distribution is close
# to the target's but not equal; its q comes from the same processing as a separate draft's. (The
# quantized and bf16 copies' greedy equality is covered above; their sampled draws cost 5x more.)
@pytest.mark.parametrize("proposer", ["early-exit", "random", "top-tokens"])
def test_speculative_sampling_keeps_the_target_distribution(gemma, target_joint, proposer):
    vocab = gemma.config.vocab_size
    support = sorted({t for key in target_joint for t in key})
    factories = {"random": lambda llm: RandomDrafter(vocab), "top-tokens": lambda llm: TopTokensDrafter(support)}
    cfg = dict(speculative="self", num_speculative_tokens=2, self_draft_layers=14, self_draft_dtype="float32") \
        if proposer == "early-exit" else dict(speculative="ngram", num_speculative_tokens=2)
    counts, stats = _draws(gemma, factories.get(proposer), **cfg)
    assert stats["spec_num_draft_tokens"] >= NUM_DRAWS  # the second and third tokens were speculated
    if proposer == "random":
        assert stats["spec_num_accepted_tokens"] == 0  # p is 0 outside the top 2: never accepted
    else:  # both outcomes of the acceptance test occur often
        assert 0.05 * NUM_DRAWS < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    pvalue = _chi_square_pvalue(counts, target_joint, NUM_DRAWS)
    assert pvalue > 1e-3, (pvalue, counts, target_joint)


def test_sampling_with_a_draft_vocabulary_keeps_the_target_distribution(gemma, target_joint, draft_vocab_file,
                                                                        tmp_path):
    """An early-exit draft whose head leaves out one of the target's likely tokens: the draft
    never proposes it, yet it is sampled as often as the target says (the residual after a
    rejected draft supplies it)."""
    second = {key[1] for key in target_joint}
    dropped = max(second, key=lambda t: sum(p for key, p in target_joint.items() if key[1] == t))
    support = {t for key in target_joint for t in key}
    ids = sorted(support - {dropped}) + [t for t in json.loads(open(draft_vocab_file).read())["token_ids"]
                                         if t not in support]
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"vocab_size": gemma.config.vocab_size, "token_ids": ids}))
    counts, stats = _draws(gemma, speculative="self", num_speculative_tokens=2, self_draft_layers=14,
                           self_draft_dtype="float32", draft_vocab=str(vocab))
    assert 0.05 * NUM_DRAWS < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert sum(n for key, n in counts.items() if key[1] == dropped) > 0.1 * NUM_DRAWS
    pvalue = _chi_square_pvalue(counts, target_joint, NUM_DRAWS)
    assert pvalue > 1e-3, (pvalue, counts, target_joint)


def test_chi_square_catches_a_wrong_distribution(target_joint):
    """The check above can fail: draws from the top-1 path only are rejected."""
    best = max(target_joint, key=target_joint.get)
    assert _chi_square_pvalue({best: NUM_DRAWS}, target_joint, NUM_DRAWS) < 1e-6


# ----------------------------------------------------------------- configuration errors
def test_bad_speculative_configs_name_the_field(gemma, tmp_path):
    with pytest.raises(ValueError, match="speculative"):
        LLM(loaded=gemma, speculative="medusa")
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(loaded=gemma, speculative="draft")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(loaded=gemma, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        LLM(loaded=gemma, speculative="ngram", ngram_min=4, ngram_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens_schedule"):
        LLM(loaded=gemma, speculative="ngram", num_speculative_tokens_schedule="dynamic")
    with pytest.raises(ValueError, match="self_draft_layers"):
        LLM(loaded=gemma, speculative="self", self_draft_layers=18, self_draft_dtype="float32")
    with pytest.raises(ValueError, match="use_kv_cache"):
        LLM(loaded=gemma, speculative="ngram", use_kv_cache=False)
    with pytest.raises(Exception, match="no such file"):
        LLM(loaded=gemma, speculative="draft", speculative_model=str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("command", [["generate", "hello"], ["serve"]])
def test_cli_schedule_flag_reaches_the_speculative_config(command):
    args = cli.build_parser().parse_args(command + ["--speculative", "ngram"])
    assert EngineConfig(**cli.decoding_config(args)).speculative_config.num_speculative_tokens_schedule == "constant"
    args = cli.build_parser().parse_args(command + ["--speculative", "ngram", "--num-speculative-tokens-schedule",
                                                    "heuristic"])
    assert EngineConfig(**cli.decoding_config(args)).speculative_config.num_speculative_tokens_schedule == "heuristic"


def test_draft_with_another_vocabulary_is_refused(gemma, tmp_path):
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "tiny")
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(loaded=gemma, speculative="draft", speculative_model=str(tmp_path / "tiny"))


def test_tiny_target_with_tiny_draft_greedy_equal(tmp_path):
    """The draft path on HF-folder models: a different (random) draft of the same vocabulary."""
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "target")
    make_model("qwen2", tmp_path / "draft")
    prompts = ["The quick brown fox", "def f(x):", "Paged attention stores keys"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tmp_path / "target"), kv_cache_gib=0.01).generate(prompts, params)
    llm = LLM(str(tmp_path / "target"), kv_cache_gib=0.01, speculative="draft", num_speculative_tokens=3,
              speculative_model=str(tmp_path / "draft"), max_num_batched_tokens=8)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    _drained(llm)


def test_block_manager_trim_returns_only_rejected_blocks():
    from kvserve.sequence import Sequence

    bm = BlockManager(8, 4)
    seq = Sequence(0, "r", list(range(6)), SamplingParams(), 0.0)
    bm.allocate(seq, 6)
    seq.num_computed_tokens = 6
    bm.mark_computed(seq)
    bm.allocate(seq, 1 + 5)  # the last token plus 5 draft slots: positions 6..11 -> 3 blocks
    assert len(seq.block_table) == 3
    seq.output_token_ids = [6, 7]  # 1 accepted draft and the token sampled after it
    seq.num_computed_tokens = 6 + 2
    bm.trim(seq)
    bm.mark_computed(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.check_invariants([seq])
    assert math.isclose(bm.usage(), 2 / 8)


def test_server_streams_speculative_tokens_and_exports_acceptance(gemma):
    """`kvserve serve --speculative ngram`: a streamed completion equals the plain one, several
    tokens may arrive per chunk, and /metrics exports vLLM's spec_decode counters."""
    import httpx
    import openai

    from tests.server_harness import live_server, make_engine

    prompt = PROMPTS[0]
    want = LLM(loaded=gemma, kv_cache_gib=0.25).generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
    with live_server(make_engine(gemma, kv_cache_gib=0.25, speculative="ngram", num_speculative_tokens=4)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = [c.choices[0].text for c in client.completions.create(
            model="test-model", prompt=prompt, max_tokens=24, temperature=0, stream=True) if c.choices]
        metrics = httpx.get(server.url + "/metrics").text
    assert "".join(chunks) == want.outputs[0].text
    assert len([c for c in chunks if c]) < 24  # accepted drafts arrive together
    accepted = [line for line in metrics.splitlines() if line.startswith("kvserve:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0
