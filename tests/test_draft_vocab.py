"""A draft head over a subset of the vocabulary (kvserve/speculative/draft_vocab.py): the file's
checks, the frequency ranking, the head's logits against the model's own, the CLI."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams, cli
from kvserve.config import EngineConfig
from kvserve.speculative.draft_vocab import DraftVocabHead, rank_tokens, read_draft_vocab, write_draft_vocab
from tests.conftest import WIKITEXT


def test_tokens_ranked_by_count_after_the_ends():
    streams = [[5, 7, 7, 3], [7, 5, 9, 2, 2]]  # 7 x3, 5 x2, 2 x2, 3 x1, 9 x1
    assert rank_tokens(streams, 10, vocab_size=10, always=[1]) == [1, 7, 2, 5, 3, 9]
    assert rank_tokens(streams, 3, vocab_size=10, always=[7]) == [7, 2, 5]  # an end counted once
    assert rank_tokens([[4, 12]], 5, vocab_size=10) == [4]  # ids outside the vocabulary are dropped


@pytest.mark.parametrize("content, size, match", [
    (None, None, "not found"),
    ("{not json", None, "not a draft vocabulary JSON"),
    ('{"vocab_size": 100}', None, "token_ids"),
    ('{"vocab_size": 50, "token_ids": [1, 2]}', None, "vocabulary of 50 tokens; the model has 100"),
    ('{"vocab_size": 100, "token_ids": [1, 100]}', None, r"ids in \[0, 100\)"),
    ('{"vocab_size": 100, "token_ids": []}', None, "non-empty"),
    ('{"vocab_size": 100, "token_ids": [1, 2.0]}', None, r"ids in \[0, 100\)"),
    ('{"vocab_size": 100, "token_ids": [3, 4, 3]}', None, "repeats"),
    ('{"vocab_size": 100, "token_ids": [3, 4, 5]}', 4, r"draft_vocab_size must be in \[1, 3\]"),
])
def test_bad_draft_vocab_files_are_named(tmp_path, content, size, match):
    path = tmp_path / "vocab.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        read_draft_vocab(path, 100, size)
    assert "vocab.json" in str(err.value)


def test_a_written_file_reads_back_cut_to_size(tmp_path):
    write_draft_vocab(tmp_path / "v.json", [9, 3, 7], 10, source="test")
    assert read_draft_vocab(tmp_path / "v.json", 10).tolist() == [9, 3, 7]
    assert read_draft_vocab(tmp_path / "v.json", 10, size=2).tolist() == [9, 3]


def _check_head(model, ids: torch.Tensor, atol: float) -> None:
    """The subset head's logits equal the model's own head at its ids, -inf elsewhere."""
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(model.norm.weight.dtype)
    want = model.compute_logits(hidden, upcast=False)
    got = DraftVocabHead(model, ids, model.norm.weight.dtype)(hidden)
    assert got.shape == want.shape and got.dtype == want.dtype
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    torch.testing.assert_close(got[:, ids].float(), want[:, ids].float(), atol=atol, rtol=0)


def test_subset_head_equals_the_model_head_on_its_tokens(gemma):
    ids = torch.randperm(gemma.config.vocab_size, generator=torch.Generator().manual_seed(1))[:4096]
    _check_head(gemma.model, ids, atol=1e-4)


def test_subset_head_of_a_quantized_head(tmp_path):
    """A draft whose head is RTN int4 (self_draft_bits): the subset takes its dequantized rows."""
    from kvserve.loading import load_model
    from kvserve.weights.quantize import rtn_quantize_model
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "tiny")
    model = load_model(str(tmp_path / "tiny"), "bfloat16").model
    rtn_quantize_model(model, 4, 32, lm_head=True, progress=False)
    assert type(model.lm_head) is not torch.nn.Linear and hasattr(model.lm_head, "dequantized_rows")
    _check_head(model, torch.tensor([0, 5, 17, 3, 40]), atol=0.05)


def test_draft_vocab_settings_are_checked(gemma, tmp_path):
    with pytest.raises(ValueError, match="draft_vocab is only used with a draft model"):
        LLM(loaded=gemma, speculative="ngram", draft_vocab=str(tmp_path / "v.json"))
    with pytest.raises(ValueError, match="give draft_vocab too"):
        LLM(loaded=gemma, speculative="self", draft_vocab_size=100)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        LLM(loaded=gemma, speculative="self", draft_vocab=str(tmp_path / "v.json"), draft_vocab_size=0)
    with pytest.raises(ValueError, match="v.json not found"):
        LLM(loaded=gemma, speculative="self", draft_vocab=str(tmp_path / "v.json"))


def test_cli_writes_the_file_the_engine_flags_read(gemma_path, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat.\nthe dog sat on the log.\n" * 50)
    out = tmp_path / "vocab.json"
    assert cli.main(["draft-vocab", "--model", str(gemma_path), "--corpus", str(corpus), "--size", "5",
                     "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["vocab_size"] == 262144 and len(data["token_ids"]) == 5
    args = cli.build_parser().parse_args(["serve", "--speculative", "self", "--draft-vocab", str(out),
                                          "--draft-vocab-size", "3"])
    spec = EngineConfig(**cli.decoding_config(args)).speculative_config
    assert (spec.draft_vocab, spec.draft_vocab_size) == (str(out), 3)
    assert cli.main(["draft-vocab", "--corpus", str(tmp_path / "none.txt"), "--out", str(out)]) == 2
    assert "--corpus" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_vocab(gemma, tmp_path_factory) -> str:
    """The 8192 most frequent tokens of 200k characters of WikiText-2's validation text."""
    text = (WIKITEXT / "wiki.valid.tokens").read_text(encoding="utf-8")[:200_000]
    ids = rank_tokens([gemma.tokenizer.encode(text, add_special_tokens=False)], 8192, gemma.config.vocab_size,
                      always=gemma.tokenizer.eos_token_ids)
    path = tmp_path_factory.mktemp("vocab") / "vocab.json"
    write_draft_vocab(path, ids, gemma.config.vocab_size, source="wikitext")
    return str(path)


