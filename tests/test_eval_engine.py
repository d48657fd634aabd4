"""Evaluation clients' engine features on the bundled Gemma against HF transformers: prompt
logprobs (chunked, beside a prefix-cache hit), logit_bias (greedy fast paths included) and
embeddings pooled from the final hidden states; no KV block is left behind."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, PoolingParams, SamplingParams
from kvserve.sampling import Sampler, SamplingRequest
from kvserve.sampling.prompt_logprobs import ROWS_PER_BLOCK
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


def test_prompt_logprobs_equal_hf_chunked_beside_a_cache_hit(gemma, hf_gemma):
    """A prompt split into chunks of more rows than one logits block, whose prefix is in the
    prefix cache, scored next to another request: every position's logprob, rank and top-3 as
    HF's log-softmax says, and the sampled tokens as without prompt logprobs."""
    llm = LLM(loaded=gemma, kv_cache_gib=0.2, max_num_batched_tokens=80)
    prompt, other = _wiki(420), "The three primary colors are"
    greedy = SamplingParams(temperature=0, max_tokens=4)
    plain = llm.generate(prompt, greedy)[0]  # its blocks are now cached
    ids = plain.prompt_token_ids
    assert len(ids) > 80 > ROWS_PER_BLOCK, "chunks must be longer than one logits block"
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
    """Greedy with a bias: alone (the batch-1 decode plan), beside a plain greedy request (the
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
    assert _pool_is_whole(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embeddings_equal_hf_final_hidden_states(gemma, hf_gemma, pooling_type):
    """LLM.embed against HF's last hidden states (after the final norm), normalized or not; a
    MEAN prompt split into chunks. Every block is free afterwards."""
    llm = LLM(loaded=gemma, kv_cache_gib=0.1, max_num_batched_tokens=32,
              pooler_config={"pooling_type": pooling_type.lower()})
    prompts = ["The capital of France is", _wiki(300), "Once upon a time"]
    outs = llm.embed(prompts)
    raw = llm.embed(prompts[1], PoolingParams(normalize=False))[0]
    for prompt, out in zip(prompts, outs):
        ids = gemma.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids and out.finished
        with torch.no_grad():
            hs = hf_gemma(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            assert torch.equal(hs, hf_gemma.model(torch.tensor([ids])).last_hidden_state[0])  # normed
        ref = hs.mean(0) if pooling_type == "MEAN" else hs[-1]
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (gemma.config.hidden_size,)
        assert (got - F.normalize(ref, dim=0)).abs().max() < 1e-4
        if prompt == prompts[1]:
            assert len(ids) > 32  # pooled over several chunks
            assert (torch.tensor(raw.outputs.embedding) - ref).abs().max() < 1e-3 * ref.abs().max()
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("x", PoolingParams(dimensions=7))
    assert _pool_is_whole(llm)
