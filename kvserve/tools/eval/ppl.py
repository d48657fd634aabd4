"""`kvserve eval ppl`: perplexity over non-overlapping windows, and KL divergence to a reference.

Protocol: the text (default WikiText-2 raw test) is
tokenized once without special tokens; it is cut into non-overlapping windows of `seqlen` tokens;
each window is one independent forward pass (no KV cache, no context carried over) and every
position predicts the next token of its window; PPL = exp(mean NLL) over all scored tokens.

BOS convention: for a model that starts its inputs with BOS (Gemma), every window is BOS +
(seqlen - 1) text tokens and all seqlen - 1 text tokens are scored, so each text token of the
stream (except a short tail) is scored exactly once. Without BOS (`bos=False` / `--no-bos`, or a
model without one), a window is seqlen text tokens and tokens 2..seqlen of it are scored. Either
way a window scores seqlen - 1 tokens. Numbers with and without BOS differ a lot (~3x on Gemma 3)
and must not be mixed.

KL: with a reference model, both models run on the same windows in the same pass and the mean over
scored positions of KL(P_ref || P_model) of the next-token distributions is reported (nats), with
the reference's own PPL and how often the two agree on the top-1 token.

The windows run in batches through the model's own layers with a custom attention
(`AttentionMetadata.custom`, as kvserve/model/streaming.py does for StreamingLLM): RoPE at
positions 0..seqlen-1 of each window and causal (plus sliding-window) attention per window, one
batched SDPA call per layer. Logits are formed a chunk of rows at a time (Gemma's vocabulary is
262144, so a whole batch of fp32 logits would take gigabytes).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvserve.compress.quant import QuantSpec, model_weight_bytes, quantize_model
from kvserve.loading import load_model
from kvserve.model.base import CausalLM
from kvserve.tools.eval.stream import default_data_path
from kvserve.tools.eval.windows import make_windows, tokenize_file, window_hidden

DATASETS = ("wikitext2",)


@dataclass(frozen=True)
class PplConfig:
    """Validated settings; messages name the CLI flags."""

    seqlen: int = 512
    max_windows: int | None = None
    batch_size: int = 4
    logits_chunk: int = 128
    bos: bool = True
    dataset: str = "wikitext2"

    def __post_init__(self) -> None:
        if self.seqlen < 2:
            raise ValueError(f"--seqlen must be >= 2 (a window scores seqlen - 1 tokens), got {self.seqlen}")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"--max-windows must be >= 1, got {self.max_windows}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.logits_chunk < 1:
            raise ValueError(f"--logits-chunk must be >= 1, got {self.logits_chunk}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")


# --- data --------------------------------------------------------------------------------------

def dataset_path(dataset: str = "wikitext2") -> Path:
    """The default file of a dataset: WikiText-2's raw test split under $KVSERVE_DATA."""
    if dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    return default_data_path("--text-file")


# --- scoring -----------------------------------------------------------------------------------

@dataclass
class PplResult:
    """Perplexity over `num_windows` windows of `seqlen` tokens (`num_tokens` scored)."""

    ppl: float
    mean_nll: float
    num_windows: int
    num_tokens: int
    seqlen: int
    bos: bool
    seconds: float
    window_nll: list[float] = field(default_factory=list)  # mean NLL per window
    # With a reference model (same windows, same pass):
    ref_ppl: float | None = None
    kl_mean: float | None = None  # mean over scored tokens of KL(P_ref || P_model), nats
    kl_max: float | None = None  # the largest per-token KL
    top1_agree: float | None = None  # fraction of positions where the argmax tokens agree

    def to_dict(self) -> dict:
        return asdict(self)


