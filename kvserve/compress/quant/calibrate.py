"""Calibration for the methods that look at activations (GPTQ, AWQ): data and the sequential
layer-by-layer pipeline.

Data: `nsamples` random windows of `seqlen` tokens from WikiText-2 `wiki.valid.tokens` (under
$KVSERVE_DATA/wikitext2, kvserve/paths.py), drawn with a fixed seed. For a model with BOS each window is
BOS + seqlen - 1 text tokens, as in the perplexity windows.

Pipeline (GPTQ's sequential scheme): the embeddings of all windows are the inputs of block 0;
the inputs of block i + 1 are the outputs of block i AFTER it was quantized, so each block is
calibrated on what the quantized model will really feed it. Only one block's inputs
([nsamples * seqlen, hidden]) are held at a time, plus the statistics of that block's linears
(Hessians [in, in], per-channel means and maxima, a few sample rows): memory stays bounded
whatever the depth. Each window runs without a KV cache through the layer's own attention with
`WindowAttention` (kvserve/tools/eval/windows.py) (RoPE at 0..L-1, causal / sliding-window masks).

`Calibrator(model, windows)` is the `stats_fn` of `quantize_model`: `calibrator(i, name)` returns
the `LayerStats` of linear `name` of block i, running block i on its inputs the first time it is
asked about that block, and advancing through the (by then quantized) earlier blocks as needed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from kvserve.model.attention import AttentionMetadata
from kvserve.model.base import run_layer
from kvserve.paths import WIKITEXT2_VALID, wikitext2_file
from kvserve.tools.eval.windows import NO_SLOTS, WindowAttention, tokenize_file
from kvserve.weights.spec import LayerStats

STATS = ("hessian", "absmean", "absmax", "inputs")


def calibration_path() -> Path:
    """WikiText-2 `wiki.valid.tokens` under $KVSERVE_DATA."""
    return wikitext2_file(WIKITEXT2_VALID, "--calib-file")


def calibration_windows(token_ids: torch.Tensor, nsamples: int, seqlen: int, seed: int = 0,
                        bos_token_id: int | None = None) -> torch.Tensor:
    """token_ids [N] (text only) -> [nsamples, seqlen] int64 random windows (fixed seed).

    With bos_token_id each window is BOS + seqlen - 1 consecutive text tokens.
    """
    if nsamples < 1:
        raise ValueError(f"--nsamples must be >= 1, got {nsamples}")
    if seqlen < 2:
        raise ValueError(f"--calib-seqlen must be >= 2, got {seqlen}")
    step = seqlen - 1 if bos_token_id is not None else seqlen
    n = int(token_ids.shape[0])
    if n <= step:
        raise ValueError(f"--calib-seqlen {seqlen} needs more than {step} calibration tokens, the text has {n}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - step + 1, (nsamples,), generator=g)
    text = torch.stack([token_ids[s:s + step] for s in starts.tolist()])
    if bos_token_id is None:
        return text
    return torch.cat([torch.full((nsamples, 1), bos_token_id, dtype=text.dtype), text], dim=1)


def load_calibration(tokenizer, nsamples: int = 128, seqlen: int = 512, seed: int = 0,
                     bos_token_id: int | None = None, path: Path | None = None) -> torch.Tensor:
    """Tokenize wiki.valid.tokens (or `path`) once and draw the windows -> [nsamples, seqlen]."""
    path = Path(path) if path is not None else calibration_path()
    if not path.is_file():
        raise ValueError(f"calibration file {path} not found (pass --calib-file FILE)")
    return calibration_windows(tokenize_file(tokenizer, path), nsamples, seqlen, seed, bos_token_id)


def refuse_shared_kv(model: nn.Module) -> None:
    """Layer-by-layer calibration runs one block at a time over every window, so a layer that
    reuses an earlier layer's K/V (cross-layer sharing) would have none to read."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "kv_source", None) is not None:
        raise ValueError("calibrated quantization / pruning (GPTQ, AWQ, QAT, SmoothQuant, Wanda, SparseGPT) does "
                         "not support models with cross-layer KV sharing (kvserve_kv_source): compress the model "
                         "before `kvserve convert --share-kv-every` (RTN and magnitude pruning work on it)")


def run_windows(fn: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor], model: nn.Module,
                x: torch.Tensor, seqlen: int, batch_size: int = 8) -> torch.Tensor:
    """Apply fn(x_batch [b * seqlen, d], meta) window batch by window batch over x [n * seqlen, d]
    (n windows laid out flat) -> the concatenated outputs. `meta` carries a WindowAttention for the
    b windows of the batch, so an attention module or a whole decoder layer can be `fn`."""
    refuse_shared_kv(model)
    n = x.shape[0] // seqlen
    outs, metas = [], {}
    for a in range(0, n, batch_size):
        b = min(batch_size, n - a)
        if b not in metas:
            metas[b] = AttentionMetadata(slot_mapping=NO_SLOTS, seqs=[], custom=WindowAttention(model, b, seqlen))
        outs.append(fn(x[a * seqlen:(a + b) * seqlen], metas[b]))
    return torch.cat(outs)


