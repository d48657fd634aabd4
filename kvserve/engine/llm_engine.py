"""LLMEngine: add_request / step / abort. The one place that owns a clock.

Each step: the scheduler picks sequences and token counts within the budget, the model runner
runs them as one flat batch, the sampler picks next tokens, the detokenizer and stop checker
turn them into text and finish sequences, and the scheduler frees what finished. The parts it
is built from come from kvserve/engine/builder.py; speculative decoding is kvserve/speculative/decoder.py.
"""
from __future__ import annotations

import functools
import itertools
import logging
import random
import time

import torch
import torch.nn.functional as F

from kvserve.config import EngineConfig
from kvserve.engine import builder, input_processor, step_batch
from kvserve.engine.grammars import GrammarCompiles
from kvserve.engine.metrics import RequestMetrics
from kvserve.engine.model_runner import ModelRunner, StepInput
from kvserve.engine.parallel import setup as parallel_setup
from kvserve.engine.output_processor import OutputProcessor, RequestState
from kvserve.engine.outputs import RequestOutput, error_reference
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.loading import LoadedModel
from kvserve.pooling_params import PoolingParams
from kvserve.reasoning import END as REASONING_END
from kvserve.reasoning import opens_reasoning
from kvserve.sampling import Sampler, SamplerOutput
from kvserve.sampling.prompt_logprobs import prompt_logprobs
from kvserve.sampling.structured import GrammarBackend
from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Logprob, Sequence, SequenceStatus
from kvserve.speculative.decoder import DraftTarget, SpeculativeDecoder, Verified
from kvserve.speculative.proposers import Drafter

log = logging.getLogger(__name__)

