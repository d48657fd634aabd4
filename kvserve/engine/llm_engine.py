"""LLMEngine: add_request / step / abort. The one place that owns a clock.

Each step: the scheduler picks sequences and token counts within the budget, the model runner
runs them as one flat batch, the sampler picks next tokens, the detokenizer and stop checker
turn them into text and finish sequences, and the scheduler frees what finished.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid

import torch

from kvserve.config import EngineConfig
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.metrics import RequestMetrics
from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.engine.output_processor import OutputProcessor, RequestState
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.kernels.host_memory import keep_freed_memory
from kvserve.loading import LoadedModel, load_model
from kvserve.loading.loader import build_model, resolve_dtype
from kvserve.model.attention import KVCache
from kvserve.model.config import LayerGroup, kv_layer_groups
from kvserve.model.fused_linear import fuse_linear_projections
from kvserve.model.panels import use_panel_kernels
from kvserve.model.streaming import StreamPolicy, layer_policies
from kvserve.sampling import Sampler, SamplingRequest
from kvserve.sampling.sampler import penalizes as _needs_penalties
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence, SequenceStatus
from kvserve.spec.proposers import Draft, ModelDrafter, NgramDrafter
from kvserve.spec.rejection import accept_greedy, rejection_sample

log = logging.getLogger(__name__)
# StreamingLLM's default context cap: a position is only a stream index there (the model sees
# ranks in its bounded cache), so this bounds bookkeeping, not memory. --max-model-len changes it.
STREAMING_MAX_MODEL_LEN = 1 << 20

_FINISH = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config or EngineConfig()
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if torch.device(cfg.device).type == "cpu":
            keep_freed_memory()  # no page faults on each step's large temporaries
        self.loaded = self._low_bit_weights(loaded or load_model(cfg.model, cfg.dtype, cfg.device),
                                            owned=loaded is None)
        self._pack_weights(self.loaded.model, "model", head_only=cfg.compile)
        self._fuse_cuda_projections(self.loaded.model)
        self.model_config = mc = self.loaded.model.config
        self.tokenizer = self.loaded.tokenizer
        self._check_mla()
        self._check_cla()
        self.stream_policies = self._stream_policies()
        self.max_model_len = self._max_model_len()
        kv_dtype = next(self.loaded.model.parameters()).dtype
        self.layer_groups = self._layer_groups()
        group_size = len(self.layer_groups[0].layers)
        # A page: block_size tokens of K and V for one layer group's layers (MLA: latent + RoPE key).
        heads, k_dim, v_dim = mc.kv_cache_layout
        per_token_head = KVCache.bytes_per_token_head(k_dim, kv_dtype, cfg.kv_cache_dtype, v_dim)
        self.page_bytes = group_size * heads * per_token_head * cfg.block_size
        self.num_blocks = max(len(self.layer_groups), int(cfg.kv_cache_gib * 2**30 // self.page_bytes))  # pages
        graphs = self._cuda_graphs_apply()
        # A captured decode step's padding rows write into one page past the block manager's pool.
        pool_pages = self.num_blocks + int(graphs)
        self.kv_cache = KVCache(mc.num_layers, pool_pages * cfg.block_size, heads, k_dim,
                                kv_dtype, cfg.device, layer_groups=[g.layers for g in self.layer_groups],
                                kv_dtype=cfg.kv_cache_dtype, v_head_dim=v_dim, kv_source=mc.kv_source)
        self.runner = ModelRunner(self.loaded.model, self.kv_cache, cfg.block_size, cfg.device,
                                  stream_policies=self.stream_policies, compile=cfg.compile)
        self.block_manager = BlockManager(self.num_blocks, cfg.block_size,
                                          enable_prefix_caching=cfg.enable_prefix_caching and cfg.use_kv_cache,
                                          group_windows=[g.window for g in self.layer_groups],
                                          sink_tokens=cfg.attention_sinks)  # 0 unless streaming (EngineConfig checks)
        self.drafter = self._make_drafter()
        self._cap_max_model_len()
        self._log_pool()
        self.spec_stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_model_len=self.max_model_len,
                                   enable_chunked_prefill=cfg.enable_chunked_prefill,
                                   num_speculative_tokens=cfg.num_speculative_tokens if cfg.speculative else 0)
        self.sampler = Sampler(self.tokenizer.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        if graphs:
            self._capture_cuda_graphs()
        self.requests: dict[str, RequestState] = {}
        self.num_prompt_tokens_computed = 0  # prompt tokens that went through the model (not cache hits)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.clock = time.perf_counter  # the one monotonic clock for every timestamp

    def _pack_weights(self, model: torch.nn.Module, what: str, head_only: bool = False) -> None:
        """EngineConfig.pack_weights: fp32 weights on the CPU also packed for decode steps
        (kvserve/model/panels.py); `head_only` (compile): the LM head alone."""
        cfg = self.config
        if not cfg.pack_weights or cfg.device != "cpu" or next(model.parameters()).dtype != torch.float32:
            return
        t = time.perf_counter()
        n = use_panel_kernels(model, head_only=head_only)
        if n:
            log.info("%s: %d weight matrices packed for decode steps in %.1f s", what, n, time.perf_counter() - t)

    def _fuse_cuda_projections(self, model: torch.nn.Module) -> None:
        """CUDA float weights: q/k/v and gate/up as one matmul each (model/fused_linear.py; the
        originals become views, no memory is added)."""
        if torch.device(self.config.device).type != "cuda" or self.config.weights != "float":
            return
        n = fuse_linear_projections(model)
        log.info("model: %d projections fused for CUDA (q/k/v, gate/up)", n)

    def _cuda_graphs_apply(self) -> bool:
        """Decode steps through CUDA graphs: on CUDA with float weights and the model's own paged
        attention over an unquantized pool (the kernels that read lengths from memory), unless
        enforce_eager."""
        return torch.device(self.config.device).type == "cuda" and self._cuda_graphs_fit()

    def _cuda_graphs_fit(self) -> bool:
        """The engine's configuration has the decode steps a graph captures."""
        cfg, mc = self.config, self.model_config
        return (not cfg.enforce_eager and not cfg.compile
                and cfg.weights == "float" and cfg.kv_cache_dtype == "auto" and cfg.use_kv_cache
                and self.stream_policies is None and not mc.mla)

    def _capture_cuda_graphs(self) -> None:
        t = time.perf_counter()
        graphs = DecodeGraphs(self.loaded.model, self.kv_cache, self.config.block_size, self.max_model_len,
                              self.config.max_num_seqs, pad_block=self.num_blocks)
        graphs.capture()
        self.runner.graphs = graphs
        log.info("CUDA graphs: decode steps of %s sequences captured in %.1f s", graphs.buckets,
                 time.perf_counter() - t)

    def _low_bit_weights(self, loaded: LoadedModel, owned: bool) -> LoadedModel:
        """EngineConfig.weights int8 / int4: RTN-quantize every linear layer, the LM head and the
        embedding, onto the int8 / int4 kernels of kvserve/quant/linear.py (a copy when
        the caller owns the model); q/k/v and gate/up fused (kvserve/quant/fuse.py)."""
        kind = self.config.weights
        if kind == "float":
            return loaded
        from kvserve.quant.apply import quantize_model
        from kvserve.quant.fuse import fuse_projections
        from kvserve.quant.linear import QuantLinear, use_gemv_kernels

        model = loaded.model
        if any(isinstance(m, QuantLinear) for m in model.modules()):
            raise ValueError(f"weights {kind!r}: {loaded.source} is already quantized (a kvserve quant folder); "
                             "weights int8 / int4 quantize a float model when the engine starts")
        if not owned:
            dtype = next(model.parameters()).dtype
            model = build_model(loaded.config, model.state_dict(), dtype, self.config.device, loaded.source)
        bits = 8 if kind == "int8" else 4
        group = 128
        if bits == 4:  # the largest group the int4 kernel takes that divides every layer's inputs
            widths = {m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)}
            fits = [g for g in (128, 64, 32) if all(w % g == 0 for w in widths)]
            if not fits:
                raise ValueError(f"weights 'int4': no group size of 128, 64 or 32 divides the layer widths "
                                 f"{sorted(widths)} of {loaded.source}")
            group = fits[0]
        t = time.perf_counter()
        quantize_model(model, "rtn", bits=bits, group_size=group, granularity="channel" if bits == 8 else "group",
                       sym=bits == 8, lm_head=True, embedding=True, progress=False)
        fuse_projections(model)  # q/k/v and gate/up: one kernel call each
        use_gemv_kernels(model)
        log.info("weights %s: RTN-quantized every linear, the LM head and the embedding in %.1f s", kind,
                 time.perf_counter() - t)
        return dataclasses.replace(loaded, model=model)

    def _check_mla(self) -> None:
        """MLA caches one latent per token: no per-head K/V for KV quantization or StreamingLLM."""
        cfg, mc = self.config, self.model_config
        if not mc.mla:
            return
        if cfg.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {cfg.kv_cache_dtype!r} is not supported for MLA models "
                             f"({mc.model_type}): use 'auto'")
        if cfg.streaming_window is not None:
            raise ValueError(f"streaming_window is not supported for MLA models ({mc.model_type})")

    def _check_cla(self) -> None:
        """StreamingLLM keeps a per-layer rank-rotated cache; a layer reusing another's K/V has none."""
        if self.model_config.kv_source is not None and self.config.streaming_window is not None:
            raise ValueError("streaming_window is not supported for models with cross-layer KV sharing "
                             "(config kvserve_kv_source)")

    def _stream_policies(self) -> list[StreamPolicy] | None:
        """StreamingLLM's per-layer policies (None when off). The ranks given to cached keys
        must stay within the positions the model was trained on."""
        cfg, mc = self.config, self.model_config
        if cfg.streaming_window is None:
            return None
        budget = cfg.attention_sinks + cfg.streaming_window
        if budget > mc.max_position_embeddings:
            raise ValueError(f"attention_sinks + streaming_window = {budget} exceeds the model's context "
                             f"(max_position_embeddings {mc.max_position_embeddings})")
        return layer_policies(mc, cfg.attention_sinks, cfg.streaming_window)

    def _max_model_len(self) -> int:
        """The context cap: the model's trained context, or with StreamingLLM (whose positions
        are ranks in a bounded cache) what the user asks, by default STREAMING_MAX_MODEL_LEN."""
        cfg, mc = self.config, self.model_config
        if self.stream_policies is not None:
            return cfg.max_model_len or STREAMING_MAX_MODEL_LEN
        return min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)

    def _layer_groups(self) -> list[LayerGroup]:
        """KV layer groups: with sliding-window release, full and sliding layers get separate
        block tables so sliding ones can return their old blocks. Off without a KV cache (that
        baseline recomputes from position 0 into the same blocks) and with a separate draft
        model (its layers do not map onto the target's groups; it shares group 0's table).
        With StreamingLLM every layer reads only sinks + its window: one group of every layer
        whose window is the longest any layer looks back (its sink blocks are kept too)."""
        cfg = self.config
        if self.stream_policies is not None:
            lookback = max(p.window for p in self.stream_policies)
            return [LayerGroup(tuple(range(self.model_config.num_layers)), lookback)]
        release = cfg.sliding_window_release and cfg.use_kv_cache and cfg.speculative != "draft"
        return kv_layer_groups(self.model_config, release)

    def _cap_max_model_len(self) -> None:
        """A lone sequence must always be able to run to its end: cap the context to what the
        pool holds for one sequence at its peak (a separate draft cache, which may lag the
        target, holds sliding-window release back: then every group keeps every block)."""
        bm = self.block_manager
        cap = bm.max_tokens_per_seq(self.config.max_num_batched_tokens, keep_all=self.draft_runner is not None)
        if cap is not None and self.max_model_len > cap:
            # A sequence can never outgrow the pool; cap the context rather than fail mid-request.
            log.warning("max_model_len %d exceeds what the KV pool holds for one sequence (%d tokens); capping it "
                        "(raise --kv-cache-gib)", self.max_model_len, cap)
            self.max_model_len = cap

    def _log_pool(self) -> None:
        groups, bs = self.layer_groups, self.config.block_size
        sliding = [g for g in groups if g.window is not None]
        layout = (f"{len(groups)} layer groups of {len(groups[0].layers)} layers: {len(groups) - len(sliding)} full, "
                  f"{len(sliding)} sliding (window {sliding[0].window}, blocks outside it are released)"
                  if sliding else "one layer group, every layer keeps every block")
        log.info("KV pool (%s): %d pages x %d tokens = %d page-tokens, %d tokens of all layers (%.2f GiB); %s",
                 self.config.kv_cache_dtype, self.num_blocks, bs, self.num_blocks * bs,
                 self.num_blocks // len(groups) * bs, self.kv_cache.nbytes / 2**30, layout)

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Text or token ids -> validated token ids (every id must index the embedding)."""
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:  # a tokenizer with added tokens beyond the model's embedding
                raise ValueError(f"prompt encodes to token id {bad[0]}, which the model's vocabulary "
                                 f"[0, {vocab}) does not have")
            return ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[0]!r}, outside the vocabulary [0, {vocab})")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, deadline: float | None = None) -> str:
        """Queue a request (text or token ids). Raises ValueError for an empty prompt, a prompt
        that leaves no room to generate within max_model_len, or a duplicate request id.

        `cache_salt`: mixed into every block hash of the request, so it shares cached prefixes
        only with requests carrying the same salt (one tenant's prompts cannot be probed by
        another's through prefix-cache hits). `deadline` (engine clock): the step that finds it
        passed finishes the request with finish_reason "length" and frees its blocks."""
        arrival = self.clock() if arrival_time is None else arrival_time
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))):
            raise ValueError(f"deadline must be a number (the engine clock's seconds), got {deadline!r}")
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window (max_model_len) is "
                             f"{self.max_model_len}, leaving no room for output")
        seqs = [Sequence(next(self._seq_ids), request_id, list(ids), params, arrival, index=i) for i in range(params.n)]
        self.output_processor.attach(seqs, params, ids)
        for s in seqs:
            if cache_salt is not None:
                s.cache_salt = ("salt", cache_salt)
            s.generator = self._generator(params, s.index)
            if self.draft_runner is not None and not _needs_penalties(params):
                s.num_draft_computed = 0  # its draft cache starts empty (a prefix hit fills it)
        req = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs,
                       RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(ids)), deadline=deadline)
        self.requests[request_id] = req
        # n > 1: only the first sample is scheduled; the others fork from it once the prompt is
        # computed, sharing its blocks by reference (copy-on-write on their first append).
        self.scheduler.add(seqs[0])
        return request_id

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        # One RNG per sample, so a seeded request gives the same tokens whatever runs beside it.
        return torch.Generator(device=self.config.device).manual_seed(params.seed + index)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        now = self.clock()
        for s in req.seqs:
            if not s.finished:
                s.finish(SequenceStatus.FINISHED_ABORTED, now)
        req.metrics.finished_time = now
        del self.requests[request_id]
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict:
        """Counters and gauges (what /metrics will export)."""
        bm, sch = self.block_manager, self.scheduler
        return {
            "num_requests_running": sch.num_running,
            "num_requests_waiting": sch.num_waiting,
            "kv_cache_usage_perc": bm.usage(),
            "kv_blocks_total": self.num_blocks,  # pages of the one pool all layer groups share
            "kv_blocks_free": bm.num_free_blocks,
            "kv_layer_groups": bm.num_groups,
            "kv_blocks_released_by_window": bm.num_window_released,  # cumulative
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": sch.num_preemptions,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            **{f"spec_{k}": v for k, v in self.spec_stats.items()},
        }

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """One scheduling iteration; returns an output for every request that changed."""
        touched: set[str] = set()
        self._expire(self.clock(), touched)
        sched = self.scheduler.schedule()
        now = self.clock()
        for seq in sched.finished_with_error:
            req = self.requests[seq.request_id]
            req.error = seq.error
            for s in req.seqs:  # unforked samples share the parent's fate
                if not s.finished or s is seq:
                    s.finish(SequenceStatus.FINISHED_ERROR, now)
            touched.add(seq.request_id)
        if sched.scheduled:
            self._execute_isolating(sched, touched)
        return self.output_processor.make_outputs(self.requests, touched)

    def _expire(self, now: float, touched: set[str]) -> None:
        """Requests past their deadline finish now, with finish_reason "length" and the text
        held back so far, their blocks freed."""
        for rid, req in self.requests.items():
            if req.deadline is None or now < req.deadline or req.finished:
                continue
            for s in req.seqs:
                if s.finished:
                    continue
                self.scheduler.finish(s)
                self.output_processor.expire(s)
                s.finish(SequenceStatus.FINISHED_LENGTH, now)
            touched.add(rid)

    def _execute_isolating(self, sched: SchedulerOutput, touched: set[str]) -> None:
        """Run the step; if it fails, run each scheduled sequence alone, so that only a request
        whose own pass fails ends (with an error, its blocks freed) and the others go on.

        A retry is safe because nothing a pass depends on changes before its per-request phase
        (which catches its own errors): positions are rewritten with the same K/V, and copying a
        block again only restores what its new owner rewrites."""
        try:
            self._execute(sched, touched)
            return
        except Exception as exc:
            if len(sched.scheduled) == 1:
                self._fail_request(sched.scheduled[0].seq.request_id, exc, touched)
                return
            log.warning("a step over %d sequences failed (%s); running each alone", len(sched.scheduled),
                        type(exc).__name__)
        for i, item in enumerate(sched.scheduled):
            if item.seq.finished:
                continue  # its request failed with another of its sequences
            alone = SchedulerOutput([item], block_copies=sched.block_copies if i == 0 else [])
            try:
                self._execute(alone, touched)
            except Exception as exc:
                self._fail_request(item.seq.request_id, exc, touched)

    def _fail_request(self, request_id: str, exc: BaseException, touched: set[str]) -> None:
        """End a request the engine failed on: its samples finish with "error", its blocks are
        freed; the caller sees a reference to the log entry, never the exception's text."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        ref = uuid.uuid4().hex[:12]
        log.error("request %s failed in the engine [%s]", request_id, ref, exc_info=exc)
        req.error = f"internal engine error (log reference {ref})"
        req.error_status = 500
        self.scheduler.abort(request_id)
        now = self.clock()
        for s in req.seqs:
            if not s.finished or s.status is SequenceStatus.FINISHED_ABORTED:
                s.finish(SequenceStatus.FINISHED_ERROR, now)
        touched.add(request_id)

    def _execute(self, sched: SchedulerOutput, touched: set[str]) -> None:
        self.runner.copy_blocks(sched.block_copies, self.config.block_size)
        if self.draft_runner is not None:  # the draft pool shares the block tables
            self.draft_runner.copy_blocks(sched.block_copies, self.config.block_size)
        drafts = self._propose(sched)
        inputs, samplers, rows, spec = [], [], [], []
        now = self.clock()
        num_rows = 0
        for item in sched.scheduled:
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            start = seq.num_computed_tokens
            known = item.num_tokens - item.num_spec
            tokens = seq.token_slice(start, start + known)
            if item.num_spec:
                tokens = tokens + drafts[id(item)].token_ids
            self.num_prompt_tokens_computed += max(0, min(start + known, seq.num_prompt_tokens) - start)
            inputs.append(StepInput(tokens, start, seq.block_table, item.needs_logits, max(1, item.num_logits),
                                    group_tables=seq.group_block_tables))
            if item.num_spec:
                spec.append((item, num_rows))
            elif item.needs_logits:
                samplers.append(seq)
                rows.append(num_rows)
            num_rows += item.num_logits
        picked = None
        if self._argmax_only(samplers, rows, spec, num_rows):
            tokens, logits = self.runner.execute_greedy(inputs)  # tokens without the full logits
            picked = None if tokens is None else tokens.tolist()
        else:
            logits = self.runner.execute(inputs)
        # Speculative tokens are appended before `update` (which sets num_rejected-aware
        # progress): blocks that become full are hashed from tokens that must already be there.
        verified = self._verify(logits, spec, drafts) if picked is None else self._verify_argmax(picked, spec, drafts)
        self._accept(verified, touched)
        self.scheduler.update(sched)
        for item, _ in spec:
            seq = item.seq
            if seq.num_draft_computed is not None:  # draft K/V past the accepted tokens is stale
                seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        for row, seq in list(zip(rows, samplers)):
            for child in self._fork_children(seq):
                samplers.append(child)
                rows.append(row)  # a child samples its first token from the parent's logits
        if not self.config.use_kv_cache:
            # The no-cache baseline: after each sampled token forget everything computed, so the
            # next step recomputes the whole sequence (a long prompt still goes in chunks first).
            for seq in samplers:
                seq.num_computed_tokens = 0
        if samplers and picked is not None:
            now = self.clock()
            for row, seq in zip(rows, samplers):  # plain greedy: no logprobs to report
                self._append(seq, picked[row], None, None, now)
                touched.add(seq.request_id)
        elif samplers:
            for group_rows, seqs in self._sampling_groups(rows, samplers):
                self._sample(logits, group_rows, seqs, touched)

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], touched: set[str]) -> None:
        """Sample and append one group's tokens. A group that fails is sampled a sequence at a
        time, so only a request that fails alone ends."""
        try:
            out = self.sampler(self._rows_of(logits, rows), [self._sampling_request(s) for s in seqs])
        except Exception as exc:
            if len(seqs) == 1:
                self._fail_request(seqs[0].request_id, exc, touched)
                return
            for row, seq in zip(rows, seqs):
                self._sample(logits, [row], [seq], touched)
            return
        now = self.clock()
        for i, seq in enumerate(seqs):
            self._append(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i], now)
            touched.add(seq.request_id)

    @staticmethod
    def _sampling_groups(rows: list[int], samplers: list[Sequence]):
        """(logits rows, sequences) to sample together: every sequence with a row of its own in
        one batch, then the samples forked from one parent a parent at a time, each from the
        parent's row. A request's n first tokens never gather n copies of the whole batch's
        vocabulary rows (64 prompts x n 128 of Gemma's would be 8 GB of fp32)."""
        by_row: dict[int, list[Sequence]] = {}
        for row, seq in zip(rows, samplers):
            by_row.setdefault(row, []).append(seq)
        single = [(row, seqs[0]) for row, seqs in by_row.items() if len(seqs) == 1]
        groups = []
        if single:
            groups.append(([r for r, _ in single], [s for _, s in single]))
        groups += [([row] * len(seqs), seqs) for row, seqs in by_row.items() if len(seqs) > 1]
        return groups

    @staticmethod
    def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits[rows] [len(rows), V]: the tensor itself when rows are all of it in order, one
        row repeated as an expanded copy of that row (the samples of one parent)."""
        if rows == list(range(logits.shape[0])):
            return logits
        if len(set(rows)) == 1:
            return logits[rows[0]].expand(len(rows), -1).contiguous()
        return logits[torch.tensor(rows, device=logits.device)]

    def _argmax_only(self, samplers: list[Sequence], rows: list[int], spec: list, num_rows: int) -> bool:
        """Every logit row of the step wants only its argmax: plain greedy sampling, or the
        verification of a plain greedy sequence's drafts (no logprobs, penalties or min_tokens)."""
        spec_rows = [r + j for it, r in spec for j in range(it.num_logits)]
        if not num_rows or sorted(rows + spec_rows) != list(range(num_rows)):
            return False
        seqs = samplers + [it.seq for it, _ in spec]
        return self.sampler.greedy_only([self._sampling_request(s) for s in seqs])

    def _accept(self, verified: list, touched: set[str]) -> None:
        now = self.clock()
        for seq, tokens, lps in verified:
            for j, token in enumerate(tokens):
                if seq.finished:
                    break  # a stop inside the accepted run: the rest is dropped
                lp, top = (None, None) if lps is None else (lps.logprobs[j], lps.top_logprobs[j])
                self._append(seq, token, lp, top, now)
            touched.add(seq.request_id)

    @staticmethod
    def _sampling_request(seq: Sequence) -> SamplingRequest:
        return SamplingRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator)

    # ---------------------------------------------------------------- speculative decoding
    def _make_drafter(self):
        """The proposer chosen by config.speculative (None when off); sets self.draft_runner."""
        cfg, mc = self.config, self.model_config
        self.draft_runner = None
        if cfg.speculative is None:
            return None
        if cfg.speculative == "ngram":
            return NgramDrafter(cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max)
        if cfg.speculative == "self":
            return self._make_self_drafter()
        draft = load_model(cfg.speculative_model, cfg.dtype, cfg.device).model
        if draft.config.vocab_size != mc.vocab_size:
            raise ValueError(f"speculative_model {cfg.speculative_model!r} has a vocabulary of "
                             f"{draft.config.vocab_size} tokens; the target has {mc.vocab_size}: a draft must "
                             "share the tokenizer")
        return self._separate_drafter(draft, draft.config.num_layers, f"draft model {cfg.speculative_model}")

    def _make_self_drafter(self) -> ModelDrafter:
        """The target as its own draft: a lower-precision copy of its weights (default bf16 for
        an fp32 target; `self_draft_bits` 4 / 8: an RTN-quantized copy), and/or an early exit
        after its first `self_draft_layers` layers."""
        cfg, mc = self.config, self.model_config
        target_dtype = next(self.loaded.model.parameters()).dtype
        bits = cfg.self_draft_bits
        dtype = resolve_dtype(cfg.self_draft_dtype) if cfg.self_draft_dtype else (
            torch.bfloat16 if target_dtype == torch.float32 and not bits else target_dtype)
        copy = dtype != target_dtype or bits is not None
        layers = cfg.self_draft_layers or (mc.num_layers if copy else max(1, mc.num_layers // 3))
        if layers > mc.num_layers or (layers == mc.num_layers and not copy):
            raise ValueError(f"self_draft_layers must be below the model's {mc.num_layers} layers (or give a "
                             f"self_draft_dtype other than the target's), got {layers}")
        exit_at = layers if layers < mc.num_layers else None
        if not copy:  # early exit on the target itself: its K/V for those layers are the draft's
            log.info("self-speculative draft: early exit after %d of %d layers", layers, mc.num_layers)
            return ModelDrafter(self.runner, num_layers=exit_at)
        draft = build_model(mc, self.loaded.model.state_dict(), dtype, cfg.device, self.loaded.source)
        what = f"{dtype}"
        if bits:
            from kvserve.quant.apply import quantize_model

            quantize_model(draft, "rtn", bits=bits, group_size=128, granularity="group" if bits == 4 else "channel",
                           sym=bits == 8, lm_head=True, progress=False)
            what = f"RTN int{bits} of {dtype}, LM head included"
        return self._separate_drafter(draft, layers, f"self draft ({what}, {layers} of {mc.num_layers} layers)",
                                      exit_at)

    def _separate_drafter(self, draft, num_layers: int, what: str, exit_at: int | None = None) -> ModelDrafter:
        """A drafter with its own KV pool (num_layers layers) addressed by the target's block tables."""
        dc, cfg = draft.config, self.config
        kv_dtype = next(draft.parameters()).dtype
        heads, k_dim, v_dim = dc.kv_cache_layout
        if self.kv_cache.num_groups > 1:  # the self draft: the target's layers, so its layer groups too
            cache = KVCache(dc.num_layers, self.kv_cache.num_slots, heads, k_dim, kv_dtype, cfg.device,
                            layer_groups=[g.layers for g in self.layer_groups], v_head_dim=v_dim,
                            kv_source=dc.kv_source)
        else:
            cache = KVCache(num_layers, self.kv_cache.num_slots, heads, k_dim, kv_dtype, cfg.device, v_head_dim=v_dim,
                            kv_source=dc.kv_source)
        log.info("%s: its own KV pool %.2f GiB (same block tables as the target)", what, cache.nbytes / 2**30)
        self._pack_weights(draft, "draft")
        self.draft_runner = ModelRunner(draft, cache, cfg.block_size, cfg.device)
        return ModelDrafter(self.draft_runner, num_layers=exit_at, separate_cache=True)

    def _spec_budget(self, seq: Sequence) -> int:
        """Draft tokens seq may be verified with next step: never more than it may still emit."""
        p = seq.params
        if self.drafter is None or _needs_penalties(p):
            return 0  # penalties depend on every token before a position: decode plainly
        if len(seq.output_token_ids) < p.min_tokens:
            return 0  # eos is masked per position until then: plain sampling handles it
        left = self.max_model_len if p.max_tokens is None else p.max_tokens - len(seq.output_token_ids)
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def _propose(self, sched: SchedulerOutput) -> dict[int, Draft]:
        """Draft tokens for the scheduled decodes with reserved slots, keyed by id(item); shrinks
        each item to what was proposed."""
        items = [it for it in sched.scheduled if it.num_spec]
        if not items:
            return {}
        drafts = self.drafter.propose([it.seq for it in items], [it.num_spec for it in items])
        out = {}
        for it, d in zip(items, drafts):
            del d.token_ids[it.num_spec:]
            it.num_spec = len(d.token_ids)
            it.num_tokens = 1 + it.num_spec
            out[id(it)] = d
        return out

    def _verify(self, logits: torch.Tensor, spec: list, drafts: dict[int, Draft]) -> list:
        """Rejection-sample the drafted items: [(seq, tokens to append, their logprobs)]."""
        if not spec:
            return []
        items = [it for it, _ in spec]
        rows = torch.cat([torch.arange(r, r + it.num_logits) for it, r in spec]).to(logits.device)
        target = logits[rows]
        ds = [drafts[id(it)] for it in items]
        res = rejection_sample(target, [d.token_ids for d in ds], [d.probs for d in ds],
                               [it.seq.params for it in items], [it.seq.generator for it in items])
        out, offset = [], 0
        for it, tokens, accepted in zip(items, res.token_ids, res.num_accepted):
            self._count_accepted(it, accepted)
            rows_i = target[offset: offset + len(tokens)]
            offset += it.num_logits
            req = [self._sampling_request(it.seq)] * len(tokens)
            lps = self.sampler.token_logprobs(rows_i, torch.tensor(tokens, device=target.device), req)
            out.append((it.seq, tokens, lps))
        return out

    def _verify_argmax(self, picked: list[int], spec: list, drafts: dict[int, Draft]) -> list:
        """Plain greedy drafts verified from the step's argmax tokens (`picked`, one per logit
        row: the model's greedy screen, no logits): the same tokens as `_verify`, no logprobs."""
        out = []
        for it, row in spec:
            tokens = accept_greedy(drafts[id(it)].token_ids, picked[row : row + it.num_logits])
            self._count_accepted(it, len(tokens) - 1)
            out.append((it.seq, tokens, None))
        return out

    def _count_accepted(self, item, accepted: int) -> None:
        item.num_rejected = item.num_spec - accepted
        st = self.spec_stats
        st["num_drafts"] += 1
        st["num_draft_tokens"] += item.num_spec
        st["num_accepted_tokens"] += accepted

    def _fork_children(self, parent: Sequence) -> list[Sequence]:
        """The request's other samples, forked from `parent` right after its prompt is computed."""
        if parent.index != 0 or parent.output_token_ids:
            return []
        req = self.requests[parent.request_id]
        children = [s for s in req.seqs[1:] if not s.finished and not s.block_table]
        for child in children:
            child.first_scheduled_time = parent.first_scheduled_time
            self.scheduler.fork(parent, child)
        return children

    def _append(self, seq: Sequence, token: int, logprob: float, top: dict | None, now: float) -> None:
        if seq.finished:
            return  # its request failed with one of its other samples
        try:
            self._append_token(seq, token, logprob, top, now)
        except Exception as exc:  # detokenizing or stop checking this request failed
            self._fail_request(seq.request_id, exc, {seq.request_id})

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: dict | None, now: float) -> None:
        seq.append_token(token, now)
        seq.max_spec_tokens = self._spec_budget(seq)
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top)
        req = self.requests[seq.request_id]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        res = self.output_processor.on_token(seq, token)
        if res.finished:
            seq.finish(_FINISH[res.reason], now, res.stop_reason)
            self.scheduler.finish(seq)