def _log_probs(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [n, hidden] -> log-softmax of the logits [n, vocab] fp32."""
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def evaluate(model: CausalLM, token_ids: torch.Tensor, seqlen: int, *, reference: CausalLM | None = None,
             bos_token_id: int | None = None, max_windows: int | None = None, batch_size: int = 4,
             logits_chunk: int = 128, progress: bool = True) -> PplResult:
    """PPL of `model` (and, with `reference`, KL to it) on token_ids [N] (text tokens only).

    model / reference: CausalLM (kvserve.model.base) with the same vocabulary. See the module
    docstring for windows and the BOS convention.
    """
    cfg = PplConfig(seqlen=seqlen, max_windows=max_windows, batch_size=batch_size, logits_chunk=logits_chunk)
    windows = make_windows(token_ids, cfg.seqlen, bos_token_id, cfg.max_windows)
    w, l = windows.shape
    if reference is not None and reference.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"--kl-to: the reference's vocabulary ({reference.config.vocab_size}) differs from the "
                         f"model's ({model.config.vocab_size})")
    nll_sum = torch.zeros(w, dtype=torch.float64)
    ref_nll_sum = torch.zeros(w, dtype=torch.float64)
    kl_sum, kl_max, agree = 0.0, 0.0, 0
    t0 = time.perf_counter()
    with torch.inference_mode(), tqdm(total=w * (l - 1), desc=f"ppl seqlen {l}", unit="tok",
                                      disable=not progress) as bar:
        for a in range(0, w, cfg.batch_size):
            batch = windows[a:a + cfg.batch_size]
            nb = batch.shape[0]
            rows = window_hidden(model, batch)[:, :-1].reshape(nb * (l - 1), -1)
            ref_rows = None if reference is None else window_hidden(reference, batch)[:, :-1].reshape(nb * (l - 1), -1)
            targets = batch[:, 1:].reshape(-1)
            owner = torch.arange(nb).repeat_interleave(l - 1)  # window of each scored row
            for c in range(0, rows.shape[0], cfg.logits_chunk):
                sl = slice(c, c + cfg.logits_chunk)
                lp = _log_probs(model, rows[sl])
                tgt = targets[sl, None]
                nll_sum.index_add_(0, owner[sl] + a, -lp.gather(1, tgt)[:, 0].double())
                if ref_rows is not None:
                    lq = _log_probs(reference, ref_rows[sl])
                    ref_nll_sum.index_add_(0, owner[sl] + a, -lq.gather(1, tgt)[:, 0].double())
                    kl = (lq.exp() * (lq - lp)).sum(-1)  # KL(ref || model) per position
                    kl_sum += float(kl.double().sum())
                    kl_max = max(kl_max, float(kl.max()))
                    agree += int((lq.argmax(-1) == lp.argmax(-1)).sum())
                    del lq
                del lp
            bar.update(nb * (l - 1))
    n_tok = w * (l - 1)
    mean_nll = float(nll_sum.sum()) / n_tok
    result = PplResult(ppl=math.exp(mean_nll), mean_nll=mean_nll, num_windows=w, num_tokens=n_tok, seqlen=l,
                       bos=bos_token_id is not None, seconds=time.perf_counter() - t0,
                       window_nll=[float(x) / (l - 1) for x in nll_sum])
    if reference is not None:
        result.ref_ppl = math.exp(float(ref_nll_sum.sum()) / n_tok)
        result.kl_mean = kl_sum / n_tok
        result.kl_max = kl_max
        result.top1_agree = agree / n_tok
    return result


def perplexity(model: CausalLM, token_ids: torch.Tensor, seqlen: int, *, bos_token_id: int | None = None,
               max_windows: int | None = None, batch_size: int = 4, progress: bool = True) -> PplResult:
    """exp(mean NLL) of `model` over non-overlapping windows of token_ids [N] (see `evaluate`)."""
    return evaluate(model, token_ids, seqlen, bos_token_id=bos_token_id, max_windows=max_windows,
                    batch_size=batch_size, progress=progress)


def kl_divergence(model: CausalLM, reference: CausalLM, token_ids: torch.Tensor, seqlen: int, *,
                  bos_token_id: int | None = None, max_windows: int | None = None, batch_size: int = 4,
                  progress: bool = True) -> PplResult:
    """Mean KL(P_reference || P_model) of the next-token distributions over the same windows, in
    the same pass (result.kl_mean, nats), with both perplexities (see `evaluate`)."""
    return evaluate(model, token_ids, seqlen, reference=reference, bos_token_id=bos_token_id,
                    max_windows=max_windows, batch_size=batch_size, progress=progress)


# --- CLI ---------------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    model_arg = args.model_path or args.model
    cfg = PplConfig(seqlen=args.seqlen, max_windows=args.max_windows, batch_size=args.batch_size,
                    bos=not args.no_bos, dataset=args.dataset)
    path = Path(args.text_file).expanduser() if args.text_file else dataset_path(cfg.dataset)
    if not path.is_file():  # before the (slow) model load
        flag = "--text-file" if args.text_file else f"--dataset {cfg.dataset}"
        raise ValueError(f"{flag}: {path} not found (pass --text-file PATH or set KVSERVE_DATA)")
    if args.quant != "none":  # validate before loading
        try:
            QuantSpec(bits=args.bits, sym=args.sym, granularity=args.granularity, group_size=args.group_size)
        except ValueError as e:
            raise ValueError(f"--quant {args.quant}: {e} (flags --bits, --granularity, --group-size)") from None
    loaded = load_model(model_arg, dtype=args.dtype)
    reference, ref_label = None, None
    if args.kl_to == "baseline":
        ref_label = f"{loaded.source.name} float32 unquantized"
        same = str(next(loaded.model.parameters()).dtype) == "torch.float32"
        reference = loaded.model if same else load_model(model_arg, dtype="float32").model
    elif args.kl_to:
        ref_label = args.kl_to
        reference = load_model(args.kl_to, dtype="float32").model
    model, quant = loaded.model, None
    if args.quant != "none":
        # A copy (sharing the embedding table, which stays in floating point): the loaded model
        # may be the float32 reference, or a caller's.
        emb = getattr(model.embed_tokens, "weight", None)
        model = copy.deepcopy(model, memo={} if emb is None else {id(emb): emb})
        quant = quantize_model(model, args.quant, bits=args.bits, group_size=args.group_size, sym=args.sym,
                               granularity=args.granularity, lm_head=args.quant_lm_head,
                               embedding=args.quant_embedding).to_dict()
    tokens = tokenize_file(loaded.tokenizer, path)
    bos = loaded.config.bos_token_id if cfg.bos and loaded.config.add_bos_token else None
    result = evaluate(model, tokens, cfg.seqlen, reference=reference, bos_token_id=bos,
                      max_windows=cfg.max_windows, batch_size=cfg.batch_size)
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    label = dtype + ("" if quant is None else f" + {args.quant} {quant['label']}")
    print(f"{loaded.source.name} ({label}) on {path.name}: {result.num_windows} windows x {result.seqlen} tokens "
          f"({'BOS + ' + str(result.seqlen - 1) + ' text tokens' if result.bos else 'no BOS'}), "
          f"{result.num_tokens} tokens scored, {result.seconds:.1f} s")
    head = ["PPL", "mean NLL"]
    if reference is not None:
        head += ["ref PPL", "KL(ref||model)", "KL max", "top-1 agree"]
    cells = [f"{result.ppl:.3f}", f"{result.mean_nll:.4f}"]
    if reference is not None:
        cells += [f"{result.ref_ppl:.3f}", f"{result.kl_mean:.5f}", f"{result.kl_max:.3f}", f"{result.top1_agree:.2%}"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n| " + " | ".join(cells) + " |")
    if args.json:
        doc = {"model": str(loaded.source), "dtype": dtype, "data": str(path), "quant": quant,
               "weight_bytes": model_weight_bytes(model), "reference": ref_label,
               "threads": torch.get_num_threads(), **result.to_dict()}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0
