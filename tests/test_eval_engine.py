"""Evaluation clients' engine features on the bundled Gemma against HF transformers: prompt
logprobs (chunked, beside a prefix-cache hit), logit_bias (greedy fast paths included) and
embeddings pooled from the final hidden states; no KV block is left behind."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, PoolingParams, SamplingParams
from kvserve.sampling import Sampler, SamplingRequest
from kvserve.sampling import prompt_logprobs as prompt_logprobs_module
from tests.conftest import WIKITEXT

pytestmark = pytest.mark.slow
TOL = 1e-3  # logprobs of HF's float32 forward (measured ~3e-5)


def _wiki(n_chars: int, at: str = "Robert Boulter") -> str:
    text = (WIKITEXT / "wiki.test.raw").read_text(encoding="utf-8")
    start = text.index(at)
    return text[start:start + n_chars]


def _hf_logprobs(hf_gemma, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_gemma(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _pool_is_whole(llm: LLM) -> bool:
    e = llm.engine
    return e.block_manager.num_free_blocks == e.num_blocks and not e.requests


def test_prompt_logprobs_equal_hf_chunked_beside_a_cache_hit(gemma, hf_gemma, monkeypatch):
    """A prompt split into chunks of more rows than one logits block, whose prefix is in the
    prefix cache, scored next to another request: every position's logprob, rank and top-3 as
    HF's log-softmax says, and the sampled tokens as without prompt logprobs."""
    monkeypatch.setattr(prompt_logprobs_module, "ROWS_PER_BLOCK", 16)  # several blocks per chunk
    llm = LLM(loaded=gemma, kv_cache_gib=0.2, max_num_batched_tokens=40)
    prompt, other = _wiki(250), "The three primary colors are"
    greedy = SamplingParams(temperature=0, max_tokens=4)
    plain = llm.generate(prompt, greedy)[0]  # its blocks are now cached
    ids = plain.prompt_token_ids
    assert len(ids) > 40 > 2 * prompt_logprobs_module.ROWS_PER_BLOCK, "chunks must span several logits blocks"
    computed = llm.engine.num_prompt_tokens_computed
    hits = llm.engine.block_manager.prefix_cache_hits
    scored, beside = llm.generate([prompt, other],
                                  [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3), greedy])
    # The cached prefix has no hidden states: the whole prompt was computed again.
    assert llm.engine.num_prompt_tokens_computed - computed == len(ids) + len(beside.prompt_token_ids)
    assert llm.engine.block_manager.prefix_cache_hits == hits
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    assert beside.prompt_logprobs is None and plain.prompt_logprobs is None

    ref = _hf_logprobs(hf_gemma, ids)
    plp = scored.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, tok, entry = ref[i - 1], ids[i], plp[i]
        v = row[tok].item()
        assert abs(entry[tok].logprob - v) < TOL, (i, entry[tok], v)
        lo, hi = int((row > v + TOL).sum()) + 1, int((row > v - TOL).sum()) + 1
        assert lo <= entry[tok].rank <= hi, (i, entry[tok].rank, lo, hi)
        assert entry[tok].decoded_token == gemma.tokenizer.decode([tok], skip_special_tokens=False)
        top = sorted((lp for t, lp in entry.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        ref_top = row.topk(3).values.tolist()
        assert all(abs(a.logprob - b) < TOL for a, b in zip(top, ref_top)), (i, top, ref_top)
        assert len(entry) in (3, 4)  # the top-3 and the prompt token, once
    assert _pool_is_whole(llm)


def test_logit_bias_sampler_equals_bias_added_to_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    bias = {7: 5.0, 11: -100.0, 3: 2.5}
    reqs = [SamplingRequest(SamplingParams(temperature=0, logit_bias=bias), [], []),
            SamplingRequest(SamplingParams(temperature=0), [], []),
            SamplingRequest(SamplingParams(temperature=0, logit_bias={int(logits[2].argmin()): 100}), [], [])]
    assert not Sampler.greedy_only(reqs[:1]) and Sampler.greedy_only(reqs[1:2])
    out = Sampler([0])(logits, reqs)
    biased = logits[0].clone()
    for t, b in bias.items():
        biased[t] += b
    assert out.token_ids == [int(biased.argmax()), int(logits[1].argmax()), int(logits[2].argmin())]


def test_logit_bias_in_the_engine_equals_hf_logits_plus_bias(gemma, hf_gemma):
    """Greedy with a bias: alone and beside a plain greedy request (the decode plan; the
    int8 head screen's batches) and with n-gram speculation, every token is the argmax of HF's
    logits plus the bias; +100 forces its token."""
    prompt = "The capital of France is"
    ids = gemma.tokenizer.encode(prompt)
    with torch.no_grad():
        first = hf_gemma(torch.tensor([ids])).logits[0, -1]
    second = int(first.topk(2).indices[1])  # a bias that flips the argmax at the first step
    bias = {second: float(first.max() - first[second]) + 1.0, int(first.argmax()): -3.0}
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias=bias, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(loaded=gemma, kv_cache_gib=0.1)
    alone = llm.generate(prompt, params)[0]
    batched = llm.generate([prompt, "Once upon a time"], [params, plain])[0]
    spec = LLM(loaded=gemma, kv_cache_gib=0.1, speculative="ngram").generate(prompt, params)[0]
    assert alone.token_ids == batched.token_ids == spec.token_ids
    assert alone.token_ids[0] == second
    with torch.no_grad():  # one causal pass scores every step
        logits = hf_gemma(torch.tensor([ids + alone.token_ids])).logits[0, len(ids) - 1:-1]
    for t, b in bias.items():
        logits[:, t] += b
    assert alone.token_ids == logits.argmax(-1).tolist()
    forced = gemma.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=5, logit_bias={forced: 100}),
                                          SamplingParams(temperature=0.8, seed=1, max_tokens=5,
                                                         logit_bias={forced: 100})])
    assert out[0].token_ids == out[1].token_ids == [forced] * 5
    with pytest.raises(ValueError, match="logit_bias"):  # an id past the vocabulary
        llm.generate(prompt, SamplingParams(logit_bias={gemma.config.vocab_size: 1.0}))
    assert _pool_is_whole(llm)


