"""Training on CPU: data windows, losses (LM cross-entropy, logit distillation) computed a chunk
of rows at a time, and a small resumable loop (`train`). `kvserve distill` heals a pruned student
with it; quantization-aware training and GQA/CLA healing reuse the same loop."""
from kvserve.compress.train.data import training_windows
from kvserve.compress.train.loop import (
           TrainConfig,
           TrainReport,
           train,
           trainable_parameters,
)
from kvserve.compress.train.losses import (
           ChunkedLoss,
           DistillLoss,
           LMLoss,
           distill_loss,
           lm_loss,
)

__all__ = ["training_windows", "ChunkedLoss", "DistillLoss", "LMLoss", "distill_loss", "lm_loss",
           "TrainConfig", "TrainReport", "train", "trainable_parameters"]
