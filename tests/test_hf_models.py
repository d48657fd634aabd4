"""Tiny random Llama / Qwen2 / Qwen3 / Mistral / Gemma3 checkpoints: the HF-folder loader and
our model code must reproduce HF transformers' logits and greedy tokens."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.loading import load_model
from tests.logits import all_position_logits
from tests.tiny_models import VOCAB, make_model

KINDS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    hf = make_model(kind, folder, shard=kind == "llama")  # llama is written in several shards
    return kind, folder, hf


def test_sharded_checkpoint_really_sharded(tiny):
    """llama is written in shards (so the index path is exercised), the others in one file."""
    kind, folder, _ = tiny
    sharded = kind == "llama"
    assert (len(list(folder.glob("*.safetensors"))) > 1) == sharded
    assert (folder / "model.safetensors.index.json").exists() == sharded


def test_prompt_logits_match_hf(tiny):
    kind, folder, hf = tiny
    loaded = load_model(folder)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (40,), generator=g).tolist()  # longer than the sliding windows
    ours = all_position_logits(loaded, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"{kind}: max abs logit diff {diff}"


def test_greedy_matches_hf_generate(tiny):
    kind, folder, hf = tiny
    llm = LLM(str(folder), kv_cache_gib=0.01)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist(), kind


def test_no_kv_cache_same_tokens(tiny):
    kind, folder, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = list(range(3, 23))
    cached = LLM(str(folder), kv_cache_gib=0.01).generate([prompt], params)[0]
    naive = LLM(str(folder), kv_cache_gib=0.01, use_kv_cache=False).generate([prompt], params)[0]
    assert cached.token_ids == naive.token_ids
