"""The decode-step kernels: packed-panel fp32 matmul (kernels/panel_gemm.c, accel/panels.py) and
the greedy argmax (kernels/argmax.c), against PyTorch."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve import kernels
from kvserve.accel.panels import PanelLinear, use_panel_kernels

needs_panels = pytest.mark.skipif(kernels.pack_panels(torch.zeros(1, 1)) is None,
                                  reason="panel kernel unavailable (no compiler, or no AVX2 / AVX-512)")


@needs_panels
@pytest.mark.parametrize("n, k", [(100, 80), (33, 7), (64, 640), (1000, 1)])
def test_panel_matmul_equals_torch_and_is_batch_invariant(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    packed = kernels.pack_panels(w)
    x = torch.randn(40, k, generator=g)
    y = kernels.panel_matmul(x, packed, n)
    assert y.shape == (40, n)
    torch.testing.assert_close(y, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5 * k ** 0.5)
    # Any batch: each row alone, and any slice, gives bitwise the same outputs.
    for rows in ([3], [0, 1], list(range(5, 18)), list(range(40))):
        assert torch.equal(kernels.panel_matmul(x[rows], packed, n), y[rows])


@needs_panels
def test_panels_pack_any_layout_of_the_weight_alike():
    """Column-major weights (as the loader keeps them) and strided views pack, without a
    contiguous copy, to the very panels of the contiguous weight."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 45, generator=g)
    want = kernels.pack_panels(w)
    column_major = w.t().contiguous().t()
    assert column_major.stride() == (1, 70)
    assert torch.equal(kernels.pack_panels(column_major), want)
    wide = torch.randn(70, 90, generator=g)
    wide[:, ::2] = w
    assert torch.equal(kernels.pack_panels(wide[:, ::2]), want)


@pytest.mark.parametrize("shape", [(64, 4099), (1, 262144), (3, 17), (2, 1), (5, 15)])
def test_argmax_rows_equals_torch_max(shape):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g)
    got = kernels.argmax_rows(x)
    if got is None:
        pytest.skip("no C compiler")
    assert torch.equal(got, x.max(dim=-1).indices)


def test_argmax_rows_ties_nan_inf_like_torch():
    x = torch.zeros(5, 100)
    x[1, 7] = x[1, 90] = 5.0  # a tie: the first index
    x[2, 50] = x[2, 60] = float("nan")  # NaN is the maximum: its first index
    x[2, 70] = float("inf")
    x[3] = -float("inf")
    x[3, 99] = float("inf")
    x[4, 30:] = 1.0  # a tie across vector lanes and the scalar tail
    got = kernels.argmax_rows(x)
    if got is None:
        pytest.skip("no C compiler")
    assert got.tolist() == x.max(dim=-1).indices.tolist() == [0, 7, 50, 99, 30]


def _tiny_model(folder):
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    make_model("llama", folder)
    return load_model(folder, "float32", "cpu").model


