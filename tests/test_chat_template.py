"""Chat templates come from the model (GGUF metadata through the conversion cache, or an HF
folder's tokenizer_config.json / chat_template.jinja), render as transformers renders them, and
fall back to Gemma's turn format; a template that refuses the conversation is a 400."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from kvserve.loading import load_model
from kvserve.loading.hf import read_hf_config
from kvserve.loading.chat_template import (
    DEFAULT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    chat_template_for,
)
from tests.server_harness import live_server, make_engine
from tests.test_gguf_llama import _tiny_llama, write_llama_gguf
from tests.tiny_models import make_model, write_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
            "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_chat")
    make_model("llama", folder)
    return folder


def test_default_template_is_gemmas_turn_format():
    tpl = ChatTemplate(DEFAULT_TEMPLATE, "<bos>", "<eos>", is_default=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert tpl.render(messages) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert not tpl.render(messages, add_generation_prompt=False).endswith("<start_of_turn>model\n")


def test_bundled_gemma_uses_the_default(gemma):
    tpl = chat_template_for(gemma.config, gemma.tokenizer)
    assert gemma.config.chat_template is None and tpl.is_default
    assert tpl.bos_token == "<bos>"
    ids = gemma.tokenizer.encode(tpl.render([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    assert ids[0] == gemma.config.bos_token_id and ids.count(ids[0]) == 1
    assert gemma.tokenizer.token_to_id("<start_of_turn>") in ids  # a special token, not its letters


def _with_files(tmp_path, tiny_folder, **files: str):
    folder = tmp_path / "m"
    shutil.copytree(tiny_folder, folder)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def test_hf_folder_templates(tmp_path, tiny_folder):
    assert read_hf_config(tiny_folder).chat_template is None
    folder = _with_files(tmp_path, tiny_folder, tokenizer_config__json=json.dumps({"chat_template": TEMPLATE}))
    assert read_hf_config(folder).chat_template == TEMPLATE
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert read_hf_config(folder).chat_template == TEMPLATE
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert read_hf_config(folder).chat_template == "{{ messages[0]['content'] }}"  # the newer file wins


def test_template_errors(tmp_path, tiny_folder):
    loaded = load_model(_with_files(tmp_path, tiny_folder, chat_template__jinja=TEMPLATE))
    tpl = chat_template_for(loaded.config, loaded.tokenizer)
    assert tpl.render([{"role": "user", "content": "hi"}]) == "<bos>user: hi\nassistant:"
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tpl.render([{"role": "system", "content": "x"}])
    loaded.config.chat_template = "{% for m in messages %}"  # unterminated: a start-up error
    with pytest.raises(ValueError, match="does not parse"):
        chat_template_for(loaded.config, loaded.tokenizer)


def test_gguf_chat_template_survives_the_conversion_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    write_tokenizer(tmp_path)
    path = tmp_path / "chat.gguf"
    write_llama_gguf(_tiny_llama(), tmp_path / "tokenizer.json", path, "F32", "default", chat_template=TEMPLATE)
    (tmp_path / "tokenizer.json").unlink()
    assert load_model(path).config.chat_template == TEMPLATE  # converted
    (cached,) = (tmp_path / "cache").rglob("config.json")
    assert json.loads(cached.read_text())["chat_template"] == TEMPLATE
    assert load_model(path).config.chat_template == TEMPLATE  # from the cache


def test_server_renders_the_models_template(tmp_path, tiny_folder):
    loaded = load_model(_with_files(tmp_path, tiny_folder, chat_template__jinja=TEMPLATE))
    with live_server(make_engine(loaded, kv_cache_gib=0.01), "tiny") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 3}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        expected = loaded.tokenizer.encode("<bos>user: The quick brown fox\nassistant:", add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        r = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "system", "content": "x"}]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages" and "System role not supported" in err["message"]
