"""The gated MLP activations' C kernels (kvserve/kernels/gelu.c) against torch's fp32 ops: each
element within a few ulp of `act(gate) * up`, on fused gate_up halves and on rows whose length
leaves a scalar tail, and a row's numbers independent of the rows beside it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import kernels

pytestmark = pytest.mark.skipif(kernels.kernel_lib("gelu") is None, reason="no C compiler")

CASES = {"silu": (kernels.silu_mul, F.silu),
         "gelu_tanh": (kernels.gelu_tanh_mul, lambda x: F.gelu(x, approximate="tanh"))}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("rows, n", [(1, 1536), (3, 1000), (17, 8197)])
def test_kernel_equals_torch(name, rows, n):
    kernel, act = CASES[name]
    g = torch.Generator().manual_seed(rows * n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4  # reaches silu's and gelu's saturated ends
    gate, up = gate_up.chunk(2, dim=-1)  # strided halves of one fused output
    got = kernel(gate, up)
    # torch's fp32 ops: 1 + tanh cancels where gelu saturates at 0, so both sit ~1e-7 * |up|
    # from the exact value there; elsewhere a few ulp apart.
    want = act(gate) * up
    assert ((got - want).abs() <= 1e-6 * want.abs() + 2.5e-7 * up.abs()).all()
    for r in (0, rows - 1):  # alone, the same numbers
        assert torch.equal(kernel(gate[r:r + 1].contiguous(), up[r:r + 1].contiguous()), got[r:r + 1])


def test_kernel_refuses_what_it_cannot_read():
    gate = torch.randn(4, 8)
    assert kernels.silu_mul(gate.double(), gate.double()) is None
    assert kernels.silu_mul(gate, torch.randn(4, 9)) is None
