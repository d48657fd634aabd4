"""`QuantEmbedding`: the token-embedding lookup read from low-bit codes.

For a tied model (Gemma 3, Llama 3.2, small Qwen) the embedding table IS the LM head, and at
262144 x 640 it is 63% of Gemma 3 270M's weights. Quantizing the head alone leaves the fp32 table
resident for the lookup; with `QuantEmbedding(head, tied=True)` the lookup dequantizes the T rows
it needs from the head's own packed codes (llama.cpp's get_rows on a quantized token_embd does the
same), so one low-bit copy serves both ends and the float table is freed. An untied model's
table gets its own QuantLinear-format storage (`tied=False`), never multiplied with, only read.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.weights.linear import QuantLinear


class QuantEmbedding(nn.Module):
    """ids [...] -> rows of a low-bit table's dequantized weight [..., hidden] in `dtype` (a
    QuantLinear, or a GGMLLinear holding a GGUF's blocks: anything with `dequantized_rows`).

    tied=True: `table` is the model's LM head, held by reference (not a submodule, so its
    buffers are in the state dict once, under lm_head). tied=False: `table` is owned
    (state dict keys `table.*`)."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype = torch.float32, tied: bool = False):
        super().__init__()
        self.tied = tied
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        if tied:
            self._tied = [table]  # a list hides it from nn.Module registration
        else:
            self.table = table

    @property
    def source(self) -> QuantLinear:
        return self._tied[0] if self.tied else self.table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = self.source.dequantized_rows(flat).to(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    @property
    def weight_nbytes(self) -> int:
        """Bytes this lookup adds (0 when it shares the LM head's codes)."""
        return 0 if self.tied else self.table.weight_nbytes

    def extra_repr(self) -> str:
        spec = getattr(self.source, "spec", None)
        label = spec.label() if spec is not None else self.source.ggml_type.name
        return (f"{self.num_embeddings}, {self.embedding_dim}, tied={self.tied}, "
                f"{label}, dtype={str(self.dtype).removeprefix('torch.')}")
