"""Weight pruning: unstructured and N:M (magnitude, Wanda, SparseGPT), N:M compressed storage.

    from kvserve.compress.prune import prune_model
    report = prune_model(loaded.model, "sparsegpt", pattern="2:4", calibration=windows)

See kvserve/compress/prune/apply.py (pipeline), masks.py (scores and masks), sparsegpt.py, kvserve/weights/sparse_nm.py
(SparseNMLinear), kvserve/loading/sparse_nm.py (compressed folders) and cli.py (`kvserve prune`).
"""
from kvserve.compress.prune.apply import (
           METHODS,
           LayerPruneReport,
           PruneReport,
           prune_linear,
           prune_model,
)
from kvserve.compress.prune.masks import nm_mask, parse_pattern, unstructured_mask

__all__ = ["METHODS", "LayerPruneReport", "PruneReport", "prune_linear", "prune_model", "nm_mask", "parse_pattern",
           "unstructured_mask"]
