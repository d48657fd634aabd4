"""`kvserve distill --student S [--teacher T] --out DIR ...`: heal a (pruned) student by logit
distillation from a teacher on a text file, CPU-friendly (short, checkpointed, resumable runs);
prints the perplexity before / after on WikiText-2 test and saves the student folder."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_distill_parser(sub) -> None:
    """Register `kvserve distill` on the top-level subparsers `sub`."""
    p = sub.add_parser("distill", help="train a student on a teacher's logits (heal a pruned model)")
    p.add_argument("--teacher", default=None, help="GGUF file or HF folder (default: bundled Gemma 3 270M)")
    p.add_argument("--student", required=True, help="GGUF file or HF folder with the teacher's vocabulary")
    p.add_argument("--out", required=True, help="output folder: the trained student (+ checkpoint while unfinished)")
    p.add_argument("--text-file", default=None, help="training text (default: WikiText-2 wiki.valid.tokens)")
    p.add_argument("--seqlen", type=int, default=256, help="tokens per training window, BOS included")
    p.add_argument("--batch-size", type=int, default=4, help="windows per step")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    n.add_argument("--tokens", type=int, default=None, help="training tokens instead of --steps")
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default: 5%% of the steps)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0 = off)")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"],
                   help="learning rate after warmup")
    p.add_argument("--temperature", type=float, default=2.0, help="tau: softmax temperature of the KL term")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the KL term; 1 - alpha weighs the CE")
    p.add_argument("--train-embeddings", action="store_true",
                   help="also train the token embedding / LM head (frozen by default: on CPU their gradient and "
                        "Adam state dominate the cost)")
    p.add_argument("--max-windows", type=int, default=None, help="train on a random subset of the windows")
    p.add_argument("--seed", type=int, default=0, help="window shuffle seed")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (0 = at the end)")
    p.add_argument("--resume", action="store_true", help="continue the unfinished run checkpointed in --out")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the checkpoint after the student is saved")
    p.add_argument("--eval-windows", type=int, default=20,
                   help="WikiText-2 test windows for the PPL before / after (0 = skip)")
    p.add_argument("--eval-seqlen", type=int, default=512, help="tokens per evaluation window")
    p.add_argument("--eval-file", default=None, help="evaluation text (default: WikiText-2 wiki.test.raw)")
    p.add_argument("--chunk-rows", type=int, default=128, help="rows of logits formed at a time")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines (0 = none)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", default=None, help="write the report here")


def options_from_args(args: argparse.Namespace):
    from kvserve.compress.train.distill import DistillOptions

    path = lambda v: Path(v).expanduser() if v else None  # noqa: E731
    return DistillOptions(seqlen=args.seqlen, batch_size=args.batch_size, steps=args.steps, tokens=args.tokens,
                          lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                          grad_clip=args.grad_clip, schedule=args.schedule, temperature=args.temperature,
                          alpha=args.alpha, train_embeddings=args.train_embeddings, text_file=path(args.text_file),
                          max_windows=args.max_windows, seed=args.seed, checkpoint_every=args.checkpoint_every,
                          resume=args.resume, keep_checkpoint=args.keep_checkpoint, eval_windows=args.eval_windows,
                          eval_seqlen=args.eval_seqlen, eval_file=path(args.eval_file), chunk_rows=args.chunk_rows,
                          log_every=args.log_every)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvserve.compress.train.distill import distill
    from kvserve.loading import load_model

    opts = options_from_args(args)  # validate before the (slow) model loads
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    teacher = load_model(args.teacher)
    student = load_model(args.student)
    info = distill(teacher, student, args.out, opts, progress=not args.no_progress)
    tr = info["train"]
    print(f"distilled {Path(info['teacher']).name} -> {Path(info['student']).name}: {tr['steps']} steps "
          f"({tr['tokens']} tokens this run, {tr['seconds']:.1f} s, {tr['tokens_per_s'] or 0:.0f} tok/s), "
          f"loss {tr['loss_first10']:.4f} -> {tr['loss_last10']:.4f}; saved to {info['out']}")
    if info["before"] and info["after"]:
        b, a = info["before"], info["after"]
        print(f"WikiText-2 test, {a['windows']} x {a['seqlen']} tokens (teacher PPL {a['teacher_ppl']:.3f}):")
        print("| | PPL | KL(teacher||student) | top-1 agree |\n|---|---|---|---|")
        for name, r in (("before", b), ("after", a)):
            print(f"| {name} | {r['ppl']:.3f} | {r['kl_to_teacher']:.4f} | {r['top1_agree']:.2%} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1))
    return 0
