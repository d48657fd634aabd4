"""StreamingLLM attention and `kvserve eval stream`.

The chunked streaming code is checked against (a) the model's own paged attention when the cache
holds everything and (b) a literal token-by-token StreamingLLM written here from the paper's
description (a list of pre-RoPE keys, evict the oldest non-sink, rotate by index in the list).
"""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.cli import main
from kvserve.loading import load_model
from kvserve.model.attention import AttentionMetadata
from kvserve.model.config import RopeConfig
from kvserve.model.layers import RotaryEmbedding, apply_rope
from kvserve.model.streaming import (
    LayerCache,
    StreamingAttention,
    StreamPolicy,
    chunk_shift,
    layer_policies,
    query_ranks,
    stream_attention,
)
from kvserve.tools.eval import stream as ev
from tests.conftest import WIKITEXT
from tests.logits import all_position_logits
from tests.streaming_reference import LiteralStreaming
from tests.tiny_models import VOCAB, make_model

DATA = WIKITEXT / "wiki.test.raw"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 6-layer Gemma 3 (sliding window 8, GQA 4:2, head_dim 32)."""
    folder = tmp_path_factory.mktemp("tiny_gemma3_stream")
    make_model("gemma3", folder)
    return load_model(folder)


@pytest.fixture(scope="module")
def gemma_tokens(gemma):
    return ev.load_token_stream(gemma.tokenizer, DATA, 320, gemma.config.bos_token_id)


def literal_nll(model, tokens: torch.Tensor, sinks: int, window: int | None) -> torch.Tensor:
    """Token-by-token NLL [N - 1] under LiteralStreaming."""
    ref = LiteralStreaming(model, sinks, window)
    hidden = []
    with torch.inference_mode():
        for t in range(tokens.shape[0]):
            ref.position = t
            meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), seqs=[], custom=ref)
            hidden.append(model(tokens[t:t + 1], torch.tensor([t]), None, meta))
        return ev.token_nll(model, torch.cat(hidden)[:-1], tokens[1:])


def _policies(cfg, method: str, sinks: int, window: int):
    return ev.method_policies(method, cfg, ev.StreamEvalConfig(num_tokens=10**6, sinks=sinks, window=window))


def _stream_hidden(loaded, tokens: torch.Tensor, policies, chunk: int) -> torch.Tensor:
    """tokens [N] streamed in chunks -> final hidden states [N, hidden]."""
    attn = StreamingAttention.for_model(loaded.model, policies)
    out = []
    with torch.inference_mode():
        for a in range(0, tokens.shape[0], chunk):
            ids = tokens[a:a + chunk]
            out.append(ev.forward_chunk(loaded.model, attn, ids, torch.arange(a, a + len(ids))))
    return torch.cat(out)


# --- exactness -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_cache_holding_everything_equals_full_attention(gemma, gemma_tokens):
    """S + W >= stream length: every method is the model's own attention (logits vs the paged path).

    The LM head runs on every 8th row (and the last) only: it dominates the cost, while every
    row's attention feeds those rows through the layers."""
    n = gemma_tokens.shape[0]
    rows = torch.cat([torch.arange(0, n, 8), torch.tensor([n - 1])])
    ref = all_position_logits(gemma, gemma_tokens.tolist())[rows]
    for method, sinks, window in [("full", 4, 1020), ("sinks", 4, n - 4), ("window", 0, n)]:
        hidden = _stream_hidden(gemma, gemma_tokens, _policies(gemma.config, method, sinks, window), chunk=96)
        with torch.inference_mode():
            ours = gemma.model.compute_logits(hidden[rows])
        diff = (ours - ref).abs().max().item()
        # Stated tolerance as for the HF comparison: 1e-3 absolute on logits of magnitude ~20-40.
        assert diff < 1e-3, f"{method}: max abs logit diff {diff}"


@pytest.mark.parametrize("sinks,window", [(2, 16), (0, 18), (2, 4)])
def test_chunked_equals_literal_token_by_token_tiny(tiny, sinks, window):
    """(2, 4): budget 6 < the sliding window 8, so the local layers are cut too."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, VOCAB, (200,), generator=g)
    ref = literal_nll(tiny.model, tokens, sinks, window)
    method = "sinks" if sinks else "window"  # with S = 0 the two are the same policy
    cfg = ev.StreamEvalConfig(num_tokens=200, sinks=sinks, window=window)
    for chunk in (1, 7, 64):
        ours, _ = ev.stream_nll(tiny.model, tokens, ev.method_policies(method, tiny.config, cfg), chunk,
                                progress=False)
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-4, f"chunk {chunk}: max abs NLL diff {diff}"


def test_literal_reference_full_equals_paged(tiny):
    """The reference itself: with window=None it is the model's own attention."""
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5))
    logits = all_position_logits(tiny, tokens.tolist())
    ref = torch.logsumexp(logits[:-1], -1) - logits[:-1].gather(1, tokens[1:, None])[:, 0]
    assert (literal_nll(tiny.model, tokens, 0, None) - ref).abs().max().item() < 1e-4


