"""Text as windows, and windows through a model without a KV cache: the data path shared by the
perplexity harness (tools/eval/ppl.py), calibration (compress/quant/calibrate.py), pruning and distillation.

Each window runs through the model's own layers with a custom attention
(`AttentionMetadata.custom`): RoPE at positions 0..L-1 of each window and causal (plus
sliding-window) attention per window, one batched SDPA call per layer.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.model.attention import AttentionMetadata
from kvserve.model.base import CausalLM
from kvserve.model.layers import apply_rope

NO_SLOTS = torch.empty(0, dtype=torch.long)  # the custom attention never touches the paged pool


def tokenize_file(tokenizer, path: Path) -> torch.Tensor:
    """The whole file tokenized once, no special tokens -> [N] int64."""
    if not path.is_file():
        raise ValueError(f"--text-file: {path} not found")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long)


def make_windows(token_ids: torch.Tensor, seqlen: int, bos_token_id: int | None = None,
                 max_windows: int | None = None) -> torch.Tensor:
    """token_ids [N] (text only) -> windows [W, seqlen] int64, non-overlapping, the tail dropped.

    With bos_token_id each window is BOS + seqlen - 1 text tokens; without, seqlen text tokens.
    """
    if seqlen < 2:
        raise ValueError(f"--seqlen must be >= 2, got {seqlen}")
    step = seqlen - 1 if bos_token_id is not None else seqlen
    n = int(token_ids.shape[0]) // step
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"--seqlen {seqlen} needs at least {step} text tokens, the text has {token_ids.shape[0]}")
    text = token_ids[: n * step].reshape(n, step)
    if bos_token_id is None:
        return text.clone()
    return torch.cat([torch.full((n, 1), bos_token_id, dtype=text.dtype), text], dim=1)


# --- batched window forward --------------------------------------------------------------------

class WindowAttention:
    """`AttentionMetadata.custom` for B independent windows of L tokens laid out as one flat
    batch [B * L]: RoPE at positions 0..L-1 within each window, causal attention inside each
    window (and the layer's sliding window, if any), one SDPA call over [B, heads, L, D]."""

    def __init__(self, model: CausalLM, num_windows: int, seqlen: int):
        self.model = model
        self.b, self.l = num_windows, seqlen
        self._rope: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[int, torch.Tensor] = {}

    def _cos_sin(self, layer_type: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer_type, dtype)
        if key not in self._rope:
            pos = torch.arange(self.l).repeat(self.b)
            self._rope[key] = self.model.rotary[layer_type].cos_sin(pos, dtype)  # [B*L, D] each
        return self._rope[key]

    def _mask(self, window: int) -> torch.Tensor:
        """[L, L] bool: key j visible from query i iff i - window < j <= i."""
        if window not in self._masks:
            i = torch.arange(self.l)[:, None]
            j = torch.arange(self.l)[None, :]
            self._masks[window] = (j <= i) & (j > i - window)
        return self._masks[window]

    def __call__(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """layer: the calling Attention; q [B*L, H, D], k, v [B*L, KVH, D] pre-RoPE -> [B*L, H, D]."""
        cos, sin = self._cos_sin(self.model.config.layer_types[layer.layer], q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        b, l = self.b, self.l
        qb = q.view(b, l, *q.shape[1:]).transpose(1, 2)  # [B, H, L, D]
        kb = k.view(b, l, *k.shape[1:]).transpose(1, 2)  # [B, KVH, L, D]
        vb = v.view(b, l, *v.shape[1:]).transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        if layer.window is None or layer.window >= l:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=layer.scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self._mask(layer.window), scale=layer.scale,
                                               enable_gqa=gqa)
        return o.transpose(1, 2).reshape(b * l, *q.shape[1:])


def window_hidden(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """windows [B, L] -> final hidden states [B, L, hidden] (one forward pass, no KV cache)."""
    b, l = windows.shape
    attention = WindowAttention(model, b, l)
    meta = AttentionMetadata(slot_mapping=NO_SLOTS, seqs=[], custom=attention)
    hidden = model(windows.reshape(-1), torch.arange(l).repeat(b), None, meta)
    return hidden.view(b, l, -1)