def run_block(model: nn.Module, block: nn.Module, x: torch.Tensor, seqlen: int, batch_size: int = 8) -> torch.Tensor:
    """A decoder layer alone on x [n * seqlen, hidden] (n independent windows) -> its outputs."""
    return run_windows(lambda h, meta: run_layer(block, h, None, None, meta), model, x, seqlen, batch_size)


class _Accumulator:
    """Running input statistics of one linear layer (fed by a forward pre-hook)."""

    def __init__(self, collect: set[str], sample_rows: int, total_rows: int):
        self.collect = collect
        self.n = 0
        self.xtx = self.abssum = self.absmax = None
        self.rows: list[torch.Tensor] = []
        # Every `stride`-th row is kept for `inputs` (about sample_rows of the total_rows).
        self.stride = max(1, total_rows // max(sample_rows, 1))

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if "hessian" in self.collect:
            self.xtx = x.T @ x if self.xtx is None else self.xtx.addmm_(x.T, x)
        if "absmean" in self.collect:
            s = x.abs().sum(0)
            self.abssum = s if self.abssum is None else self.abssum + s
        if "absmax" in self.collect:
            m = x.abs().amax(0)
            self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)
        if "inputs" in self.collect:
            first = (-self.n) % self.stride
            self.rows.append(x[first::self.stride].clone())
        self.n += x.shape[0]

    def stats(self, name: str) -> LayerStats:
        return LayerStats(num_tokens=self.n,
                          inputs=torch.cat(self.rows) if self.rows else None,
                          hessian=None if self.xtx is None else self.xtx.mul_(2.0 / self.n),
                          act_absmax=self.absmax,
                          act_absmean=None if self.abssum is None else self.abssum / self.n,
                          extra={"name": name})


class Calibrator:
    """Sequential layer-by-layer statistics for `quantize_model(..., stats_fn=calibrator)`.

    model: a CausalLM (kvserve.model.base); windows [n, L] int64 token windows.
    collect: which LayerStats fields to fill (see STATS); sample_rows: rows kept for `inputs`.
    Blocks must be asked about in increasing order (the inputs only move forward).
    """

    def __init__(self, model: nn.Module, windows: torch.Tensor, *, collect: Iterable[str] = ("hessian",),
                 sample_rows: int = 512, batch_size: int = 8):
        collect = set(collect)
        unknown = collect - set(STATS)
        if unknown:
            raise ValueError(f"collect: unknown statistics {sorted(unknown)} (choose from {', '.join(STATS)})")
        if windows.dim() != 2:
            raise ValueError(f"windows must be [nsamples, seqlen], got shape {tuple(windows.shape)}")
        refuse_shared_kv(model)
        self.model, self.windows = model, windows
        self.seqlen = int(windows.shape[1])
        self.collect, self.sample_rows, self.batch_size = collect, sample_rows, batch_size
        self._hidden: torch.Tensor | None = None
        self._block = 0  # self._hidden holds the inputs of layers[self._block]
        self._captured = -1
        self._stats: dict[str, LayerStats] = {}

    def inputs(self, i: int) -> torch.Tensor:
        """The inputs of block i [n * L, hidden], running the blocks before it as they are now."""
        with torch.no_grad():
            if self._hidden is None:
                self._hidden = self.model.embed(self.windows.reshape(-1))
            if i < self._block:
                raise ValueError(f"block {i} was already passed (calibration runs blocks in order)")
            while self._block < i:
                self._hidden = run_block(self.model, self.model.layers[self._block], self._hidden, self.seqlen,
                                         self.batch_size)
                self._block += 1
        return self._hidden

    def capture(self, i: int, names: Iterable[str] | None = None,
                collect: Iterable[str] | None = None) -> dict[str, LayerStats]:
        """Run block i on its inputs and return the input statistics of its linears (by name in the
        block), without changing anything."""
        block = self.model.layers[i]
        h = self.inputs(i)
        want = set(collect) if collect is not None else self.collect
        accs: dict[str, _Accumulator] = {}
        hooks = []
        for name, mod in block.named_modules():
            if isinstance(mod, nn.Linear) and (names is None or name in names):
                acc = accs[name] = _Accumulator(want, self.sample_rows, h.shape[0])
                hooks.append(mod.register_forward_pre_hook(lambda m, args, acc=acc: acc.add(args[0])))
        try:
            with torch.no_grad():
                run_block(self.model, block, h, self.seqlen, self.batch_size)
        finally:
            for hk in hooks:
                hk.remove()
        return {name: acc.stats(f"layers.{i}.{name}") for name, acc in accs.items()}

    def __call__(self, i: int, name: str) -> LayerStats | None:
        if self._captured != i:
            self._stats = self.capture(i)
            self._captured = i
        return self._stats.get(name)