@pytest.mark.slow
def test_chunked_equals_literal_token_by_token_gemma(gemma, gemma_tokens):
    """128 tokens, 4 sinks + 40: evictions start at token 44, inside the second of three chunks."""
    tokens = gemma_tokens[:128]
    ref = literal_nll(gemma.model, tokens, sinks=4, window=40)
    cfg = ev.StreamEvalConfig(num_tokens=128, sinks=4, window=40, recompute_positions=8)
    ours, _ = ev.stream_nll(gemma.model, tokens, ev.method_policies("sinks", gemma.config, cfg), 48,
                            progress=False)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, f"max abs NLL diff {diff}"


def test_recompute_contexts(tiny):
    """recompute: token t from a fresh pass over the B tokens before it (positions 0..B-1);
    recompute-bos: the same with BOS in place of the oldest one; both are full attention while
    the context reaches the stream's start."""
    bos, budget = 2, 24
    text = torch.randint(3, VOCAB, (99,), generator=torch.Generator().manual_seed(6))
    tokens = torch.cat([torch.tensor([bos]), text])
    targets = torch.tensor([5, budget, 60, 99])
    plain, _ = ev.recompute_nll(tiny.model, tokens, targets, budget, progress=False)
    with_bos, _ = ev.recompute_nll(tiny.model, tokens, targets, budget, bos=bos, progress=False)

    def nll_last(ids: torch.Tensor, target: int) -> float:
        logits = all_position_logits(tiny, ids.tolist())[-1]
        return float(torch.logsumexp(logits, -1) - logits[target])

    for i, t in enumerate(targets.tolist()):
        ctx = tokens[max(0, t - budget):t]
        assert abs(plain[i] - nll_last(ctx, int(tokens[t]))) < 1e-4
        if t > budget:
            ctx = torch.cat([torch.tensor([bos]), ctx[1:]])
        assert abs(with_bos[i] - nll_last(ctx, int(tokens[t]))) < 1e-4
    assert torch.equal(plain[:2], with_bos[:2])  # contexts that reach the start are the same


# --- positions inside the cache ------------------------------------------------------------------

def test_positions_are_ranks_in_the_cache():
    """Hand-computed: S=2, W=4, 10 tokens. After token 9 the cache is [0, 1, 6, 7, 8, 9], ranks
    0..5; the query's rank is 5."""
    sinks = StreamPolicy(sinks=2, window=4, in_cache=True)
    assert query_ranks(torch.tensor([3, 5, 9, 100]), sinks).tolist() == [3, 5, 5, 5]
    assert chunk_shift(9, sinks) == 4  # window keys 6..9 -> 2..5 and the query 9 -> 5: their ranks
    window = StreamPolicy(window=4, in_cache=True)
    assert chunk_shift(9, window) == 6  # keys 6..9 -> 0..3, query -> 3
    assert chunk_shift(2, window) == 0  # nothing evicted yet: ranks are stream positions
    assert chunk_shift(9, StreamPolicy(window=4)) == 0  # the model's own sliding window: stream positions


def test_sink_rotation_uses_rank_hand_computed():
    torch.manual_seed(0)
    H, KVH, D, n, scale = 2, 1, 8, 10, 0.3
    rotary = RotaryEmbedding(RopeConfig(theta=10.0), D)  # fast rotations: distances matter a lot
    q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
    cache = LayerCache(StreamPolicy(sinks=2, window=4, in_cache=True))
    for a in range(0, n, 3):  # chunks of 3, like the evaluator
        pos = torch.arange(a, min(a + 3, n))
        cache.append(k[pos], v[pos], pos)
        out = stream_attention(q[pos], pos, cache, rotary, scale)
        cache.evict(int(pos[-1]) + 1)
    kept = [0, 1, 6, 7, 8, 9]

    def by_hand(q_at: int, k_at: list[int]) -> torch.Tensor:
        cos, sin = rotary.cos_sin(torch.tensor(k_at + [q_at]), torch.float32)
        kr = apply_rope(k[kept], cos[:-1], sin[:-1])[:, 0]
        qr = apply_rope(q[9:10], cos[-1:], sin[-1:])[0]
        return torch.softmax(qr @ kr.T * scale, dim=-1) @ v[kept, 0]

    expected = by_hand(5, [0, 1, 2, 3, 4, 5])  # ranks
    assert torch.allclose(out[-1], expected, atol=1e-5)
    stream_positions = by_hand(9, kept)  # what no re-rotation would give: sinks 9 - s away
    assert not torch.allclose(out[-1], stream_positions, atol=1e-2)