PROMPTS = [(WIKITEXT / "wiki.test.raw").read_text(encoding="utf-8")[9000:9600], "The capital of France is"]
SELF_VOCAB = dict(speculative="self", self_draft_layers=18, num_speculative_tokens=3)


def test_all_the_targets_layers_draft_through_a_small_head(gemma, small_vocab):
    """speculative='self' without a copy, every layer, the head over 8192 tokens: drafts run on
    the target's own weights and K/V (no second pool); greedy tokens equal plain decoding."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(loaded=gemma, kv_cache_gib=0.1).generate(PROMPTS, params)]
    llm = LLM(loaded=gemma, kv_cache_gib=0.1, self_draft_dtype="float32", draft_vocab=small_vocab, **SELF_VOCAB)
    assert llm.engine.draft_runner is None
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0.5 * stats["spec_num_draft_tokens"] > 0


def test_the_gguf_target_drafts_on_its_own_blocks(gemma_path, small_vocab):
    """weights 'gguf' has no float weights to copy: speculative='self' drafts on the target's own
    blocks. A verification's k + 1 rows attend through the chunk kernel, a one-row step through the
    decode kernel, and rounding activations to int8 can magnify their last-bit differences, so tokens
    equal plain decoding up to a near tie (within 0.25 nats of plain's choice)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    common = dict(model=str(gemma_path), weights="gguf", kv_cache_gib=0.1, max_model_len=1024, max_num_seqs=1)
    plain = LLM(**common).generate(PROMPTS, params)
    llm = LLM(**common, draft_vocab=small_vocab, **SELF_VOCAB)
    assert llm.engine.draft_runner is None  # no copy, no second KV pool
    for want, got in zip(plain, llm.generate(PROMPTS, params)):
        a, b = want.outputs[0], got.outputs[0]
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is not None:
            top = a.top_logprobs[i]
            assert i >= 4 and b.token_ids[i] in top and top[a.token_ids[i]] - top[b.token_ids[i]] < 0.25, (i, top)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0.5 * stats["spec_num_draft_tokens"] > 0
