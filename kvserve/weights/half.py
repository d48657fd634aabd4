"""16-bit weights, fp32 arithmetic: a bf16 / fp16 checkpoint kept in its own dtype.

Under `dtype="auto"` on the CPU an HF folder saved in bfloat16 or float16 keeps each linear
weight and the token embedding in that dtype (half the bytes of an fp32 copy, and half of what a
decode step streams), while activations, norms and sums stay fp32: each product widens the
weight (exactly: every bf16 / fp16 value is an fp32 value), so a layer equals the fp32 model
holding the widened weights up to the order of the sums.

- `HalfLinear`: up to `GEMV_MAX_ROWS` rows (decode steps) the C kernel (kernels/half_gemv.c)
  widens in registers and sums in fp32, the weights read once; more rows (prefill) widen
  `_WIDEN_CHUNK` weights at a time to fp32 and use PyTorch's fp32 matmul, where the widening is
  shared by all the rows. Without the kernel (KVSERVE_NO_KERNELS=1) every call takes the second
  path.
- `HalfEmbedding`: the table in 16 bits, the looked-up rows widened.
- `TiedHalfLinear`: a tied model's LM head multiplying by the embedding's own table (one copy).

The weights are buffers, not parameters, as for the quantized layers: the model's parameters
(its norms) keep saying the dtype it computes in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Rows up to which the C kernel multiplies directly; more widen chunks of the weight to fp32 for
# PyTorch's matmul. Measured on a 2-core Zen 5 (docs/ARCHITECTURE.md, "16-bit weights").
GEMV_MAX_ROWS = 8
_WIDEN_CHUNK = 1 << 22  # weights widened at once on the matmul path (16 MiB of fp32)


def _check_half(name: str, weight: torch.Tensor) -> None:
    if weight.dtype not in HALF_DTYPES or weight.dim() != 2:
        raise ValueError(f"{name}: a 2-D bfloat16 or float16 weight is needed, got {weight.dtype} "
                         f"{tuple(weight.shape)}")


def half_linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ weight [N, K]^T -> [M, N] in x2's dtype, weight 16-bit, widened to x2's dtype."""
    m, n = x2.shape[0], weight.shape[0]
    if m <= GEMV_MAX_ROWS:
        y = kernels.half_gemv(x2, weight)
        if y is not None:
            return y
    rows = max(1, _WIDEN_CHUNK // max(1, weight.shape[1]))
    if n <= rows:
        return F.linear(x2, weight.to(x2.dtype))
    out = x2.new_empty(m, n)
    for a in range(0, n, rows):  # a chunk of output columns per widened slice of the weight
        out[:, a:a + rows] = F.linear(x2, weight[a:a + rows].to(x2.dtype))
    return out


class HalfLinear(nn.Module):
    """y = x W^T + b with W [N, K] bf16 / fp16 (buffer `weight`, as the checkpoint stores it) and
    the arithmetic in x's dtype (fp32); `bias` [N] in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        _check_half("HalfLinear", weight)
        self.out_features, self.in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"HalfLinear: bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("bias", bias)

    @property
    def weight_nbytes(self) -> int:
        """Bytes this layer stores (weight and bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the forward multiplies by, [N, K] float32 (exact)."""
        return self.weight.float()

    def dequantized_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """dequantized_weight()[rows] [T, K] float32, reading only those rows."""
        return self.weight.index_select(0, rows.reshape(-1).to(torch.int64)).float()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={str(self.weight.dtype).removeprefix('torch.')}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = half_linear(x2, self.weight) if x2.shape[0] else x.new_zeros(0, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


class HalfEmbedding(nn.Module):
    """ids [...] -> rows of a bf16 / fp16 table (buffer `weight` [vocab, hidden]) widened to `dtype`."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        _check_half("HalfEmbedding", weight)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.register_buffer("weight", weight.contiguous())

    @property
    def weight_nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, weight={str(self.weight.dtype).removeprefix('torch.')}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight).to(self.dtype)


class TiedHalfLinear(HalfLinear):
    """A tied model's LM head: multiplies by `embedding`'s table, held by reference (not a
    buffer: the state dict holds the table once, as embed_tokens.weight)."""

    tied = True

    def __init__(self, embedding: HalfEmbedding):
        nn.Module.__init__(self)
        self.out_features, self.in_features = embedding.weight.shape
        self._embedding = [embedding]  # a list hides it from nn.Module registration
        self.register_buffer("bias", None)

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    @property
    def weight_nbytes(self) -> int:
        return 0  # the embedding's


def half_weight_modules(model: nn.Module, state_dict: dict[str, torch.Tensor], dtype: torch.dtype
                        ) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor]]:
    """For each nn.Linear of `model` (a skeleton, e.g. on the meta device) and its `embed_tokens`
    whose weight in `state_dict` is bf16 / fp16: a HalfLinear / HalfEmbedding holding that tensor
    as it is (a bias converted to `dtype`, the dtype computed in), and for a tied head (`lm_head`
    None) over a 16-bit table a TiedHalfLinear. Returns (those modules by name, the rest of the
    state dict). ValueError naming the tensor when a shape does not match the layer."""
    rest = dict(state_dict)
    modules: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        w = rest.get(f"{name}.weight")
        if w is None or w.dtype not in HALF_DTYPES:
            continue
        if isinstance(m, nn.Linear):
            if tuple(w.shape) != (m.out_features, m.in_features):
                raise ValueError(f"tensor {name}.weight has shape {tuple(w.shape)}, config implies "
                                 f"{(m.out_features, m.in_features)}")
            bias = rest.pop(f"{name}.bias", None)
            if (bias is None) != (m.bias is None):
                raise ValueError(f"tensor {name}.bias is {'missing' if bias is None else 'unexpected'}")
            modules[name] = HalfLinear(rest.pop(f"{name}.weight"), None if bias is None else bias.to(dtype))
        elif isinstance(m, nn.Embedding) and name == "embed_tokens":
            if tuple(w.shape) != (m.num_embeddings, m.embedding_dim):
                raise ValueError(f"tensor {name}.weight has shape {tuple(w.shape)}, config implies "
                                 f"{(m.num_embeddings, m.embedding_dim)}")
            modules[name] = HalfEmbedding(rest.pop(f"{name}.weight"), dtype)
    if getattr(model, "lm_head", False) is None and "embed_tokens" in modules:
        modules["lm_head"] = TiedHalfLinear(modules["embed_tokens"])
    return modules, rest
