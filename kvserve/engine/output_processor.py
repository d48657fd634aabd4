"""From sampled tokens to what a caller sees: text, stop decisions, each step's RequestOutput.

The engine owns one `RequestState` per request. Each new token goes through the sequence's
incremental detokenizer and stop checker (the request's stop strings are compiled once, for
all its samples); the text they release is kept in pieces, so an output that reports only
what is new (`RequestOutputKind.DELTA`, what a stream sends) costs what is new, not
everything again.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.metrics import RequestMetrics
from kvserve.engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from kvserve.sampling.detokenizer import make_detokenizer
from kvserve.sampling.stop import StopChecker, StopResult
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.sequence import Logprob, Sequence, SequenceStatus


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    error: str | None = None
    error_status: int = 400  # 400: the request itself is bad; 500: the engine failed on it
    deadline: float | None = None  # engine clock: past it, the request finishes with "length"
    prompt_logprobs_reported: bool = False  # a DELTA request's prompt logprobs went out

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def attach(self, seqs: list[Sequence], params: SamplingParams, prompt_token_ids: list[int]) -> None:
        """Give a new request's sequences their detokenizers and stop checkers."""
        checkers = StopChecker.for_samples(params, self.tokenizer.eos_token_ids, self.max_model_len, len(seqs))
        for s, checker in zip(seqs, checkers):
            s.detokenizer = make_detokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            s.stop_checker = checker

    def on_token(self, seq: Sequence, token: int) -> StopResult:
        """Detokenize and stop-check `seq`'s newest token (already appended)."""
        res = seq.stop_checker.check(token, seq.detokenizer.add_token(token), len(seq.output_token_ids),
                                     seq.num_tokens)
        self._emit(seq, res.emit)
        if res.finished and res.reason == "length":
            self._emit(seq, seq.detokenizer.flush())  # bytes held back for a character never completed
        return res

    def expire(self, seq: Sequence) -> None:
        """A deadline passed: release what the stop checker and the detokenizer hold back."""
        if seq.pooling is not None:
            return  # an embedding has no text
        self._emit(seq, seq.stop_checker.expire())
        self._emit(seq, seq.detokenizer.flush())

    @staticmethod
    def _emit(seq: Sequence, text: str) -> None:
        # The stop checker holds back anything a stop string could still remove, so text
        # streamed here is never taken back.
        if text:
            seq.text_parts.append(text)

    def make_outputs(self, requests: dict[str, RequestState], touched: set[str]) -> list[RequestOutput]:
        """One output per touched request (none yet for an unfinished FINAL_ONLY one), in
        arrival order; finished requests are dropped from `requests`."""
        outputs = []
        for rid in sorted(touched, key=lambda r: requests[r].seqs[0].seq_id):
            req = requests[rid]
            out = self.make_output(req)
            if out is not None:
                outputs.append(out)
            if req.finished:
                del requests[rid]
        return outputs

    def make_output(self, req: RequestState) -> RequestOutput | EmbeddingRequestOutput | None:
        kind = req.params.output_kind
        lead = req.seqs[0]
        if (kind is RequestOutputKind.FINAL_ONLY or lead.pooling is not None) and not req.finished:
            return None
        m = req.metrics
        m.token_times = lead.token_times  # the sequence's own list: no copy per step
        m.first_scheduled_time = lead.first_scheduled_time
        if req.finished:
            m.finished_time = max((s.finished_time or 0.0) for s in req.seqs)
        if lead.pooling is not None:
            done = lead.status is SequenceStatus.FINISHED_STOPPED and isinstance(lead.pooled, list)
            return EmbeddingRequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                                          EmbeddingOutput(lead.pooled) if done else None, True, m, req.error,
                                          req.error_status)
        comps = [self._completion(s, kind) for s in req.seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, req.finished, m, req.error,
                             req.error_status, prompt_logprobs=self._prompt_logprobs(req, kind),
                             num_cached_tokens=lead.num_cached_tokens or 0)

    @staticmethod
    def _prompt_logprobs(req: RequestState, kind: RequestOutputKind) -> list[dict[int, Logprob] | None] | None:
        """The request's prompt logprobs once all are computed (the list itself: it no longer
        changes); a DELTA request gets them in one output."""
        lps = req.seqs[0].prompt_logprobs
        if lps is None or len(lps) < len(req.prompt_token_ids):
            return None
        if kind is RequestOutputKind.DELTA:
            if req.prompt_logprobs_reported:
                return None
            req.prompt_logprobs_reported = True
        return lps

    @staticmethod
    def _completion(s: Sequence, kind: RequestOutputKind) -> CompletionOutput:
        first = s.num_tokens_reported
        new_ids = s.output_token_ids[first:]
        new_text = "".join(s.text_parts[s.num_text_parts_reported:])
        s.num_tokens_reported = len(s.output_token_ids)
        want_lp = s.params.logprobs is not None
        if kind is RequestOutputKind.DELTA:
            s.text_parts.clear()  # nothing reported is needed again
            text, ids, start = new_text, new_ids, first
        else:
            text = "".join(s.text_parts)
            s.text_parts[:] = [text] if text else []
            ids, start = list(s.output_token_ids), 0
        s.num_text_parts_reported = len(s.text_parts)
        return CompletionOutput(
            index=s.index, text=text, token_ids=ids,
            finish_reason=s.status.value if s.finished else None, stop_reason=s.stop_reason,
            logprobs=s.logprobs[start:] if want_lp else None,
            top_logprobs=s.top_logprobs[start:] if want_lp else None,
            delta_text=new_text, delta_token_ids=new_ids)