def test_embeddings_equal_hf_final_hidden_states(gemma, hf_gemma):
    """LLM.embed, LAST and MEAN pooling, against HF's last hidden states (after the final norm),
    normalized or not; prompts split into chunks. Every block is free afterwards."""
    prompts = ["The capital of France is", _wiki(300), "Once upon a time"]
    ids = [gemma.tokenizer.encode(p) for p in prompts]
    assert len(ids[1]) > 32  # pooled over several chunks
    hidden = []
    for x in ids:
        with torch.no_grad():  # the body alone (no LM head): its last hidden state is normed
            out = hf_gemma.model(torch.tensor([x]), output_hidden_states=True)
        assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
        hidden.append(out.last_hidden_state[0])
    for kind, pool in (("LAST", lambda h: h[-1]), ("MEAN", lambda h: h.mean(0))):
        llm = LLM(loaded=gemma, kv_cache_gib=0.1, max_num_batched_tokens=32,
                  pooler_config={"pooling_type": kind.lower()})
        outs = llm.embed(prompts)
        for x, h, out in zip(ids, hidden, outs):
            assert out.prompt_token_ids == x and out.finished
            got = torch.tensor(out.outputs.embedding)
            assert got.shape == (gemma.config.hidden_size,)
            assert (got - F.normalize(pool(h), dim=0)).abs().max() < 1e-4, kind
        raw = torch.tensor(llm.embed(prompts[1], PoolingParams(normalize=False))[0].outputs.embedding)
        assert (raw - pool(hidden[1])).abs().max() < 1e-3 * pool(hidden[1]).abs().max(), kind
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed("x", PoolingParams(dimensions=7))
        assert _pool_is_whole(llm)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """A tiny random Gemma 3 (sliding and global layers, so several KV layer groups) and its HF
    twin."""
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    folder = tmp_path_factory.mktemp("tiny_gemma_eval")
    hf = make_model("gemma3", folder)
    return load_model(folder), hf


