"""A literal token-by-token StreamingLLM, written from the paper's description and sharing no
code with kvserve/model/streaming.py: the oracle of the streaming eval and engine tests."""
from __future__ import annotations

import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.model.layers import apply_rope


class LiteralStreaming:
    """Token-by-token StreamingLLM as the paper states it, sharing no code with streaming.py.

    Per layer a list of pre-RoPE (k, v); after appending token i, keep the first `sinks` entries
    and the last `window`; keys are rotated by their index in the list, the query by the last
    index. Global layers use (sinks, window); a sliding layer (native window w) keeps
    (0, min(w, sinks + window)); `window=None` is plain full attention with the native windows.
    """

    def __init__(self, model, sinks: int, window: int | None):
        cfg = model.config
        self.rotary = [model.rotary[t] for t in cfg.layer_types]
        self.keep = []
        for i in range(cfg.num_layers):
            native = cfg.window(i)
            if window is None:
                self.keep.append((0, native if native is not None else 10**9))
            elif native is None:
                self.keep.append((sinks, window))
            else:
                self.keep.append((0, min(native, sinks + window)))
        self.k = [[] for _ in range(cfg.num_layers)]
        self.v = [[] for _ in range(cfg.num_layers)]
        self.native_positions = window is None
        self.position = 0

    def __call__(self, layer, q, k, v):
        assert q.shape[0] == 1, "the literal reference takes one token at a time"
        i = layer.layer
        keys, values = self.k[i], self.v[i]
        keys.append(k[0].float())
        values.append(v[0].float())
        sinks, window = self.keep[i]
        if len(keys) > sinks + window:
            del keys[sinks], values[sinks]  # the oldest token that is not a sink
        n = len(keys)
        first = self.position - n + 1 if self.native_positions else 0  # full attention: stream positions
        cos, sin = self.rotary[i].cos_sin(torch.arange(first, first + n), torch.float32)
        kr = apply_rope(torch.stack(keys), cos, sin)  # [n, KVH, D]
        qr = apply_rope(q.float(), cos[-1:], sin[-1:])[0]  # [H, D]
        vs = torch.stack(values)
        g = q.shape[1] // kr.shape[1]
        out = []
        for h in range(q.shape[1]):
            p = torch.softmax(kr[:, h // g] @ qr[h] * layer.scale, dim=0)
            out.append(p @ vs[:, h // g])
        return torch.stack(out)[None].to(q.dtype)


def literal_greedy(model, prompt: list[int], max_tokens: int, sinks: int, window: int | None) -> list[int]:
    """Greedy continuation of `prompt` under LiteralStreaming, one token per forward pass."""
    ref = LiteralStreaming(model, sinks, window)
    tokens, out = list(prompt), []
    with torch.inference_mode():
        for t in range(len(prompt) + max_tokens - 1):
            ref.position = t
            meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), seqs=[], custom=ref)
            hidden = model(torch.tensor(tokens[t:t + 1]), torch.tensor([t]), None, meta)
            if t >= len(prompt) - 1:
                nxt = int(model.compute_logits(hidden).argmax(-1)[-1])
                tokens.append(nxt)
                out.append(nxt)
    return out
