"""Gemma 3 270M in bfloat16 (the dtype of the throughput figures) against HF transformers in
bfloat16 on the same weights: prefill logits bit-for-bit (same GEMMs, same norm rounding order,
same fused attention), and greedy continuations through the decode kernel."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.logits import all_position_logits
from tests.test_gemma import GREEDY_PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_bf16(gemma_path):
    from kvserve.loading import load_model

    return load_model(gemma_path, "bfloat16")


@pytest.fixture(scope="module")
def hf_gemma_bf16(hf_gemma_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_gemma_folder), dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("prompt", [GREEDY_PROMPTS[0], GREEDY_PROMPTS[7]])
def test_bf16_prompt_logits_match_hf_bf16(gemma_bf16, hf_gemma_bf16, prompt):
    ids = gemma_bf16.tokenizer.encode(prompt)
    ours = all_position_logits(gemma_bf16, ids)
    with torch.no_grad():
        ref = hf_gemma_bf16(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    # Stated tolerance 1e-2 (one bf16 ulp at |logit| ~ 2); measured: 0.0 over 729 positions.
    assert diff < 1e-2, f"max abs logit diff {diff} over {len(ids)} positions"


def test_bf16_greedy_follows_hf_bf16(gemma_bf16, hf_gemma_bf16):
    """Decode attention differs from HF's in rounding only (fp32 sums in the kernel), so greedy
    paths may part at a near-tie: measured 6 of 8 prompts equal for 32 tokens, the other two
    parting at tokens 6 and 9. Asserted: >= 6 equal, and every prompt equal for 4 tokens."""
    outs = LLM(loaded=gemma_bf16, kv_cache_gib=0.5).generate(GREEDY_PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    equal = 0
    for prompt, out in zip(GREEDY_PROMPTS, outs):
        ids = gemma_bf16.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_gemma_bf16.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        n = min(len(ref), len(out.token_ids))
        assert out.token_ids[:min(4, n)] == ref[:min(4, n)], repr(prompt[:40])
        equal += out.token_ids[:n] == ref[:n]
    assert equal >= 6, f"only {equal} of {len(GREEDY_PROMPTS)} greedy continuations equal HF bf16"
