"""Chat messages -> one prompt string, with the model's own chat template.

The template comes from the model: GGUF metadata `tokenizer.chat_template` (kept in the
conversion cache's config.json) or an HF folder's `tokenizer_config.json` / `chat_template.jinja`
(both read into `ModelConfig.chat_template` by the loaders). It is rendered as transformers does:
a sandboxed Jinja environment with `trim_blocks`/`lstrip_blocks`, `raise_exception`, a
`tojson` filter, `bos_token`/`eos_token` and `add_generation_prompt`. The rendered text already
holds the BOS token, so it is tokenized without adding special tokens again.

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
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

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


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles that do not alternate)."""


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
    _env: ImmutableSandboxedEnvironment = field(default_factory=_environment, repr=False)

    @cached_property
    def _compiled(self) -> jinja2.Template:
        return self._env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """Raises ChatTemplateError (a ValueError) when the template cannot render them. `tools`:
        function tools ({"type": "function", "function": {...}}), as apply_chat_template passes them."""
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template failed: {e}") from None
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the model's chat template cannot render these messages: {e}") from None


def chat_template_for(config: ModelConfig, tokenizer: Tokenizer) -> ChatTemplate:
    """The model's template, or DEFAULT_TEMPLATE. Bad template syntax fails here, at start-up."""
    bos = tokenizer.id_to_token(config.bos_token_id) if config.bos_token_id is not None else None
    eos_id = config.eos_token_ids[0] if config.eos_token_ids else None
    eos = tokenizer.id_to_token(eos_id) if eos_id is not None else None
    source = config.chat_template
    tpl = ChatTemplate(source or DEFAULT_TEMPLATE, bos or "", eos or "", is_default=not source)
    try:
        tpl._compiled  # noqa: B018 -- compile now so a broken template is a start-up error
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template does not parse: {e}") from None
    return tpl
