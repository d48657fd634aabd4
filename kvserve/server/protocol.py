"""OpenAI wire format: request and response models (pydantic v2), OpenAI's field names.

Types are strict: they are not coerced (`"max_tokens": "5"` is a mistake, not a 5). Fields no
model declares (`store`, `metadata`, a newer SDK's parameters, a typo such as `max_token`) are
kept aside as the model's extras: the server ignores them with a warning naming them, as vLLM
does, or refuses them with a 400 under `--strict-requests` (kvserve/server/body.py,
`unknown_fields`). Fields OpenAI defines that we cannot honour are declared and accepted only at
their neutral value, so a client gets a 400 naming the field rather than a response that ignored
it. vLLM's sampling extensions (`top_k`, `min_p`, `ignore_eos`, ...) are accepted as in vLLM.

Value ranges that are OpenAI's own (temperature <= 2, n <= 128) live here; the rest of the
sampling validation is SamplingParams' (one definition, one message per field).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT64 = 2**63


class FieldError(ValueError):
    """A cross-field check failed; `field` is what the error response's `param` names."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


class _Strict(BaseModel):
    # Strict types; undeclared fields kept in `model_extra` for the unknown-field policy.
    model_config = ConfigDict(extra="allow", strict=True)


def unknown_fields(model: BaseModel, path: str = "") -> list[str]:
    """The fields of a validated request that no model declares, as error `param` paths
    (`store`, `messages[0].mood`): the model's own extras, then its nested models'."""
    found = [_join(path, name) for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        found += _unknown_in(getattr(model, name), _join(path, name))
    return found


def _unknown_in(value: object, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, path)
    # Only lists of models (or of lists) can hold models: a list of token ids is not walked.
    if isinstance(value, list) and value and isinstance(value[0], (BaseModel, list)):
        return [p for i, v in enumerate(value) for p in _unknown_in(v, f"{path}[{i}]")]
    return []


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model (vLLM accepts that too)
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, le=INT64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for abuse tracking: accepted, unused
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Prefix-cache isolation (vLLM's field): cached prefixes are shared only among requests with
    # the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "is only allowed when stream is true")
        if self.logit_bias:
            raise FieldError("logit_bias", "is not supported")
        return self


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top-N alternatives per token (0: the sampled token only)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.echo:
            raise FieldError("echo", "is not supported")
        if self.suffix:
            raise FieldError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "is not supported (only best_of == n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "is empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a batch: a string, a token list, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant"]


class ChatMessage(_Strict):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_content(self):
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"is required for a {self.role!r} message")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions: open the assistant's turn; or, with add_generation_prompt false, continue
    # the final message; extra variables for the chat template (e.g. enable_thinking).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.tools:
            raise FieldError("tools", "is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ------------------------------------------------------------------------------ responses
def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
