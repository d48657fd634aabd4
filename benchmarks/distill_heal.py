"""Heal a depth-pruned Gemma 3 270M by logit distillation from the unpruned model.

The student is the bundled Gemma with decoder blocks --drop removed (edited in memory, written
with save_model and read back so the block indices are renumbered); it is trained with
kvserve.compress.train.distill (the code behind `kvserve distill`) on WikiText-2 wiki.valid.tokens and
evaluated on WikiText-2 raw test (seqlen 512, --eval-windows windows, BOS first) before and after,
with its KL to the teacher and top-1 agreement in the same pass.

    OMP_NUM_THREADS=1 python benchmarks/distill_heal.py --steps 200 --batch-size 4 --seqlen 256
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from kvserve.compress.train.distill import (
    CHECKPOINT,
    DistillOptions,
    _evaluate,
    distill,
)
from kvserve.loading import load_model
from kvserve.loading.save import save_model


def drop_blocks(loaded, drop: list[int]):
    """A LoadedModel without decoder blocks `drop` (config updated); call on a fresh load."""
    cfg = loaded.config
    keep = [i for i in range(cfg.num_layers) if i not in set(drop)]
    model = loaded.model
    model.layers = torch.nn.ModuleList(model.layers[i] for i in keep)
    new_cfg = dataclasses.replace(cfg, num_layers=len(keep), layer_types=[cfg.layer_types[i] for i in keep])
    model.config = new_cfg
    return dataclasses.replace(loaded, model=model, config=new_cfg)


def eval_checkpoint(teacher, student, ckpt: Path, args) -> None:
    """PPL / KL of the student with the parameters of checkpoint `ckpt` (written by kvserve.compress.train.loop)."""
    from kvserve.tools.eval.ppl import dataset_path, tokenize_file

    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    params = dict(student.model.named_parameters())
    with torch.no_grad():
        for name, t in state["params"].items():
            params[name].copy_(t)
    ids = tokenize_file(student.tokenizer, dataset_path())
    t0 = time.perf_counter()
    after = _evaluate(student, teacher, ids, DistillOptions(eval_windows=args.eval_windows), progress=False)
    losses = state["losses"]
    info = {"checkpoint": str(ckpt), "step": state["step"], "config": state["config"], "after": after,
            "tokens": state["step"] * state["config"]["batch_size"] * args.seqlen, "losses": losses,
            "loss_first5": sum(losses[:5]) / 5, "loss_last5": sum(losses[-5:]) / 5,
            "eval_seconds": time.perf_counter() - t0, "dropped_blocks": args.drop,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "losses"}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drop", default="10,11", help="comma list of block indices to remove")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--eval-windows", type=int, default=20)
    ap.add_argument("--work", default="/tmp/distill_heal", help="folder for the pruned and healed students")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "distill_heal.json"))
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--chunk-rows", type=int, default=64, help="logit rows at a time (memory: the machine is shared)")
    ap.add_argument("--skip-before", action="store_true",
                    help="evaluate only after training (the pruned student's numbers are deterministic: reuse them)")
    ap.add_argument("--eval-checkpoint", action="store_true",
                    help="only evaluate the student in the run's checkpoint (a run stopped early for time)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = Path(args.work)
    drop = [int(x) for x in args.drop.split(",") if x.strip()]
    teacher = load_model()
    pruned_dir = work / "pruned"
    if not (pruned_dir / "model.safetensors").is_file():
        save_model(drop_blocks(load_model(), drop), pruned_dir)
    student = load_model(pruned_dir)
    if args.eval_checkpoint:
        return eval_checkpoint(teacher, student, work / "healed" / CHECKPOINT, args)
    opts = DistillOptions(seqlen=args.seqlen, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                          temperature=args.temperature, alpha=args.alpha,
                          eval_windows=0 if args.skip_before else args.eval_windows, chunk_rows=args.chunk_rows,
                          checkpoint_every=10, resume=args.resume, log_every=5)
    t0 = time.perf_counter()
    info = distill(teacher, student, work / "healed", opts, progress=False)
    if args.skip_before and args.eval_windows:
        from kvserve.compress.train.distill import _evaluate
        from kvserve.tools.eval.ppl import dataset_path, tokenize_file

        ids = tokenize_file(student.tokenizer, dataset_path())
        info["after"] = _evaluate(student, teacher, ids, dataclasses.replace(opts, eval_windows=args.eval_windows),
                                  progress=False)
    info["wall_seconds"] = time.perf_counter() - t0
    info["dropped_blocks"] = drop
    info["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(info, indent=1))
    info["skip_before"] = args.skip_before
    b, a, tr = info["before"], info["after"], info["train"]
    print(json.dumps({"before": b, "after": a, "steps": tr["steps"], "tokens": tr["tokens"],
                      "train_minutes": tr["seconds"] / 60, "tok_per_s": tr["tokens_per_s"],
                      "loss_first10": tr["loss_first10"], "loss_last10": tr["loss_last10"]}, indent=1))


if __name__ == "__main__":
    main()
