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


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema (`schema` is a pydantic name: aliased)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "is required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise FieldError("json_schema", f"is only allowed when type is 'json_schema', not {self.type!r}")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` extra field: one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


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
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
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
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top-N (not streamed)
    # Prefix-cache isolation (vLLM's field): cached prefixes are shared only among requests with
    # the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* spellings (one constraint per request; kvserve/server/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs", "is not available when stream is true (vLLM's rule)")
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
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "must be >= 1 (0 only with echo: the prompt alone)")
        if self.suffix:
            raise FieldError("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "is not supported (only best_of == n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "is empty")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

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


Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result: which call it answers
    # an assistant turn's reasoning as a response gave it back (--reasoning-parser; vLLM's name and
    # the earlier one), for templates that render it (Qwen3's reads `reasoning_content`)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_content(self):
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"is required for a {self.role!r} message")
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError("tool_calls", f"is only allowed in an 'assistant' message, not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise FieldError("tool_call_id", "is required for a 'tool' message")
        if self.tool_call_id is not None and self.role != "tool":
            raise FieldError("tool_call_id", f"is only allowed in a 'tool' message, not {self.role!r}")
        for name in ("reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise FieldError(name, f"is only allowed in an 'assistant' message, not {self.role!r}")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions: open the assistant's turn; or, with add_generation_prompt false, continue
    # the final message; extra variables for the chat template (e.g. enable_thinking).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
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


class PromptLogprob(BaseModel):
    """vLLM's Logprob on the wire: one entry of `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension, when the request asks for it


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
    content: str | None
    # with --reasoning-parser: the model's reasoning (vLLM's name; reasoning_content, the earlier
    # name that llama.cpp's server uses, holds the same)
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """One streamed piece of a tool call: the first carries id, type and name, the rest
    argument fragments (OpenAI's delta shape)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension, when the request asks for it


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # (as AssistantMessage's)
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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


# ------------------------------------------------------------------------------ tokenize, embeddings
class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: `prompt` (text) or `messages` (rendered by the chat template), not
    both. `add_special_tokens` defaults as vLLM's: True for a prompt, False for messages (the
    template writes BOS itself)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check_input(self):
        if self.prompt is not None and self.messages is not None:
            raise FieldError("messages", "cannot be given with prompt: tokenize one or the other")
        if self.prompt is None and self.messages is None:
            raise FieldError("prompt", "is required (or messages, a conversation)")
        if self.messages is not None and not self.messages:
            raise FieldError("messages", "is empty")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingRequest(_Strict):
    """OpenAI's POST /v1/embeddings: one input or a batch, as text or token ids."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extensions
    normalize: bool | None = None  # None: the server's --pooler-config
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_input(self):
        if isinstance(self.input, list) and not self.input:
            raise FieldError("input", "is empty")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """The input(s) as a batch: a string, a token list, or a list of either."""
        x = self.input
        if isinstance(x, str) or isinstance(x[0], int):
            return [x]
        return list(x)


class Embedding(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
