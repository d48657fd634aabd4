"""The last layer computes past its K/V write only for the rows whose logits are needed
(`KeptRows`, `ModelRunner._kept_rows`).

Oracle: the same steps with every row carried through the last layer (`_kept_rows` patched to
return None, the path of a layer class without KeptRows) on a second, identical pool: the same
logits, bitwise the same K/V pools, and the last layer's MLP sees just the logit rows. Mixed
steps cover prefill chunks with and without logits, several logit rows of one sequence
(speculative verification), decode rows, sliding windows and a chunk that needs no logits at all."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.loading import load_model
from kvserve.model.attention import KVCache
from tests.tiny_models import make_model

BS = 4  # block size: chunks, windows and blocks cut inside one another


@pytest.fixture(scope="module", params=["gemma3", "llama", "mistral"])
def loaded(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}-kept")
    make_model(request.param, folder)
    return load_model(folder)


def _runner(loaded, keep: bool) -> ModelRunner:
    cfg = loaded.config
    kv = KVCache(cfg.num_layers, 64 * BS, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    runner = ModelRunner(loaded.model, kv, BS)
    if not keep:  # every row through the last layer, the logit rows picked after the final norm
        runner._kept_rows = lambda *a, **k: None
    return runner


def _ids(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 3 for j in range(n)]


# Three steps over four sequences with block tables of their own (16 blocks each):
# a: a 21-token prompt, then decodes; b: a prompt in chunks of 13 (no logits) and 10 (3 logit
# rows, as a verification of 2 drafts), then a decode; c: 5 tokens, then 6 more without logits;
# d: a chunk without logits alone in its step.
TABLES = {s: list(range(16 * i, 16 * i + 16)) for i, s in enumerate("abcd")}
STEPS = [
    [StepInput(_ids(21, 1), 0, TABLES["a"]), StepInput(_ids(13, 2), 0, TABLES["b"], needs_logits=False)],
    [StepInput(_ids(1, 3), 21, TABLES["a"]), StepInput(_ids(10, 4), 13, TABLES["b"], num_logits=3),
     StepInput(_ids(5, 5), 0, TABLES["c"])],
    [StepInput(_ids(1, 6), 22, TABLES["a"]), StepInput(_ids(1, 7), 23, TABLES["b"]),
     StepInput(_ids(6, 8), 5, TABLES["c"], needs_logits=False)],
    [StepInput(_ids(9, 9), 0, TABLES["d"], needs_logits=False)],
]
LOGIT_ROWS = [1, 1 + 3 + 1, 2, 0]


@pytest.mark.parametrize("prefill", ["kernel", "sdpa"])
def test_same_logits_and_pool_as_every_row_through_the_last_layer(loaded, prefill, monkeypatch):
    import kvserve.model.attention as attention

    if prefill == "sdpa":  # the gather + SDPA path, with its masks, for prefill chunks
        monkeypatch.setattr(attention, "prefill_attention", lambda *a, **k: None)
    kept, full = _runner(loaded, True), _runner(loaded, False)
    seen: list[int] = []
    mlp = loaded.model.layers[-1].mlp
    hook = mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    try:
        for step, rows in zip(STEPS, LOGIT_ROWS):
            seen.clear()
            got = kept.execute(step).float()
            assert seen == ([rows] if rows else [])  # no rows: the last layer stops after its K/V write
            want = full.execute(step).float()
            assert got.shape == want.shape == (rows, loaded.config.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()
    for layer in range(loaded.config.num_layers):
        for a, b in zip(kept.kv_cache.layer(layer)[:2], full.kv_cache.layer(layer)[:2]):
            assert torch.equal(a, b)


def test_greedy_path_takes_the_kept_rows(loaded):
    """execute_greedy (the screen path, or full logits where there is none) picks the same tokens."""
    kept, full = _runner(loaded, True), _runner(loaded, False)
    for step in STEPS:
        a, la = kept.execute_greedy(step)
        b, lb = full.execute_greedy(step)
        ta = a if a is not None else la.float().argmax(-1)
        tb = b if b is not None else lb.float().argmax(-1)
        assert torch.equal(ta, tb)
