"""SpeculativeDecoder: the engine's speculative decoding, one object the step calls.

It builds the drafter chosen by EngineConfig.speculative (n-gram lookup, a separate draft model,
or the target as its own draft) with the draft's KV pool and runner, decides how many draft
tokens each sequence may be verified with, proposes them before the target's pass and accepts
them after it (rejection sampling, or the argmax for plain greedy rows), and counts the drafts.
It holds no requests: the engine appends the accepted tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve import kernels
from kvserve.accel.prepare import prepare_model
from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from kvserve.engine.step_batch import draft_requests, sampling_request
from kvserve.loading import LoadedModel, load_model
from kvserve.loading.loader import build_model, resolve_dtype
from kvserve.model.attention import KVCache
from kvserve.model.config import LayerGroup
from kvserve.sampling import Sampler
from kvserve.sampling.sampler import SamplerOutput, apply_penalties
from kvserve.sampling.structured import GrammarState
from kvserve.sequence import Sequence
from kvserve.speculative.draft_vocab import DraftVocabHead, read_draft_vocab
from kvserve.speculative.proposers import Draft, Drafter, ModelDrafter, NgramDrafter
from kvserve.speculative.rejection import accept_greedy, rejection_sample
from kvserve.weights.half import HALF_DTYPES
from kvserve.weights.linear import QuantLinear
from kvserve.weights.quantize import rtn_quantize_model

log = logging.getLogger(__name__)

# (sequence, tokens to append, their logprobs or None): what a verification accepted.
Verified = tuple[Sequence, list[int], SamplerOutput | None]


@dataclass
class DraftTarget:
    """What a draft is built against: the target model, its runner (an early-exit draft runs on
    it) and its KV pool, whose block tables and layer groups a separate draft pool shares."""

    loaded: LoadedModel
    runner: ModelRunner
    kv_cache: KVCache
    layer_groups: list[LayerGroup]


class SpeculativeDecoder:
    """Drafter, draft runner and counters; with speculation off, a decoder that never drafts."""

    def __init__(self, cfg: EngineConfig, target: DraftTarget):
        self.config = cfg
        self.draft_runner: ModelRunner | None = None  # set when the draft has a KV pool of its own
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.vocab_size = target.loaded.model.config.vocab_size
        self.draft_vocab: torch.Tensor | None = None  # [N] token ids a draft's head scores (draft_vocab)
        self.drafter: Drafter | None = self._make_drafter(target)

    # ---------------------------------------------------------------- construction
    def _make_drafter(self, target: DraftTarget) -> Drafter | None:
        """The proposer chosen by config.speculative (None when off)."""
        spec, mc = self.config.speculative_config, target.loaded.model.config
        if spec.speculative is None:
            return None
        # (A bad file fails before a draft copy is built.)
        self.draft_vocab = None if spec.draft_vocab is None else read_draft_vocab(
            spec.draft_vocab, mc.vocab_size, spec.draft_vocab_size)
        if spec.speculative == "ngram":
            return NgramDrafter(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
        if spec.speculative == "self":
            return self._make_self_drafter(target)
        draft = load_model(spec.speculative_model, self.config.dtype, self.config.device,
                           allow_download=self.config.allow_download).model
        if draft.config.vocab_size != mc.vocab_size:
            raise ValueError(f"speculative_model {spec.speculative_model!r} has a vocabulary of "
                             f"{draft.config.vocab_size} tokens; the target has {mc.vocab_size}: a draft must "
                             "share the tokenizer")
        return self._separate_drafter(target, draft, draft.config.num_layers, f"draft model {spec.speculative_model}")

    def _make_self_drafter(self, target: DraftTarget) -> ModelDrafter:
        """The target as its own draft: a lower-precision copy of its weights (default bf16 for
        an fp32 target; `self_draft_bits` 4 / 8: an RTN-quantized copy), and/or an early exit
        after its first `self_draft_layers` layers."""
        spec, model = self.config.speculative_config, target.loaded.model
        mc = model.config
        target_dtype = next(model.parameters()).dtype
        bits = spec.self_draft_bits
        low_bit = self.config.weights_config.low_bit  # (no float weights to copy: the target's own layers)
        dtype = resolve_dtype(spec.self_draft_dtype) if spec.self_draft_dtype else (
            torch.bfloat16 if target_dtype == torch.float32 and not bits and not low_bit else target_dtype)
        copy = dtype != target_dtype or bits is not None
        layers = spec.self_draft_layers or (mc.num_layers if copy else max(1, mc.num_layers // 3))
        # (All the target's layers without a copy: a draft only through a smaller head.)
        if layers > mc.num_layers or (layers == mc.num_layers and not copy and spec.draft_vocab is None):
            raise ValueError(f"self_draft_layers must be below the model's {mc.num_layers} layers (or give a "
                             f"self_draft_dtype other than the target's, or a draft_vocab), got {layers}")
        exit_at = layers if layers < mc.num_layers else None
        if not copy:  # early exit on the target itself: its K/V for those layers are the draft's
            log.info("self-speculative draft: the target's first %d of %d layers", layers, mc.num_layers)
            return ModelDrafter(target.runner, num_layers=exit_at, eos_token_ids=target.loaded.tokenizer.eos_token_ids,
                                head=self._vocab_head(model))
        draft, what = self._copy(model, dtype, bits, target.loaded.source), f"{dtype}"
        if bits:
            # (A draft_vocab head takes its rows from the float copy: the full head is never run.)
            rtn_quantize_model(draft, bits, 128, granularity="group" if bits == 4 else "channel", sym=bits == 8,
                               lm_head=spec.draft_vocab is None, progress=False)
            what = f"RTN int{bits} of {dtype}" + (", LM head included" if spec.draft_vocab is None else "")
        return self._separate_drafter(target, draft, layers,
                                      f"self draft ({what}, {layers} of {mc.num_layers} layers)", exit_at)

    def _copy(self, model: torch.nn.Module, dtype: torch.dtype, bits: int | None, source: Path) -> torch.nn.Module:
        """The target's weights in `dtype`. A 16-bit copy of an fp32 target on the CPU keeps fp32
        arithmetic (kvserve/weights/half.py): its steps then run as one C call (the decode plan),
        where oneDNN's 16-bit matmuls stream a decode step's weights at a third of the rate."""
        sd, device = model.state_dict(), self.config.device
        if (dtype in HALF_DTYPES and next(model.parameters()).dtype == torch.float32 and bits is None
                and torch.device(device).type == "cpu" and not model.config.mla):  # (MLA reads kv_b_proj itself)
            halves = {k: v.to(dtype) if v.dim() == 2 else v for k, v in sd.items()}  # (linears, embedding)
            return build_model(model.config, halves, torch.float32, device, source, keep_16bit=True)
        return build_model(model.config, sd, dtype, device, source)

    def _separate_drafter(self, target: DraftTarget, draft: torch.nn.Module, num_layers: int, what: str,
                          exit_at: int | None = None) -> ModelDrafter:
        """A drafter with its own KV pool (num_layers layers) addressed by the target's block tables."""
        dc, cfg, target_cache = draft.config, self.config, target.kv_cache
        kv_dtype = next(draft.parameters()).dtype
        heads, k_dim, v_dim = dc.kv_cache_layout
        if target_cache.num_groups > 1:  # the self draft: the target's layers, so its layer groups too
            cache = KVCache(dc.num_layers, target_cache.num_slots, heads, k_dim, kv_dtype, cfg.device,
                            layer_groups=[g.layers for g in target.layer_groups], v_head_dim=v_dim,
                            kv_source=dc.kv_source)
        else:
            cache = KVCache(num_layers, target_cache.num_slots, heads, k_dim, kv_dtype, cfg.device,
                            v_head_dim=v_dim, kv_source=dc.kv_source)
        log.info("%s: its own KV pool %.2f GiB (same block tables as the target)", what, cache.nbytes / 2**30)
        low_bit = any(isinstance(m, QuantLinear) for m in draft.modules())  # (RTN copy, quantized checkpoint)
        prepare_model(draft, cfg.device, pack=cfg.weights_config.pack_weights, low_bit=low_bit, fuse_cuda=False,
                      what="draft")
        self.draft_runner = ModelRunner(draft, cache, cfg.block_size, cfg.device)
        return ModelDrafter(self.draft_runner, num_layers=exit_at, separate_cache=True,
                            eos_token_ids=target.loaded.tokenizer.eos_token_ids, head=self._vocab_head(draft))

    def _vocab_head(self, draft: torch.nn.Module) -> DraftVocabHead | None:
        """The draft's head over the `draft_vocab` subset, in its hidden states' dtype (None: none asked)."""
        if self.draft_vocab is None:
            return None
        head = DraftVocabHead(draft, self.draft_vocab, draft.norm.weight.dtype)
        log.info("draft head: %d of %d tokens (%s)", len(self.draft_vocab), draft.config.vocab_size,
                 self.config.speculative_config.draft_vocab)
        return head

    # ---------------------------------------------------------------- per sequence
    def attach(self, seqs: list[Sequence]) -> None:
        """A new request's samples: with a separate draft pool, each one's draft cache starts empty
        (a prefix hit fills it)."""
        for s in seqs:
            if self.draft_runner is not None:
                s.num_draft_computed = 0

    def budget(self, seq: Sequence, max_model_len: int) -> int:
        """Draft tokens seq may be verified with next step: never more than it may still emit.
        (Penalties, a bias, min_tokens and a grammar apply at each verified position, after the
        drafts before it.)"""
        if self.drafter is None or seq.reasoning_grammar is not None:
            return 0  # (drafts past </think> would be verified without the grammar's mask)
        return seq.lookahead_limit(self._draft_length(seq), max_model_len)

    def _draft_length(self, seq: Sequence) -> int:
        """seq's own k under the heuristic schedule, once adjusted; else num_speculative_tokens."""
        return self.config.speculative_config.num_speculative_tokens if seq.spec_k is None else seq.spec_k

    # ---------------------------------------------------------------- per step
    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """The draft pool shares the target's block tables, so its copy-on-write copies too."""
        if self.draft_runner is not None:
            self.draft_runner.copy_blocks(block_copies, self.config.block_size)

    def propose(self, sched: SchedulerOutput) -> dict[int, Draft]:
        """Draft tokens for the scheduled decodes with reserved slots, keyed by id(item); shrinks
        each item to what was proposed (a constrained sequence's draft with its masks,
        `under_grammar`)."""
        items = [it for it in sched.scheduled if it.num_spec]
        if not items:
            return {}
        drafts = self.drafter.propose([it.seq for it in items], [it.num_spec for it in items])
        out = {}
        for it, d in zip(items, drafts):
            d.truncate(it.num_spec)
            if it.seq.grammar is not None:
                under_grammar(d, it.seq.grammar, self.vocab_size)
            it.num_spec = len(d.token_ids)
            it.num_tokens = 1 + it.num_spec
            out[id(it)] = d
        return out

    def verify(self, logits: torch.Tensor, spec: list[tuple[ScheduledSeq, int]], drafts: dict[int, Draft],
               sampler: Sampler) -> list[Verified]:
        """Rejection-sample the drafted items (`spec`: each with its first logits row)."""
        if not spec:
            return []
        items = [it for it, _ in spec]
        rows = torch.cat([torch.arange(r, r + it.num_logits) for it, r in spec]).to(logits.device)
        target = logits[rows]
        ds = [drafts[id(it)] for it in items]
        scored = _processed_rows(target, items, ds, sampler.eos_token_ids)  # target stays raw, for logprobs
        res = rejection_sample(scored, [d.token_ids for d in ds], [d.probs for d in ds],
                               [it.seq.params for it in items], [it.seq.generator for it in items])
        out, offset = [], 0
        for it, tokens, accepted in zip(items, res.token_ids, res.num_accepted):
            self._count_accepted(it, accepted)
            rows_i = target[offset: offset + len(tokens)]
            offset += it.num_logits
            req = [sampling_request(it.seq)] * len(tokens)
            lps = sampler.token_logprobs(rows_i, torch.tensor(tokens, device=target.device), req)
            out.append((it.seq, tokens, lps))
        return out

    def verify_argmax(self, picked: list[int], spec: list[tuple[ScheduledSeq, int]],
                      drafts: dict[int, Draft]) -> list[Verified]:
        """Plain greedy drafts verified from the step's argmax tokens (`picked`, one per logit
        row: the model's greedy screen, no logits): the same tokens as `verify`, no logprobs."""
        out = []
        for it, row in spec:
            tokens = accept_greedy(drafts[id(it)].token_ids, picked[row : row + it.num_logits])
            self._count_accepted(it, len(tokens) - 1)
            out.append((it.seq, tokens, None))
        return out

    def argmax_masks(self, spec: list[tuple[ScheduledSeq, int]], drafts: dict[int, Draft]
                     ) -> list[tuple[int, torch.Tensor]]:
        """(first row, masks) of each drafted item under a grammar: its positions' allowed tokens
        for a greedy verification through the screen (`ModelRunner.execute_greedy`)."""
        return [(row, d.allowed) for it, row in spec if (d := drafts[id(it)]).allowed is not None]

    @staticmethod
    def trim_draft_caches(spec: list[tuple[ScheduledSeq, int]]) -> None:
        """After the scheduler's update: draft K/V past the accepted tokens is stale."""
        for item, _ in spec:
            seq = item.seq
            if seq.num_draft_computed is not None:
                seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)

    def _count_accepted(self, item: ScheduledSeq, accepted: int) -> None:
        item.num_rejected = item.num_spec - accepted
        st = self.stats
        st["num_drafts"] += 1
        st["num_draft_tokens"] += item.num_spec
        st["num_accepted_tokens"] += accepted
        spec = self.config.speculative_config
        if spec.num_speculative_tokens_schedule == "heuristic":
            item.seq.spec_k = next_draft_length(self._draft_length(item.seq), item.num_spec, accepted,
                                                spec.num_speculative_tokens)


