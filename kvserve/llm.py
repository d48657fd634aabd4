"""The offline API: `LLM(model=None, **EngineConfig).generate(prompts, params)`."""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import EmbeddingRequestOutput, RequestOutput
from kvserve.loading import LoadedModel
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_args):
        unknown = set(engine_args) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), loaded=loaded)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the scheduler); outputs in prompt order."""
        prompts = _as_list(prompts)
        plist = _params_list(params, len(prompts))
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not use_tqdm)
        generated = 0
        try:
            for p, sp in zip(prompts, plist):  # inside the try: a bad prompt withdraws the good ones
                ids.append(self.engine.add_request(p, sp))
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    generated += sum(len(c.delta_token_ids) for c in out.outputs)
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                if use_tqdm:
                    bar.set_postfix(tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        except BaseException:
            for rid in ids:  # never leave half-run requests holding KV blocks
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`: `outputs[i].outputs.embedding`), pooled
        as the engine's `pooler_config` says; prompts batch like generate's."""
        prompts = _as_list(prompts)
        plist = _list_of(pooling_params, len(prompts), PoolingParams)
        ids: list[str] = []
        done: dict[str, EmbeddingRequestOutput] = {}
        try:
            for p, pp in zip(prompts, plist):
                ids.append(self.engine.add_request(p, pp))
            while self.engine.has_unfinished():
                done.update((out.request_id, out) for out in self.engine.step() if out.finished)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        for rid in ids:
            if done[rid].error is not None:
                raise RuntimeError(f"embedding request {rid} failed: {done[rid].error}")
        return [done[r] for r in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one prompt, yielding an output (with `delta_text`) after every step."""
        rid = self.engine.add_request(prompt, params)
        try:
            finished = False
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            self.engine.abort(rid)  # no-op when finished; frees blocks if the caller stopped early


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a string, token ids, or a list of them, got {type(prompts).__name__}")
    out = list(prompts)
    if not out:
        raise ValueError("prompts is empty")
    return out


def _params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
    return plist


def _list_of(params, n: int, kind: type) -> list:
    """One params object per prompt: None (defaults), one shared, or one each."""
    if params is None:
        return [kind() for _ in range(n)]
    if isinstance(params, kind):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"got {len(plist)} {kind.__name__} for {n} prompts")
    return plist