_FINISH = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}
REASONING_TAIL = 16  # prompt tokens decoded to see whether the template opened a <think> block


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = cfg = config or EngineConfig()
        builder.set_up_host(cfg)
        path = None
        if loaded is None:
            path = builder.model_path(cfg)
            builder.check_memory(cfg, path)
        self.tp_group = None  # tensor parallelism: rank 0's group (kvserve/engine/parallel/)
        if cfg.parallel_config.enabled:
            self.tp_group, self.loaded = parallel_setup.start(cfg, loaded, path)
        else:
            self.loaded = builder.load_weights(cfg, loaded, path)
        self.model_config = mc = self.loaded.model.config
        self.tokenizer = self.loaded.tokenizer
        builder.check_model(cfg, mc)
        self.stream_policies = builder.stream_policies(cfg.streaming_config, mc)
        self.max_model_len = builder.max_model_len(cfg.scheduler_config, mc, self.stream_policies)
        self.layer_groups = builder.layer_groups(cfg, mc, self.stream_policies)
        graphs = self._cuda_graphs_apply()
        if cfg.num_scheduler_steps > 1 and not graphs:
            raise ValueError(f"num_scheduler_steps {cfg.num_scheduler_steps}: multi-step decoding runs its steps in "
                             "captured CUDA graphs (device 'cuda', float weights, an 'auto' KV pool, no "
                             "enforce_eager / compile / StreamingLLM); use num_scheduler_steps=1 here")
        kv_dtype = next(self.loaded.model.parameters()).dtype
        # A hybrid model's recurrent states, allocated first so the automatic KV budget sees them.
        self.state_cache = builder.state_pool(cfg.scheduler_config, cfg.device, mc, kv_dtype)
        pool = builder.kv_pool(cfg.cache_config, cfg.device, mc, self.layer_groups, kv_dtype, graphs,
                               self.max_model_len)
        self.kv_cache, self.page_bytes, self.num_blocks = pool.cache, pool.page_bytes, pool.num_blocks
        if self.tp_group is not None:  # the workers build the same pages at their local heads
            self.runner = parallel_setup.driver_runner(self.tp_group, self.loaded.model, self.kv_cache,
                                                       builder.kv_cache_args(cfg.cache_config, mc, self.layer_groups,
                                                                             kv_dtype, self.kv_cache.num_slots),
                                                       cfg.block_size)
        else:
            self.runner = ModelRunner(self.loaded.model, self.kv_cache, cfg.block_size, cfg.device,
                                      stream_policies=self.stream_policies, compile=cfg.compile,
                                      state_cache=self.state_cache)
        self.block_manager = builder.block_manager(cfg.cache_config, cfg.streaming_config, self.num_blocks,
                                                   self.layer_groups, self.state_cache)
        target = DraftTarget(self.loaded, self.runner, self.kv_cache, self.layer_groups)
        self.spec_decoder = SpeculativeDecoder(cfg, target)
        self.draft_runner, self.spec_stats = self.spec_decoder.draft_runner, self.spec_decoder.stats
        self.max_model_len = builder.cap_max_model_len(self.max_model_len, self.block_manager, cfg.scheduler_config,
                                                       keep_all=self.draft_runner is not None)
        builder.log_pool(cfg.cache_config, self.layer_groups, self.num_blocks, self.kv_cache)
        builder.log_memory(self.loaded.model, self.kv_cache, self.state_cache)
        self.scheduler = builder.scheduler(cfg.scheduler_config, cfg.speculative_config, self.block_manager,
                                           self.max_model_len)
        self.sampler = Sampler(self.tokenizer.eos_token_ids)
        # The token ids of </think> (one special token in Qwen3's and DeepSeek-R1's vocabularies)
        # under a reasoning parser: where a thinking request's grammar starts.
        self._reasoning_end = (self.tokenizer.encode(REASONING_END, add_special_tokens=False) or None
                               if cfg.reasoning_parser is not None else None)
        self.grammars = GrammarCompiles(GrammarBackend(self.tokenizer, mc.vocab_size))
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        if graphs:
            self.runner.graphs = builder.capture_cuda_graphs(self.loaded.model, self.kv_cache, cfg,
                                                             self.max_model_len, pad_block=self.num_blocks)
        self.requests: dict[str, RequestState] = {}
        self.num_prompt_tokens_computed = 0  # prompt tokens that went through the model (not cache hits)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        # Seeds for requests without one, in arrival order (EngineConfig.seed; None: the global RNG).
        self._seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        self.clock = time.perf_counter  # the one monotonic clock for every timestamp

    @property
    def drafter(self) -> Drafter | None:
        """The speculative proposer (None when off); assigning one makes the decoder propose with it."""
        return self.spec_decoder.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.spec_decoder.drafter = drafter

    def _cuda_graphs_apply(self) -> bool:
        """Decode steps through CUDA graphs: on CUDA when the configuration fits (a method of its
        own, so that tests can run the graph runner on the CPU)."""
        return torch.device(self.config.device).type == "cuda" and self._cuda_graphs_fit()

    def _cuda_graphs_fit(self) -> bool:
        return builder.cuda_graphs_fit(self.config, self.model_config, self.stream_policies)

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Text or token ids -> validated token ids (every id must index the embedding)."""
        return input_processor.tokenize(prompt, self.tokenizer, self.model_config.vocab_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, deadline: float | None = None) -> str:
        """Queue a request (text or token ids). Raises ValueError for an empty prompt, a prompt
        that leaves no room to generate within max_model_len, or a duplicate request id.

        PoolingParams make it an embedding request: its prompt runs (prefill only, pooled as
        `config.pooler_config` says), it samples nothing, its blocks are freed when it finishes,
        and its one output is an EmbeddingRequestOutput.

        `cache_salt`: mixed into every block hash of the request, so it shares cached prefixes
        only with requests carrying the same salt (one tenant's prompts cannot be probed by
        another's through prefix-cache hits). `deadline` (engine clock): the step that finds it
        passed finishes the request with finish_reason "length" and frees its blocks."""
        arrival = self.clock() if arrival_time is None else arrival_time
        params = input_processor.check_request_args(params, cache_salt, deadline)
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pooling = isinstance(params, PoolingParams)
        if self.config.parallel_config.enabled:
            _check_tensor_parallel_request(params, pooling)
        structured = None if pooling else params.structured_outputs
        if structured is not None:  # a bad schema / regex / grammar: ValueError now
            self.grammars.backend.check(structured)
        ids = self.tokenize(prompt)
        input_processor.check_token_args(params, self.model_config.vocab_size, self.model_config.hidden_size)
        input_processor.check_prompt_fits(ids, self.max_model_len, pooling)
        if pooling:
            seqs = [input_processor.pooling_sequence(next(self._seq_ids), request_id, ids, params,
                                                     self.config.pooler_config, arrival, cache_salt)]
            params = seqs[0].params
        else:
            seqs = input_processor.new_sequences(self._seq_ids, request_id, ids, params, arrival, cache_salt,
                                                 self.config.device, self._engine_seed(params))
            self.output_processor.attach(seqs, params, ids)
            self.spec_decoder.attach(seqs)
        req = RequestState(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs,
                       RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(ids)), deadline=deadline)
        self.requests[request_id] = req
        if structured is None:
            self.scheduler.add(seqs[0])
        else:  # scheduled once its grammar is compiled (now, when cached)
            compiled = self.grammars.submit(request_id, structured)
            if compiled is not None:
                self._start_constrained(req, compiled)
        return request_id

    @property
    def reasoning_parser(self) -> str | None:
        """The reasoning format the engine starts thinking requests' grammars after (None: none)."""
        return self.config.reasoning_parser

    def _engine_seed(self, params: SamplingParams) -> int | None:
        """The next seed of the engine's stream for a request without its own (drawn for sampled
        and greedy requests alike, so a seed depends only on the request's place in arrival order)."""
        if self._seeds is None or params.seed is not None:
            return None
        return self._seeds.getrandbits(63)
    def _start_constrained(self, req: RequestState, compiled) -> None:
        """Each sample gets its own matcher of the request's grammar, then the request is
        scheduled. n > 1: only the first sample is scheduled; the others fork from it once the
        prompt is computed, sharing its blocks by reference (copy-on-write on their first append)."""
        reasons = self._reasoning_end is not None and opens_reasoning(
            self.tokenizer.decode(req.seqs[0].prompt_token_ids[-REASONING_TAIL:], skip_special_tokens=False))
        for s in req.seqs:
            state = self.grammars.backend.new_state(compiled)
            if reasons:  # the model thinks first; its grammar starts after </think>
                s.reasoning_grammar = state
            else:
                s.grammar = state
        self.scheduler.add(req.seqs[0])

    def _admit_compiled(self, touched: set[str]) -> None:
        """Requests whose grammar finished compiling start (or fail, 400, if it could not)."""
        idle = not self.scheduler.has_unfinished
        for rid, compiled, err in self.grammars.ready(idle):
            req = self.requests.get(rid)
            if req is None:
                continue
            if err is None:
                self._start_constrained(req, compiled)
                continue
            req.error = str(err) if isinstance(err, ValueError) else f"grammar compilation failed: {err!r}"
            req.error_status = 400 if isinstance(err, ValueError) else 500
            now = self.clock()
            for s in req.seqs:
                s.finish(SequenceStatus.FINISHED_ERROR, now)
            touched.add(rid)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        self.grammars.discard(request_id)
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
            "num_requests_waiting": sch.num_waiting + len(self.grammars),  # compiling counts as waiting
            "kv_cache_usage_perc": bm.usage(),
            "kv_blocks_total": self.num_blocks,  # pages of the one pool all layer groups share
            "kv_blocks_free": bm.num_free_blocks,
            "kv_layer_groups": bm.num_groups,
            "kv_blocks_released_by_window": bm.num_window_released,  # cumulative
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": sch.num_preemptions,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            # A hybrid model's recurrent state pool (0 / None without recurrent layers).
            "state_slots_total": 0 if self.state_cache is None else self.state_cache.num_slots,
            "state_slots_free": bm.num_free_state_slots or 0,
            **{f"spec_{k}": v for k, v in self.spec_stats.items()},
        }

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """One scheduling iteration; returns an output for every request that changed."""
        touched: set[str] = set()
        self._admit_compiled(touched)
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
            step_batch.execute_isolating(sched, functools.partial(self._execute, touched=touched),
                                         functools.partial(self._fail_request, touched=touched))
        if self.tp_group is not None:
            self.tp_group.check()  # a dead rank: its step's requests failed above; the engine cannot go on
        return self.output_processor.make_outputs(self.requests, touched)

    @property
    def fatal_error(self) -> str | None:
        """Why this engine can never step again (a tensor-parallel rank died), else None."""
        return None if self.tp_group is None else self.tp_group.failure

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for one process); the engine cannot step after."""
        if self.tp_group is not None:
            self.tp_group.close()

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
            self.grammars.discard(rid)
            if req.seqs[0].pooling is not None:  # no partial embedding to give
                req.error, req.error_status = "the request timed out before its embedding was computed", 408
            touched.add(rid)

    def _fail_request(self, request_id: str, exc: BaseException, touched: set[str]) -> None:
        """End a request the engine failed on: its samples finish with "error", its blocks are
        freed; the caller sees a reference to the log entry, never the exception's text."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        ref = error_reference()
        log.error("request %s failed in the engine [%s]", request_id, ref, exc_info=exc)
        req.error = f"internal engine error (log reference {ref})"
        req.error_status = 500
        self.scheduler.abort(request_id)
        self.grammars.discard(request_id)
        now = self.clock()
        for s in req.seqs:
            if not s.finished or s.status is SequenceStatus.FINISHED_ABORTED:
                s.finish(SequenceStatus.FINISHED_ERROR, now)
        touched.add(request_id)

    def _execute(self, sched: SchedulerOutput, touched: set[str]) -> None:
        self.runner.copy_blocks(sched.block_copies, self.config.block_size)
        self.runner.copy_states(sched.state_copies)
        self.spec_decoder.copy_blocks(sched.block_copies)
        if self.config.num_scheduler_steps > 1 and self._execute_steps(sched, touched):
            return
        drafts = self.spec_decoder.propose(sched)
        if drafts and (limits := self.runner.screen_top_k)[1]:
            step_batch.fit_drafts_to_screen(sched, drafts, self.sampler, self.runner.model.config.vocab_size,
                                            *limits[:2])
        batch = step_batch.build_batch(sched, drafts, self.clock())
        self.num_prompt_tokens_computed += batch.num_prompt_tokens
        samplers, rows, picked = batch.samplers, batch.rows, None
        if batch.hidden:  # prompt logprobs or embeddings: hidden states besides the logits
            logits, hidden = self.runner.execute_hidden(batch.inputs)
            self._take_hidden(batch, hidden, touched)
        elif step_batch.argmax_only(batch, self.sampler):
            tokens, logits = self.runner.execute_greedy(batch.inputs)  # tokens without the full logits
            picked = None if tokens is None else tokens.tolist()
        elif self.runner.has_greedy_screen and (allowed := step_batch.argmax_masks(
                batch, self.sampler, self.runner.model.config.vocab_size,
                self.spec_decoder.argmax_masks(batch.spec, drafts))) is not None:
            tokens, logits = self.runner.execute_greedy(batch.inputs, allowed)  # greedy under grammars
            picked = None if tokens is None else tokens.tolist()
        elif (screened := step_batch.top_k_rows(batch, self.sampler, self.runner.model.config.vocab_size, drafts,
                                                *self.runner.screen_top_k)) is not None:
            # only the rows' few largest logits and those their penalties change
            logits = self.runner.execute_top_k(batch.inputs, screened.top_k, screened.touched)
        else:
            logits = self.runner.execute(batch.inputs)
        # Speculative tokens are appended before `update` (which sets num_rejected-aware
        # progress): blocks that become full are hashed from tokens that must already be there.
        verified = (self.spec_decoder.verify(logits, batch.spec, drafts, self.sampler) if picked is None
                    else self.spec_decoder.verify_argmax(picked, batch.spec, drafts))
        self._accept(verified, touched)
        self.scheduler.update(sched)
        self.spec_decoder.trim_draft_caches(batch.spec)
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
            for group_rows, seqs in step_batch.sampling_groups(rows, samplers):
                step_batch.sample_isolating(self.sampler, logits, group_rows, seqs,
                                            functools.partial(self._append_sampled, touched=touched),
                                            functools.partial(self._fail_request, touched=touched))

    def _execute_steps(self, sched: SchedulerOutput, touched: set[str]) -> bool:
        """Multi-step decoding: a step of plain greedy decodes, the longest with all K slots
        reserved, runs K steps in one replay (`ModelRunner.execute_steps`); False where it does
        not apply, after giving back the reserved slots (the step then decodes one token a
        sequence; the scheduler's update returns the blocks that held only them)."""
        items = sched.scheduled
        if not any(it.num_spec for it in items):
            return False
        # Decodes past their first token (a prompt's last chunk samples the first token and may fork)
        plain = all(it.num_tokens == 1 + it.num_spec and it.needs_logits and it.seq.output_token_ids
                    and it.seq.pooling is None for it in items)
        runs = None
        if plain and self.sampler.greedy_only([step_batch.sampling_request(it.seq) for it in items]):
            inputs = [StepInput(it.seq.token_slice(it.start, it.start + 1), it.start, it.seq.block_table,
                                group_tables=it.seq.group_block_tables) for it in items]
            runs = self.runner.execute_steps(inputs, [1 + it.num_spec for it in items])
        if runs is None:
            for it in items:
                it.num_tokens -= it.num_spec
                it.num_spec = 0
            return False
        self._accept([(it.seq, tokens, None) for it, tokens in zip(items, runs)], touched)
        self.scheduler.update(sched)
        return True

    def _lookahead(self, seq: Sequence) -> int:
        """Slots past seq's next token the scheduler may reserve: its draft tokens, or the further
        steps of multi-step decoding (plain greedy only, never past max_tokens)."""
        k = self.config.num_scheduler_steps
        if k == 1:
            return self.spec_decoder.budget(seq, self.max_model_len)
        if seq.reasoning_grammar is not None or not self.sampler.greedy_only([step_batch.sampling_request(seq)]):
            return 0  # (a run past </think> would take tokens its grammar never masked)
        return seq.lookahead_limit(k - 1, self.max_model_len)

    def _take_hidden(self, batch: step_batch.StepBatch, hidden: torch.Tensor, touched: set[str]) -> None:
        """Prompt logprobs and embeddings from this pass's hidden rows; a failure ends only its
        own request."""
        for h in batch.hidden:
            seq = h.seq
            if seq.finished:
                continue
            try:
                rows = hidden[h.first:h.first + h.count]
                if seq.pooling is None:
                    self._record_prompt_logprobs(seq, h.start, rows)
                else:
                    self._pool(seq, h, rows, touched)
            except Exception as exc:
                self._fail_request(seq.request_id, exc, touched)

    def _record_prompt_logprobs(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """Score the prompt tokens after positions start.. (row i predicts token start + 1 + i)."""
        targets = seq.prompt_token_ids[start + 1:start + 1 + rows.shape[0]]
        scored = prompt_logprobs(rows, targets, seq.params.prompt_logprobs, self.runner.model.compute_logits)
        for pos, (token, r) in enumerate(zip(targets, scored), start):
            if pos + 1 != len(seq.prompt_logprobs):
                continue  # scored before (not reached: the batch asks for new positions only)
            entry = {token: Logprob(r.logprob, r.rank, self._token_text(token))}
            for rank, (tid, lp) in enumerate(zip(r.top_ids, r.top_logprobs), 1):
                entry.setdefault(tid, Logprob(lp, rank, self._token_text(tid)))
            seq.prompt_logprobs.append(entry)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _pool(self, seq: Sequence, h: step_batch.HiddenRows, rows: torch.Tensor, touched: set[str]) -> None:
        """Add this pass's rows to the embedding (a running sum for MEAN, the row for LAST);
        after the prompt's last chunk: normalize, finish, free the blocks."""
        total, done = seq.pooled if seq.pooled is not None else (None, 0)
        if h.count:
            mean = seq.pooling.pooling_type == "MEAN"
            part = rows.float().sum(dim=0) if mean else rows[-1].float()
            total = total + part if mean and total is not None else part
            done = h.start + h.count
        seq.pooled = (total, done)
        if not h.ends_prompt:
            return
        emb = total / seq.num_prompt_tokens if seq.pooling.pooling_type == "MEAN" else total
        if seq.pooling.normalize:
            emb = F.normalize(emb, dim=0)
        seq.pooled = emb.tolist()
        seq.finish(SequenceStatus.FINISHED_STOPPED, self.clock())
        self.scheduler.finish(seq)
        touched.add(seq.request_id)

    def _append_sampled(self, seqs: list[Sequence], out: SamplerOutput, touched: set[str]) -> None:
        now = self.clock()
        for i, seq in enumerate(seqs):
            self._append(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i], now)
            touched.add(seq.request_id)

    def _accept(self, verified: list[Verified], touched: set[str]) -> None:
        now = self.clock()
        for seq, tokens, lps in verified:
            for j, token in enumerate(tokens):
                if seq.finished:
                    break  # a stop inside the accepted run: the rest is dropped
                lp, top = (None, None) if lps is None else (lps.logprobs[j], lps.top_logprobs[j])
                self._append(seq, token, lp, top, now)
            touched.add(seq.request_id)

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
        if seq.grammar is not None and not seq.grammar.accept(token):  # the mask should make this impossible
            raise RuntimeError(f"token {token} is not allowed by the request's grammar")
        seq.append_token(token, now)
        if seq.reasoning_grammar is not None and seq.output_token_ids[-len(self._reasoning_end):] == self._reasoning_end:
            seq.grammar, seq.reasoning_grammar = seq.reasoning_grammar, None  # the block closed: the answer follows
        seq.max_spec_tokens = self._lookahead(seq)
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
        elif seq.grammar is not None and seq.grammar.terminated:  # EOS under ignore_eos: the grammar is done
            self.output_processor.expire(seq)
            seq.finish(SequenceStatus.FINISHED_STOPPED, now, token)
            self.scheduler.finish(seq)


def _check_tensor_parallel_request(params: SamplingParams | PoolingParams, pooling: bool) -> None:
    """What a sharded engine cannot give yet: hidden states and prompt logprobs need every
    rank's forward and the whole vocabulary on rank 0, which only its sampling path gathers."""
    if pooling:
        raise ValueError("embeddings are not supported under tensor parallelism (tensor_parallel_size > 1)")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs is not supported under tensor parallelism (tensor_parallel_size > 1)")
