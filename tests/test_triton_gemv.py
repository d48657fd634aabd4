"""Small-batch matrix-vector kernels (kvserve/kernels/triton_gemv.py) through Triton's interpreter,
and the choice between them and cuBLAS (kvserve/accel/cuda_gemv.py) wired into a model: against
float64 products, against the separate activation kernel, and a whole model's greedy tokens and
log-probabilities against the model without them."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before the imports below

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.accel import cuda_gemv  # noqa: E402
from kvserve.accel.cuda_gemv import (  # noqa: E402
    CUBLAS,
    GemvChoice,
    GemvLinear,
    graph_capture,
    tune_small_batch_matmuls,
    use_cublas,
)
from kvserve.accel.fused_linear import fuse_linear_projections  # noqa: E402
from kvserve.kernels import triton_gemv  # noqa: E402
from kvserve.kernels.triton_gemv import CONFIGS, MAX_ROWS, gated_gemv, gemv  # noqa: E402
from kvserve.kernels.triton_ops import gated_act  # noqa: E402
from kvserve.loading import load_model  # noqa: E402
from tests.tiny_models import make_model  # noqa: E402


def rand(*shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (the dtype's rounding of an fp32 sum) against the float64 product: fp32 within its
    summation error, bf16 within half a unit in the last place (2^-8 of the value) of it."""
    rel = 1e-5 if got.dtype == torch.float32 else 2 ** -8
    got, want = got.cpu().double(), want.cpu().double()
    assert got.shape == want.shape
    assert ((got - want).abs() <= want.abs() * rel + 1e-4).all(), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gemv_equals_the_float64_product(dtype, config):
    N, K = 37, 1100  # N past a whole block, K past a whole tile: both edges masked
    w, b = rand(N, K, dtype=dtype, seed=1), rand(N, dtype=dtype, seed=2)
    for M in (1, 3, MAX_ROWS):
        x = rand(M, 2 * K, dtype=dtype)[:, K:]  # a view with a row stride of 2K, as a chunk is
        want = x.cpu().double() @ w.cpu().double().T
        check(gemv(x, w, None, config), want)
        check(gemv(x, w, b, config), want + b.cpu().double())
    assert gemv(rand(0, K, dtype=dtype), w, None, config).shape == (0, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_gated_gemv_is_the_activation_kernel_then_the_product(dtype, gelu_tanh):
    """act(gate) * up is computed tile by tile exactly as the separate kernel computes it, so the
    fused product equals the product of that kernel's output bit for bit."""
    I, N = 300, 24
    w = rand(N, I, dtype=dtype, seed=3)
    for M in (1, 2, MAX_ROWS):
        gate, up = (rand(M, 2 * I, dtype=dtype, seed=4) * 2).chunk(2, dim=-1)
        act = gated_act(gate, up, gelu_tanh)
        for config in CONFIGS[:2]:
            got = gated_gemv(gate, up, w, None, gelu_tanh, config)
            assert torch.equal(got, gemv(act, w, None, config))
        check(got, act.cpu().double() @ w.cpu().double().T)


def test_a_row_does_not_depend_on_the_other_rows_of_its_bucket():
    w = rand(40, 512, dtype=torch.bfloat16, seed=5)
    x = rand(MAX_ROWS, 512, dtype=torch.bfloat16, seed=6)
    whole = gemv(x, w, None, CONFIGS[0])
    assert torch.equal(gemv(x[1:3], w, None, CONFIGS[0]), whole[1:3])


def test_the_choice_applies_to_small_batches_in_graph_captures_only():
    w = rand(8, 64, dtype=torch.float32)
    choice = GemvChoice({1: CONFIGS[0], MAX_ROWS: None})
    with torch.no_grad():
        assert choice.config(rand(1, 64, dtype=torch.float32), w) is None  # eager: cuBLAS
    with torch.no_grad(), graph_capture():
        assert choice.config(rand(1, 64, dtype=torch.float32), w) == CONFIGS[0]
        assert choice.config(rand(3, 64, dtype=torch.float32), w) is None  # cuBLAS chosen for 2-4 rows
        assert choice.config(rand(MAX_ROWS + 1, 64, dtype=torch.float32), w) is None
        assert choice.config(rand(1, 64, dtype=torch.bfloat16), w) is None  # dtypes differ
    with graph_capture():
        assert choice.config(rand(1, 64, dtype=torch.float32), w) is None  # autograd: the kernel has no backward


class FakeTimer:
    """Stands in for the CUDA-graph timing: runs a few candidates once (through the interpreter),
    answers from `times` in call order (per kind: cuBLAS then each tiling at one row; cuBLAS then
    the winner at four) and counts the products made."""

    def __init__(self, one_row: list[float], four_rows: list[float]):
        self.one_row, self.four_rows = one_row, four_rows
        self.calls = 0

    def __call__(self, run, calls: int) -> float:
        n = self.calls % (len(self.one_row) + len(self.four_rows))
        if n in (0, 1, len(self.one_row)):  # cuBLAS and a tiling at one row, the choice at four
            run()
        self.calls += 1
        return self.one_row[n] if n < len(self.one_row) else self.four_rows[n - len(self.one_row)]


def _generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])  # qwen2: SiLU, q/k/v biases; gemma3: GELU-tanh
def test_a_model_with_the_chosen_kernels_decodes_the_same(kind, tmp_path, monkeypatch, one_thread):
    make_model(kind, tmp_path / "src")
    loaded = load_model(tmp_path / "src")
    model = loaded.model
    llm = LLM(loaded=loaded, pack_weights=False, kv_cache_gib=0.01)
    prompts = [[2, 5, 6, 7, 8], [2, 40, 41], [2, 9]]
    before = _generate(llm, prompts[:1]) + _generate(llm, prompts)  # one row, then three
    keys = {k: v.shape for k, v in model.state_dict().items()}
    fuse_linear_projections(model)
    winner = CONFIGS[4]  # fastest at one row, and faster than cuBLAS at four (32-row programs: few to interpret)
    timer = FakeTimer([10.0, 9.0, 6.0, 7.0, 8.0, 5.0], [10.0, 4.0])
    records = tune_small_batch_matmuls(model, timer)
    kinds = {r["kind"] for r in records}
    assert kinds == {"qkv", "o", "gate_up", "down+act"}
    assert all(r["chosen"] == str(winner) for r in records)
    assert records[0]["us"] == {CUBLAS: 10.0, **{str(c): t for c, t in zip(CONFIGS, [9.0, 6.0, 7.0, 8.0, 5.0])}}
    assert timer.calls == 8 * len(kinds)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn.o_proj) is GemvLinear
    for choice in (attn.qkv_proj.gemv, attn.o_proj.gemv, mlp.gate_up_proj.gemv, mlp.down_gated.gemv):
        assert choice.by_rows == {1: winner, MAX_ROWS: winner}
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # same parameters, same names

    calls = {"gemv": 0, "gated_gemv": 0}

    def counting(name):
        real = getattr(triton_gemv, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    for name in calls:
        monkeypatch.setattr(triton_gemv, name, counting(name))
    with graph_capture():  # every step as if it were being captured
        after = _generate(llm, prompts[:1]) + _generate(llm, prompts)
    layers = model.config.num_layers
    assert calls["gated_gemv"] >= 2 * 3 * layers  # every decode step of both runs, every layer
    assert calls["gemv"] >= 3 * 2 * 3 * layers  # q/k/v, o and gate/up
    for b, a in zip(before, after):
        assert a.token_ids == b.token_ids
        for lb, la in zip(b.logprobs, a.logprobs):
            assert la == pytest.approx(lb, abs=1e-4)
    made = dict(calls)
    assert _generate(llm, prompts[:1])[0].token_ids == before[0].token_ids  # eager steps: cuBLAS
    assert calls == made
    use_cublas(model)  # pack_weights=False: every choice dropped
    with graph_capture():
        assert _generate(llm, prompts[:1])[0].token_ids == before[0].token_ids
    assert calls == made


def test_cublas_stays_where_it_is_fastest(tmp_path):
    make_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src").model
    fuse_linear_projections(model)
    records = tune_small_batch_matmuls(model, FakeTimer([1.0, 9.0, 5.0, 1.0, 8.0, 6.0], [1.0]))  # a tie too
    assert {r["chosen"] for r in records} == {CUBLAS}
    assert all(list(r["us"]) == [CUBLAS] for r in records if r["rows"] == MAX_ROWS)  # no tiling to try
    x = torch.randn(1, model.config.hidden_size)
    o = model.layers[0].self_attn.o_proj
    with torch.no_grad(), graph_capture():
        assert o.gemv.config(x[:, :o.in_features], o.weight) is None
    assert torch.equal(o(x[:, :o.in_features]), F.linear(x[:, :o.in_features], o.weight, o.bias))


def test_a_tiling_that_disagrees_with_cublas_is_never_chosen(tmp_path, monkeypatch):
    make_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src").model
    fuse_linear_projections(model)
    broken = CONFIGS[1]
    for name in ("gemv", "gated_gemv"):
        real = getattr(triton_gemv, name)

        def off_by_one(*args, real=real):
            y = real(*args)
            return y + 1.0 if args[-1] == broken else y
        monkeypatch.setattr(triton_gemv, name, off_by_one)
    # The broken tiling would be the fastest (5.0); untimed, the next (6.0) wins.
    records = tune_small_batch_matmuls(model, FakeTimer([10.0, 9.0, 7.0, 8.0, 6.0], [10.0, 4.0]))
    assert len(records) == 8
    for r in records:
        assert r["chosen"] == str(CONFIGS[4]) and str(broken) not in r["us"]
        assert r["rejected"] == ([str(broken)] if r["rows"] == 1 else [])


def test_nothing_is_tuned_off_float_weights(tmp_path):
    make_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src").model.to(torch.float64)  # not a kernel dtype
    fuse_linear_projections(model)
    assert tune_small_batch_matmuls(model, FakeTimer([1.0], [1.0])) == []
    assert cuda_gemv._members(model) == {}
