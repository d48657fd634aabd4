"""The offline API, vLLM's: `LLM(model=None, **EngineConfig)`, then
`.generate(prompts, sampling_params)` or `.chat(messages, sampling_params)`."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from typing import Any, Iterable, Iterator, Sequence

from tqdm import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import EmbeddingRequestOutput, RequestOutput
from kvserve.loading import LoadedModel
from kvserve.loading.chat_template import ChatTemplate, chat_template_for, read_chat_template
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = Mapping[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_args):
        unknown = set(engine_args) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), loaded=loaded)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op for one process)."""
        self.engine.close()

    @cached_property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (or the default turn format), as the server renders it."""
        return chat_template_for(self.engine.model_config, self.tokenizer)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion (batched by the scheduler); outputs in prompt order.
        `sampling_params`: one for all prompts, or one per prompt (default: SamplingParams())."""
        prompts = _as_list(prompts)
        plist = [_final_only(sp) for sp in _list_of(sampling_params, len(prompts), SamplingParams)]
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

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI-style messages) or to a list of
        them, each rendered with the model's chat template as `kvserve serve` renders it.
        `chat_template`: a template (or a template file) instead of the model's;
        `chat_template_kwargs`: extra template variables (e.g. enable_thinking). Each output's
        `prompt` is the rendered text."""
        template = self.chat_template
        if chat_template is not None:
            template = chat_template_for(self.engine.model_config, self.tokenizer,
                                         read_chat_template(chat_template, "chat_template"))
        texts = [template.render(conv, add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, template_kwargs=chat_template_kwargs)
                 for conv in _conversations(messages)]
        # The rendered text holds its BOS already: tokenized without special tokens, as the server does.
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        for i, t in enumerate(ids):
            if not t:
                raise ValueError(f"messages: conversation {i} renders to an empty prompt")
        outputs = self.generate(ids, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

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


def _conversations(messages) -> list[list[dict]]:
    """One conversation (a list of messages) or a list of them, as plain message dicts."""
    if not _is_list(messages) or not messages:
        raise ValueError("messages must be a non-empty list of messages (dicts with 'role' and 'content'), or a "
                         "list of such lists")
    single = isinstance(messages[0], Mapping)
    convs = [messages] if single else list(messages)
    out = []
    for i, conv in enumerate(convs):
        where = "messages" if single else f"messages[{i}]"
        if not _is_list(conv) or not conv:
            raise ValueError(f"{where} must be a non-empty list of messages, got {type(conv).__name__}")
        out.append([_message(m, f"{where}[{j}]") for j, m in enumerate(conv)])
    return out


def _is_list(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _message(m, where: str) -> dict:
    """An OpenAI-style message as the template sees it: text parts joined into one string,
    "developer" (OpenAI's newer name) as "system"; other keys kept as given."""
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise ValueError(f"{where} must be a dict with a string 'role', got {m!r:.80}")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    role = "system" if m["role"] == "developer" else m["role"]
    return {**m, "role": role, "content": content if content is not None else ""}


def _final_only(params: SamplingParams) -> SamplingParams:
    """A request `generate` runs to the end: outputs only when it finishes (vLLM's LLM does the
    same), so no step builds a cumulative output nobody reads. A DELTA request keeps its kind."""
    if isinstance(params, SamplingParams) and params.output_kind is RequestOutputKind.CUMULATIVE:
        return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params


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
