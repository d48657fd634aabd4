"""The engine options vLLM users pass on the command line and to LLM(...): --seed (requests
without a seed sample reproducibly), --block-size, --enable-prefix-caching/--no-..., and the
server's --strict-requests and --chat-template, from the flags to the running engine."""
from __future__ import annotations

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.engine.llm_engine import LLMEngine
from kvserve.loading import load_model
from kvserve.loading.chat_template import read_chat_template
from tests.server_harness import live_server
from tests.tiny_models import make_model

PROMPTS = ["The quick brown fox", "def f(x):", "Paged attention stores"]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_options")
    make_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_model(tiny_folder)


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def test_the_engine_seed_fixes_unseeded_samples(tiny):
    first = _tokens(LLM(loaded=tiny, kv_cache_gib=0.01, seed=7).generate(PROMPTS, SAMPLED))
    again = LLM(loaded=tiny, kv_cache_gib=0.01, seed=7)
    # The same requests in the same order, now one at a time: the same tokens (not a batch effect).
    assert [again.generate(p, SAMPLED)[0].token_ids for p in PROMPTS] == first
    other = _tokens(LLM(loaded=tiny, kv_cache_gib=0.01, seed=8).generate(PROMPTS, SAMPLED))
    assert other != first
    # A request's own seed wins over the engine's.
    own = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)
    assert (LLM(loaded=tiny, kv_cache_gib=0.01, seed=7).generate(PROMPTS[0], own)[0].token_ids
            == LLM(loaded=tiny, kv_cache_gib=0.01, seed=8).generate(PROMPTS[0], own)[0].token_ids)


def _serve_config(monkeypatch, argv: list[str]):
    """What `kvserve serve ARGV` would run: its EngineConfig and ServeOptions."""
    captured = {}

    def fake_serve(config, opts):
        captured.update(config=config, opts=opts)
        return 0

    monkeypatch.setattr("kvserve.server.launch.serve", fake_serve)
    assert main(["serve", *argv]) == 0
    return captured["config"], captured["opts"]


def _sample_all(engine: LLMEngine) -> tuple[list[str], dict]:
    """The prompts one after another through a live server: seedless, sampled."""
    with live_server(engine, "tiny") as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        texts = []
        for p in PROMPTS:
            r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 1.0,
                                                   "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        stats = engine.stats()
    return texts, stats


def test_serve_flags_reach_the_engine_and_one_seed_gives_one_output(monkeypatch, tiny_folder, tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    argv = [str(tiny_folder), "--kv-cache-gib", "0.01", "--seed", "7", "--block-size", "8",
            "--no-enable-prefix-caching", "--strict-requests", "--chat-template", str(tmp_path / "t.jinja")]
    config, opts = _serve_config(monkeypatch, argv)
    assert (config.seed, config.block_size, config.enable_prefix_caching) == (7, 8, False)
    assert config.cache_config.block_size == 8 and not config.cache_config.enable_prefix_caching
    assert opts.limits.strict_requests and read_chat_template(opts.chat_template).text.startswith("{{")
    defaults, opts = _serve_config(monkeypatch, [str(tiny_folder)])
    assert (defaults.seed, defaults.block_size, defaults.enable_prefix_caching) == (None, 16, True)
    assert not opts.limits.strict_requests and opts.chat_template is None
    # Two runs of the server with --seed 7 give the same samples; caching off means no prefix hits.
    first, stats = _sample_all(LLMEngine(config))
    again, _ = _sample_all(LLMEngine(config))
    assert first == again and stats["prefix_cache_hits"] == 0
    config.seed = 8
    assert _sample_all(LLMEngine(config))[0] != first


def test_llm_block_size_and_prefix_caching(tiny):
    repeated = PROMPTS[0] * 12  # more than a block of 16 tokens, sent twice
    greedy = SamplingParams(temperature=0, max_tokens=2)
    pages = {}
    for block_size, enabled in [(16, True), (8, True), (8, False)]:
        llm = LLM(loaded=tiny, kv_cache_gib=0.01, block_size=block_size, enable_prefix_caching=enabled)
        outs = [llm.generate(repeated, greedy)[0].token_ids for _ in range(2)]
        assert outs[0] == outs[1]
        assert (llm.engine.stats()["prefix_cache_hits"] > 0) == enabled
        pages[block_size] = llm.engine.num_blocks
    assert pages[8] in (2 * pages[16], 2 * pages[16] + 1)  # the same pool in pages of half the tokens
