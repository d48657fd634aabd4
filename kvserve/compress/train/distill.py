"""Logit distillation of a student from a teacher (`kvserve distill`): heal a pruned model.

The student is trained on windows of a text file (default WikiText-2 `wiki.valid.tokens`, never
the test text the perplexity tables use) with DistillLoss: (1 - alpha) * CE + alpha * tau^2 *
KL(teacher || student) at temperature tau. Before and after, the student's perplexity on
WikiText-2 raw test (the benchmark protocol: seqlen 512, `eval_windows` windows, BOS first) is
measured in the same pass as its KL to the teacher and their top-1 agreement.

CPU economy: by default the token embedding and the LM head (tied on Gemma: 262144 x 640, 63% of
Gemma 3 270M) are frozen; their gradient and AdamW moments would cost ~2 GB and most of the
optimizer's time, and a pruned body is what needs healing. `train_embeddings` trains them too.

Output folder: the student (kvserve.loading.save.save_model, tokenizer from the student), and
while a run is unfinished `distill_checkpoint.pt` (trained parameters + AdamW state, see
kvserve.compress.train.loop) beside `distill_run.json` (the settings the checkpoint belongs to). A run
that stops (Ctrl-C, a crash, a time limit) continues with `resume=True`; the checkpoint is deleted
once the student is saved unless `keep_checkpoint`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.compress.quant.calibrate import calibration_path
from kvserve.compress.train.data import training_windows
from kvserve.compress.train.loop import TrainConfig, train, trainable_parameters
from kvserve.compress.train.losses import DEFAULT_CHUNK_ROWS, DistillLoss
from kvserve.loading.save import save_model
from kvserve.tools.eval.ppl import dataset_path, evaluate, tokenize_file

log = logging.getLogger("kvserve.distill")

CHECKPOINT = "distill_checkpoint.pt"
RUN_FILE = "distill_run.json"
DEFAULT_STEPS = 100
# Settings a resumed run must share with the checkpoint's run (beyond TrainConfig's own check).
_RUN_KEYS = ("teacher", "student", "text_file", "seqlen", "temperature", "alpha", "train_embeddings",
             "max_windows")


@dataclass(frozen=True)
class DistillOptions:
    """Settings of `distill`; validated on construction (messages name the CLI flags)."""

    seqlen: int = 256
    batch_size: int = 4
    steps: int | None = None  # default: from `tokens`, else DEFAULT_STEPS
    tokens: int | None = None  # training tokens: steps = ceil(tokens / (batch_size * seqlen))
    lr: float = 5e-5
    warmup_steps: int | None = None  # default: 5% of the steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    schedule: str = "cosine"
    temperature: float = 2.0
    alpha: float = 0.5
    train_embeddings: bool = False
    text_file: Path | None = None  # default: WikiText-2 wiki.valid.tokens
    max_windows: int | None = None
    seed: int = 0
    checkpoint_every: int = 50
    resume: bool = False
    keep_checkpoint: bool = False
    eval_windows: int = 20  # 0 = no before / after perplexity
    eval_seqlen: int = 512
    eval_file: Path | None = None  # default: WikiText-2 wiki.test.raw
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    log_every: int = 10

    def __post_init__(self) -> None:
        if self.seqlen < 2:
            raise ValueError(f"--seqlen must be >= 2, got {self.seqlen}")
        if self.steps is not None and self.tokens is not None:
            raise ValueError("give --steps or --tokens, not both")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {self.tokens}")
        if self.eval_windows < 0:
            raise ValueError(f"--eval-windows must be >= 0 (0 = skip), got {self.eval_windows}")
        if self.eval_seqlen < 2:
            raise ValueError(f"--eval-seqlen must be >= 2, got {self.eval_seqlen}")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"--max-windows must be >= 1, got {self.max_windows}")
        DistillLoss(None, temperature=self.temperature, alpha=self.alpha, chunk_rows=self.chunk_rows)  # checks
        self.train_config()  # checks the optimizer settings
        for flag, path in (("--text-file", self.text_file), ("--eval-file", self.eval_file)):
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"{flag}: {path} not found")

    @property
    def num_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        if self.tokens is not None:
            return math.ceil(self.tokens / (self.batch_size * self.seqlen))
        return DEFAULT_STEPS

    def train_config(self) -> TrainConfig:
        steps = self.num_steps
        warmup = self.warmup_steps if self.warmup_steps is not None else steps // 20
        return TrainConfig(steps=steps, batch_size=self.batch_size, lr=self.lr, weight_decay=self.weight_decay,
                           warmup_steps=warmup, grad_clip=self.grad_clip, seed=self.seed,
                           checkpoint_every=self.checkpoint_every, log_every=self.log_every,
                           schedule=self.schedule)


def _bos(loaded) -> int | None:
    return loaded.config.bos_token_id if loaded.config.add_bos_token else None


def _evaluate(student, teacher, ids: torch.Tensor | None, opts: DistillOptions, progress: bool) -> dict | None:
    if ids is None:
        return None
    r = evaluate(student.model, ids, opts.eval_seqlen, reference=teacher.model, bos_token_id=_bos(student),
                 max_windows=opts.eval_windows, progress=progress)
    return {"ppl": r.ppl, "teacher_ppl": r.ref_ppl, "kl_to_teacher": r.kl_mean, "top1_agree": r.top1_agree,
            "windows": r.num_windows, "seqlen": r.seqlen, "tokens": r.num_tokens, "seconds": r.seconds}


def share_frozen_embedding(teacher, student) -> bool:
    """Point the student's (frozen) token embedding at the teacher's when they are equal -> shared.

    A pruned student usually keeps the teacher's table: on Gemma that is 670 MB of fp32 (and the
    tied LM head with it) held once instead of twice. Nothing changes numerically."""
    t, s = teacher.embed_tokens.weight, student.embed_tokens.weight
    if t is s or t.shape != s.shape or t.dtype != s.dtype or not torch.equal(t, s):
        return t is s
    student.embed_tokens.weight = t
    return True


def _run_record(teacher, student, opts: DistillOptions) -> dict:
    text = opts.text_file
    if text is None:
        text = calibration_path()
    return {"teacher": str(teacher.source), "student": str(student.source),
            "text_file": str(Path(text).expanduser().resolve()), "seqlen": opts.seqlen,
            "temperature": opts.temperature, "alpha": opts.alpha, "train_embeddings": opts.train_embeddings,
            "max_windows": opts.max_windows}


def _prepare_out(out: Path, record: dict, resume: bool) -> Path:
    """Check the output folder against the run -> the checkpoint path."""
    ckpt = out / CHECKPOINT
    run_file = out / RUN_FILE
    if ckpt.exists() and not resume:
        raise ValueError(f"--out {out} holds the checkpoint of an unfinished run ({CHECKPOINT}): pass --resume to "
                         f"continue it, or choose another --out")
    if ckpt.exists() and run_file.is_file():
        saved = json.loads(run_file.read_text())
        for k in _RUN_KEYS:
            if saved.get(k) != record[k]:
                raise ValueError(f"--resume: the checkpoint in {out} was made with {k} = {saved.get(k)!r}, "
                                 f"now {record[k]!r}")
    if resume and not ckpt.exists():
        log.info("--resume: no checkpoint in %s, starting from step 0", out)
    out.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(record, indent=1))
    return ckpt


def distill(teacher, student, out: str | Path, opts: DistillOptions | None = None, *,
            progress: bool = True) -> dict:
    """Distill `teacher` into `student` (kvserve LoadedModels sharing the vocabulary; the
    student's weights change in place), save the student to `out` -> the report dict."""
    opts = opts or DistillOptions()
    if teacher.model is student.model:
        raise ValueError("--teacher and --student must be two models (the student is trained in place)")
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError(f"--teacher: the vocabulary ({teacher.config.vocab_size}) differs from the student's "
                         f"({student.config.vocab_size}); distillation compares next-token distributions")
    out = Path(out).expanduser()
    record = _run_record(teacher, student, opts)
    ckpt = _prepare_out(out, record, opts.resume)
    cfg = opts.train_config()
    windows = training_windows(student.tokenizer, opts.seqlen, path=opts.text_file, bos_token_id=_bos(student),
                               max_windows=opts.max_windows, seed=opts.seed)
    eval_ids = None
    if opts.eval_windows:
        eval_path = Path(opts.eval_file).expanduser() if opts.eval_file else dataset_path()
        eval_ids = tokenize_file(student.tokenizer, eval_path)
    before = _evaluate(student, teacher, eval_ids, opts, progress)
    if before:
        log.info("before: student PPL %.3f (teacher %.3f), KL %.4f", before["ppl"], before["teacher_ppl"],
                 before["kl_to_teacher"])
    if not opts.train_embeddings:
        share_frozen_embedding(teacher.model, student.model)
    params = trainable_parameters(student.model, train_embeddings=opts.train_embeddings)
    loss = DistillLoss(teacher.model, temperature=opts.temperature, alpha=opts.alpha, chunk_rows=opts.chunk_rows)
    report = train(student.model, windows, loss, cfg, params=params, checkpoint=ckpt, progress=progress)
    t0 = time.perf_counter()
    save_model(student, out)
    save_seconds = time.perf_counter() - t0
    after = _evaluate(student, teacher, eval_ids, opts, progress)
    if not opts.keep_checkpoint:
        ckpt.unlink(missing_ok=True)
        (out / RUN_FILE).unlink(missing_ok=True)
    head = report.losses[: min(10, len(report.losses))]
    tail = report.losses[-min(10, len(report.losses)):]
    return {**record, "out": str(out), "options": _jsonable(dataclasses.asdict(opts)),
            "train": {**dataclasses.asdict(cfg), "windows_available": int(windows.shape[0]),
                      "trainable_params": sum(p.numel() for p in params),
                      "steps": report.steps, "resumed_from": report.resumed_from, "tokens": report.tokens,
                      "seconds": report.seconds,
                      "tokens_per_s": report.tokens / report.seconds if report.seconds > 0 else None,
                      "loss_first10": sum(head) / len(head), "loss_last10": sum(tail) / len(tail),
                      "losses": report.losses},
            "save_seconds": save_seconds, "before": before, "after": after,
            "threads": torch.get_num_threads()}


def _jsonable(d: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}