def next_draft_length(k: int, drafted: int, accepted: int, max_k: int) -> int:
    """HF transformers' heuristic draft length: 2 more after a step that kept every draft (a
    longer draft would likely have paid), 1 fewer after one that rejected any (the verification's
    extra rows were partly wasted); between 1 and max_k. A step that proposed nothing (no n-gram
    match) says nothing about the drafts, and leaves k."""
    if drafted == 0:
        return k
    return min(max_k, k + 2) if accepted == drafted else max(1, k - 1)


def under_grammar(draft: Draft, grammar: GrammarState, vocab_size: int) -> None:
    """Give a constrained sequence's draft its positions' masks (`Draft.allowed`); a point-mass
    draft stops before its first token the grammar forbids (it could not be kept, and the row it
    would be verified on samples from the masked distribution either way: the residual of a point
    mass on a token of probability 0 is p). A sampled draft is not cut: its residual is not p."""
    draft.allowed, valid = grammar.draft_masks(draft.token_ids, vocab_size)
    if draft.probs is None and valid < len(draft.token_ids):
        del draft.token_ids[valid:]
        draft.allowed = draft.allowed[:valid + 1]


def _processed_rows(target: torch.Tensor, items: list[ScheduledSeq], drafts: list[Draft],
                   eos_token_ids: list[int]) -> torch.Tensor:
    """target [sum(k_i + 1), V] (the drafted items' rows, gathered from the step's logits) with
    each row processed as the sampler would process its position, the drafts before it counting as
    output: bias, min_tokens and penalties, then the grammar's mask. The raw rows stay as they are
    when a row reports logprobs (they are the raw logits'). As in the sampler, a row min_tokens
    leaves with no token (it bans the EOS a complete grammar allows alone) takes the grammar's mask
    over its raw logits."""
    requests = [r for it, d in zip(items, drafts) for r in draft_requests(it.seq, d.token_ids)]
    scored = apply_penalties(target, requests, eos_token_ids)  # a copy where any row changes
    rows, masks, off = [], [], 0
    for it, d in zip(items, drafts):
        if d.allowed is not None:
            rows += range(off, off + it.num_logits)
            masks.append(d.allowed)
        off += it.num_logits
    if not rows:
        return scored
    if scored is target and any(d.allowed is not None and it.seq.params.logprobs is not None
                                for it, d in zip(items, drafts)):
        scored = target.clone()
    bitmask = torch.full((target.shape[0], masks[0].shape[1]), -1, dtype=torch.int32)
    bitmask[rows] = torch.cat(masks)
    kernels.apply_token_bitmask(scored, bitmask, rows)
    if scored is not target:
        idx = torch.tensor(rows, device=target.device)
        dead = idx[scored[idx].amax(dim=1) == float("-inf")].tolist()
        if dead:
            fresh = target[dead].clone()
            kernels.apply_token_bitmask(fresh, bitmask[dead].contiguous(), list(range(len(dead))))
            scored[dead] = fresh
    return scored