def test_prompt_rows_survive_preemption_forks_and_no_cache(tiny_gemma):
    """Prompt logprobs and MEAN embeddings in a pool so small that sequences are preempted
    mid-prefill and recomputed, in chunks, with n = 2 and without a KV cache: every value as
    the HF model gives it, each position scored once, and every block free at the end."""
    loaded, hf = tiny_gemma
    prompts = [" ".join(f"word{i * 7 + j}" for j in range(20 + 5 * i)) for i in range(6)]  # 109..269 tokens
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    with torch.no_grad():
        ref_lp = [hf(torch.tensor([x])).logits[0].log_softmax(-1) for x in ids]
        ref_h = [hf.model(torch.tensor([x])).last_hidden_state[0] for x in ids]
    scored = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    forked = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=8, prompt_logprobs=0)

    def check(out, i):
        assert len(out.prompt_logprobs) == len(ids[i]) and out.prompt_logprobs[0] is None
        for p in range(1, len(ids[i])):
            got = out.prompt_logprobs[p][ids[i][p]].logprob
            assert abs(got - ref_lp[i][p - 1, ids[i][p]].item()) < 1e-4, (i, p)

    # 30 pages of 16 tokens over the layer groups: the newest sequences are preempted mid-prefill
    llm = LLM(loaded=loaded, kv_cache_gib=10 * 16 * loaded.config.num_layers * 2 * 2 * 32 * 4 / 2**30,
              max_num_batched_tokens=32, pooler_config={"pooling_type": "MEAN"})
    engine = llm.engine
    order = (0, 4, 1, 2, 5, 3)  # embeddings between the scored prompts
    added = {i: engine.add_request(ids[i], PoolingParams() if i >= 4 else scored if i % 3 else forked)
             for i in order}
    rids = [added[i] for i in range(6)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.stats()["num_preemptions"] > 0
    for i, rid in enumerate(rids[:4]):
        check(done[rid], i)
        assert len(done[rid].outputs) == (2 if i % 3 == 0 else 1)
    for i, rid in zip((4, 5), rids[4:]):
        want = F.normalize(ref_h[i].mean(0), dim=0)
        assert (torch.tensor(done[rid].outputs.embedding) - want).abs().max() < 1e-5
    assert _pool_is_whole(llm)

    no_cache = LLM(loaded=loaded, kv_cache_gib=0.01, use_kv_cache=False, max_num_batched_tokens=32)
    check(no_cache.generate(prompts[1], scored)[0], 1)
    assert _pool_is_whole(no_cache)


def test_pooler_config_flag_and_validation(capsys):
    from kvserve import EngineConfig
    from kvserve.cli import build_parser, main
    from kvserve.pooling_params import PoolerConfig

    args = build_parser().parse_args(["serve", "--pooler-config", '{"pooling_type": "mean", "normalize": false}'])
    assert EngineConfig(pooler_config=args.pooler_config).pooler_config == PoolerConfig("MEAN", False)
    assert EngineConfig().pooler_config == PoolerConfig("LAST", True)
    assert main(["serve", "--pooler-config", '{"pooling_type": "CLS"}']) == 2  # refused before any loading
    assert "pooling_type" in capsys.readouterr().err
    for bad in ("MEAN", "[1]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--pooler-config", bad])
    for bad in ({"pooling": "MEAN"}, {"normalize": "yes"}, 3):
        with pytest.raises(ValueError):
            EngineConfig(pooler_config=bad)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    for bad in ({"1": 2.0}, {-1: 2.0}, {1: 100.5}, {1: float("nan")}, [(1, 2.0)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
