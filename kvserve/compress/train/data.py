"""Training data: a text file cut into non-overlapping windows of token ids.

The default file is WikiText-2 `wiki.valid.tokens` (`kvserve.compress.quant.calibrate.calibration_path()`,
the calibration file, so that training never sees the `wiki.test.raw` text the perplexity tables
are measured on). The layout matches the perplexity harness: with a BOS id every window is
BOS + (seqlen - 1) text tokens, otherwise seqlen text tokens; the short tail is dropped. The
windows are shuffled once with a fixed seed, so a run is reproducible and a resumed run sees the
same order.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kvserve.compress.quant.calibrate import calibration_path
from kvserve.tools.eval.windows import make_windows, tokenize_file


def training_windows(tokenizer, seqlen: int, *, path: Path | None = None, bos_token_id: int | None = None,
                     max_windows: int | None = None, seed: int = 0) -> torch.Tensor:
    """Tokenize `path` (default wiki.valid.tokens) once -> windows [n, seqlen] int64, shuffled.

    max_windows: keep the first max_windows windows after the shuffle (a random subset).
    """
    if seqlen < 2:
        raise ValueError(f"--seqlen must be >= 2 (a window trains on seqlen - 1 next tokens), got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1, got {max_windows}")
    path = Path(path).expanduser() if path is not None else calibration_path()
    if not path.is_file():
        raise ValueError(f"--text-file: {path} not found (pass --text-file PATH or set KVSERVE_DATA)")
    ids = tokenize_file(tokenizer, path)
    windows = make_windows(ids, seqlen, bos_token_id)
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))
    if max_windows is not None:
        order = order[:max_windows]
    return windows[order].contiguous()