@needs_panels
def test_use_panel_kernels_decode_rows_take_the_kernel(monkeypatch):
    lin = nn.Linear(48, 70, bias=True)
    ref = nn.Linear(48, 70, bias=True)
    ref.load_state_dict(lin.state_dict())
    holder = nn.Sequential(lin)
    assert use_panel_kernels(holder) == 1 and type(holder[0]) is PanelLinear
    assert set(holder.state_dict()) == {"0.weight", "0.bias"}  # no new state
    assert holder[0].weight is lin.weight and holder[0].bias is lin.bias  # the same parameters
    lin = holder[0]
    calls = []
    real = kernels.panel_matmul
    monkeypatch.setattr(kernels, "panel_matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(2, 3, 48)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-5)
        lin(x.bfloat16().float())
    assert calls == [6, 6]
    y = lin(torch.randn(4, 48, requires_grad=True))  # autograd: PyTorch's matmul
    assert y.requires_grad and calls == [6, 6]


@needs_panels
def test_packed_copy_follows_in_place_changes_of_the_weight():
    lin = nn.Linear(32, 40, bias=False)
    lin.weight.requires_grad_(False)
    use_panel_kernels(nn.Sequential(lin))
    x = torch.randn(3, 32)
    before = lin(x)
    lin.weight.detach().mul_(2)  # as pruning / SmoothQuant change a weight: the version counter moves
    torch.testing.assert_close(lin(x), 2 * before)
    lin.weight.data = torch.zeros(40, 32)  # a new storage
    assert lin(x).abs().max() == 0


@needs_panels
def test_tied_head_packed_and_logits_match(tmp_path):
    from kvserve.model.base import CausalLM

    model = _tiny_model(tmp_path / "llama")
    assert isinstance(model, CausalLM)
    h = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        want = model.compute_logits(h)
        n = use_panel_kernels(model)
        got = model.compute_logits(h)
    linears = sum(type(m) is PanelLinear for m in model.modules())
    assert n == linears + (model.head_panels is not None) and linears >= 7 * model.config.num_layers
    assert (model.head_panels is not None) == (model.lm_head is None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_engine_packs_fp32_cpu_weights_only_when_asked(tmp_path):
    from kvserve import LLM, SamplingParams
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(model=str(tmp_path / "llama"), pack_weights=False, kv_cache_gib=0.05)
    assert not any(isinstance(m, PanelLinear) for m in plain.engine.loaded.model.modules())
    packed = LLM(model=str(tmp_path / "llama"), kv_cache_gib=0.05)
    if kernels.pack_panels(torch.zeros(1, 1)) is not None:
        assert any(isinstance(m, PanelLinear) for m in packed.engine.loaded.model.modules())
    prompts = [[1, 5, 9, 200, 17], [1, 8], [1, 300, 301, 302, 7, 7, 7, 9, 10]]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in packed.generate(prompts, params)] == want
    # Alone or in a batch: the same tokens (each row's matmuls do not depend on the batch).
    assert [packed.generate(p, params)[0].outputs[0].token_ids for p in prompts] == want
    bf16 = LLM(model=str(tmp_path / "llama"), dtype="bfloat16", kv_cache_gib=0.05)
    assert not any(isinstance(m, PanelLinear) for m in bf16.engine.loaded.model.modules())


@needs_panels
def test_start_up_logs_the_memory_it_holds(tmp_path, caplog):
    """weights as stored, the fast paths' copies (a packed copy of every fp32 matrix, the tied head
    once), the KV pool, and their sum."""
    import logging

    from kvserve import LLM
    from kvserve.accel.prepare import fast_path_nbytes
    from kvserve.model.base import stored_weight_bytes
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "llama")
    with caplog.at_level(logging.INFO, logger="kvserve.engine.builder"):
        llm = LLM(model=str(tmp_path / "llama"), kv_cache_gib=0.05)
    model, cache = llm.engine.loaded.model, llm.engine.kv_cache
    weights, copies = stored_weight_bytes(model), fast_path_nbytes(model)
    # Panels pad each matrix to whole panels: at least the fp32 matrices' bytes, at most one panel row more each.
    matrices = [m.weight for m in model.modules() if isinstance(m, PanelLinear)]
    assert sum(w.numel() * 4 for w in matrices) <= copies <= weights + 4 * sum(w.shape[1] * 32 for w in matrices) + (
        model.embed_tokens.weight.numel() * 4)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:"))
    assert line == (f"memory: weights {weights / 1e9:.2f} GB, fast-path copies {copies / 1e9:.2f} GB, KV pool "
                    f"{cache.nbytes / 1e9:.2f} GB; {(weights + copies + cache.nbytes) / 1e9:.2f} GB in all")
    assert fast_path_nbytes(LLM(model=str(tmp_path / "llama"), pack_weights=False,
                                kv_cache_gib=0.05).engine.loaded.model) == 0


def test_cli_no_pack_weights_flag(tmp_path, monkeypatch):
    from kvserve.accel import panels
    from kvserve.cli import main
    from tests.tiny_models import make_model

    make_model("llama", tmp_path / "llama")
    packed = []
    monkeypatch.setattr(panels, "use_panel_kernels", lambda model, head_only=False: packed.append(model) or 0)
    base = ["generate", "--model", str(tmp_path / "llama"), "--max-tokens", "2", "--ignore-eos", "--kv-cache-gib",
            "0.05", "--quiet-metrics", "hello"]
    assert main(base[:1] + ["--no-pack-weights"] + base[1:]) == 0 and packed == []
    assert main(base) == 0 and len(packed) == 1


@needs_panels
def test_qkv_and_gate_up_stacked_panels_equal_separate_ones(tmp_path):
    """q/k/v and gate/up packed as one matrix each: bitwise the outputs of separately packed
    matrices, the Linears' own copies dropped, idempotent, and repacked after an in-place change."""
    from kvserve.model.attention import Attention
    from kvserve.model.layers import GatedMLP

    model = _tiny_model(tmp_path / "llama")
    use_panel_kernels(model)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    mlp = next(m for m in model.modules() if isinstance(m, GatedMLP))
    assert attn.qkv_panels is not None and mlp.gate_up_panels is not None
    assert attn.q_proj.panels is None and mlp.up_proj.panels is None  # one packed copy each
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        for stacked, linears in ((attn.qkv_panels, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                 (mlp.gate_up_panels, (mlp.gate_proj, mlp.up_proj))):
            alone = torch.cat([kernels.panel_matmul(x, kernels.pack_panels(m.weight), m.weight.shape[0])
                               for m in linears], dim=-1)
            assert torch.equal(stacked.matmul(x), alone)
            # Prefill-sized inputs: the Linears themselves (MKL) still work.
            big = torch.randn(512, model.config.hidden_size)
            torch.testing.assert_close(linears[0](big), big @ linears[0].weight.t(), rtol=1e-5, atol=1e-5)
        before = attn.qkv_panels
        use_panel_kernels(model)
        assert attn.qkv_panels is before  # a second engine on the same model packs nothing again
        q, k, v = attn._project(x)
        attn.k_proj.weight.detach().mul_(2)
        q2, k2, v2 = attn._project(x)
        assert torch.equal(q2, q) and torch.equal(v2, v) and torch.equal(k2, 2 * k)
