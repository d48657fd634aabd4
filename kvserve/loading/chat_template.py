"""Chat messages -> one prompt string, with the model's own chat template.

The template comes from the model: GGUF metadata `tokenizer.chat_template` (kept in the
conversion cache's config.json) or an HF folder's `tokenizer_config.json` / `chat_template.jinja`
(both read into `ModelConfig.chat_template` by the loaders), unless one is given instead
(`kvserve serve --chat-template`, `LLM.chat(chat_template=...)`: a file or the template itself).
It is rendered as transformers does: a sandboxed Jinja environment with `trim_blocks`/
`lstrip_blocks`, `raise_exception`, a `tojson` filter, `bos_token`/`eos_token`,
`add_generation_prompt` and the caller's extra variables (`chat_template_kwargs`, e.g.
`enable_thinking`). The rendered text already holds the BOS token, so it is tokenized without
adding special tokens again. `continue_final_message` cuts the text after the last message's
content, leaving that message open for the model to continue (transformers' definition).

A model without a template gets DEFAULT_TEMPLATE, Gemma's turn format: the bundled Gemma 3
270M GGUF carries none, and a base model prompted this way still produces sensible text:

    <bos><start_of_turn>user
    {system}\\n\\n{user}<end_of_turn>
    <start_of_turn>model
    {assistant}<end_of_turn>
    <start_of_turn>model
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.loading.tokenizer import Tokenizer
from kvserve.model.config import ModelConfig

DEFAULT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') + m['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


MODEL_TEMPLATE = "the model's chat template"
# Variables render() sets itself; chat_template_kwargs may not replace them.
RESERVED_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles that do not alternate), or the request's
    template arguments are wrong; `field` is the request field to blame."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TemplateSource:
    """A chat template given instead of the model's, and how errors name it."""

    text: str
    origin: str


def read_chat_template(value: str, flag: str = "chat_template") -> TemplateSource:
    """A template file, or (as vLLM accepts) the template itself when `value` holds Jinja
    delimiters, checked to parse; else a ValueError naming `flag`."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            given = TemplateSource(path.read_text(encoding="utf-8"), f"chat template {path} ({flag})")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {value}: cannot be read ({type(e).__name__}: {e})") from None
    elif "{{" in value or "{%" in value:
        given = TemplateSource(value, f"the chat template given as {flag}")
    else:
        what = "a folder, not a file" if path.is_dir() else "no such file"
        raise ValueError(f"{flag} {value}: {what} (give a Jinja template file, or the template itself)")
    try:
        _environment().parse(given.text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{given.origin} does not parse: {e}") from None
    return given


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    is_default: bool = False
    origin: str = MODEL_TEMPLATE  # how errors name this template
    _env: ImmutableSandboxedEnvironment = field(default_factory=_environment, repr=False)

    @cached_property
    def _compiled(self) -> jinja2.Template:
        return self._env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: Mapping[str, Any] | None = None, tools: list[dict] | None = None) -> str:
        """Raises ChatTemplateError (a ValueError) when the template cannot render them, or the
        arguments contradict each other. `tools`: function tools ({"type": "function",
        "function": {...}}), as apply_chat_template passes them."""
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true (set "
                                    "add_generation_prompt to false to continue the final message)",
                                    "continue_final_message")
        variables = _template_kwargs(template_kwargs)
        try:
            text = self._compiled.render(**variables, messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.origin} raised: {e}", e.field) from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.origin} failed: {e}") from None
        except (TypeError, KeyError, IndexError, AttributeError, ValueError, ArithmeticError) as e:
            raise ChatTemplateError(f"{self.origin} cannot render these messages: {type(e).__name__}: {e}") from None
        return self._open_final_message(text, messages) if continue_final_message else text

    def _open_final_message(self, text: str, messages: list[dict]) -> str:
        """The rendered text cut right after the final message's content (transformers' rule:
        the content's last occurrence, its trailing whitespace kept only if rendered verbatim)."""
        content = messages[-1].get("content") if messages else None
        if not isinstance(content, str) or not content.strip():
            raise ChatTemplateError("continue_final_message needs a final message with text to continue",
                                    "continue_final_message")
        at = text.rfind(content.strip())
        if at < 0:
            raise ChatTemplateError(f"{self.origin} does not render the final message's text as given, so it cannot "
                                    f"be continued (continue_final_message)", "continue_final_message")
        kept = content.lstrip() if text.startswith(content.lstrip(), at) else content.strip()
        return text[:at + len(kept)]


def _template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The caller's extra template variables, checked: string names, none that render() sets."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ChatTemplateError(f"chat_template_kwargs must be an object of template variables, got "
                                f"{type(kwargs).__name__}", "chat_template_kwargs")
    for name in kwargs:
        if not isinstance(name, str):
            raise ChatTemplateError(f"chat_template_kwargs: variable names must be strings, got {name!r}",
                                    "chat_template_kwargs")
        if name in RESERVED_VARIABLES:
            raise ChatTemplateError(f"chat_template_kwargs.{name}: set by kvserve itself, not a template argument "
                                    f"(reserved: {', '.join(RESERVED_VARIABLES)})", f"chat_template_kwargs.{name}")
    return dict(kwargs)


def chat_template_for(config: ModelConfig, tokenizer: Tokenizer, given: TemplateSource | None = None) -> ChatTemplate:
    """`given`, else the model's template, else DEFAULT_TEMPLATE. Bad template syntax fails here,
    at start-up."""
    bos = tokenizer.id_to_token(config.bos_token_id) if config.bos_token_id is not None else None
    eos_id = config.eos_token_ids[0] if config.eos_token_ids else None
    eos = tokenizer.id_to_token(eos_id) if eos_id is not None else None
    if given is not None:
        tpl = ChatTemplate(given.text, bos or "", eos or "", origin=given.origin)
    else:
        source = config.chat_template
        tpl = ChatTemplate(source or DEFAULT_TEMPLATE, bos or "", eos or "", is_default=not source)
    try:
        tpl._compiled  # noqa: B018 -- compile now so a broken template is a start-up error
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{tpl.origin} does not parse: {e}") from None
    return tpl