# --- memory -------------------------------------------------------------------------------------

def test_cache_bounded_and_flat(tiny):
    tokens = torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(4))
    S, W, C = 2, 16, 8
    cfg = ev.StreamEvalConfig(num_tokens=300, sinks=S, window=W, chunk=C)
    for method in ("window", "sinks"):
        policies = ev.method_policies(method, tiny.config, cfg)
        attn = StreamingAttention.for_model(tiny.model, policies)
        with torch.inference_mode():
            for a in range(0, 300, C):
                ids = tokens[a:a + C]
                ev.forward_chunk(tiny.model, attn, ids, torch.arange(a, a + len(ids)))
                assert all(c.num_tokens <= S + W - 1 for c in attn.caches), "evicted down to what the next chunk needs"
        sizes = attn.sizes
        assert max(s.max_layer_tokens for s in sizes) <= S + W + C
        steady = [s for s in sizes[:-1] if s.position >= S + W]  # the last chunk is partial (300 % 8)
        assert {s.max_layer_tokens for s in steady} == {S + W - 1 + C}
        assert len({s.total_bytes for s in steady}) == 1, "bytes flat once the cache is full"
    _, full_sizes = ev.stream_nll(tiny.model, tokens, ev.method_policies("full", tiny.config, cfg), C,
                                  progress=False)
    assert full_sizes[-1].max_layer_tokens == 300  # the reference grows with the stream


def test_policies_for_gemma_layers(gemma):
    """Defaults: global layers 4 + 1020 with positions in the cache; local layers keep their native
    512 (the budget 1024 covers them), so they are exactly the model's own."""
    pol = layer_policies(gemma.config, sinks=4, window=1020)
    for i, p in enumerate(pol):
        if gemma.config.window(i) is None:
            assert p == StreamPolicy(sinks=4, window=1020, in_cache=True)
        else:
            assert (p.sinks, p.window) == (0, 512)


# --- CLI ----------------------------------------------------------------------------------------

@pytest.fixture
def cli_model(gemma, monkeypatch):
    """The CLI loads its model through ev.load_model: hand it the session's Gemma."""
    monkeypatch.setattr(ev, "load_model", lambda model=None, dtype="float32": gemma)


@pytest.mark.slow
def test_cli_smoke_writes_table_json_and_png(cli_model, tmp_path, capsys):
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    rc = main(["eval", "stream", "--num-tokens", "300", "--window", "100", "--chunk", "128",
               "--recompute-positions", "4", "--data", str(DATA), "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    out = capsys.readouterr().out
    for method in ev.DEFAULT_METHODS:
        assert f"| {method} |" in out
    doc = json.loads(out_json.read_text())
    assert doc["config"]["budget"] == 104 and doc["bos_once"] is True
    assert set(doc["methods"]) == set(ev.DEFAULT_METHODS)
    assert doc["methods"]["sinks"]["cache_max_tokens_per_layer"] <= 104 + 128
    assert doc["methods"]["full"]["cache_max_tokens_per_layer"] == 300
    assert len(doc["methods"]["recompute"]["nll_subsample"]) == 4
    assert doc["methods"]["recompute"]["ppl_all"] is None
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [
    (["--data", "/no/such/wiki.raw"], "/no/such/wiki.raw"),
    (["--window", "0"], "--window"),
    (["--sinks", "-1"], "--sinks"),
    (["--chunk", "0"], "--chunk"),
    (["--methods", "full,bogus"], "bogus"),
    (["--recompute-positions", "0"], "--recompute-positions"),
    (["--num-tokens", "1"], "--num-tokens"),
    (["--num-tokens", "40000"], "context 32768"),
])
def test_bad_arguments_exit_2_naming_the_field(cli_model, argv, message, capsys):
    argv = ["--data", str(DATA)] + argv if "--data" not in argv else argv
    assert main(["eval", "stream"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and message in err, err
    assert "Traceback" not in err


def test_num_tokens_over_the_file(cli_model, tmp_path, capsys):
    small = tmp_path / "small.raw"
    small.write_text(" = Title = \n a few words of text \n")
    assert main(["eval", "stream", "--data", str(small), "--num-tokens", "1000", "--recompute-positions", "2"]) == 2
    err = capsys.readouterr().err
    assert "--num-tokens 1000" in err and str(small) in err
