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
from kvserve.cli import main
from kvserve.loading.chat_template import (
    DEFAULT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    chat_template_for,
    read_chat_template,
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


# A template reading an extra variable, as Qwen3's reads enable_thinking.
THINKING = ("{% if forbid %}{{ raise_exception('forbidden here') }}{% endif %}"
            "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant:' }}{% if enable_thinking %}{{ ' <think>' }}{% endif %}"
            "{% endif %}")
CONVERSATIONS = [[{"role": "user", "content": "The quick brown fox"}],
                 [{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "jumps over "}, {"type": "text", "text": "the"}]},
                  {"role": "assistant", "content": "lazy dog "}]]


@pytest.fixture(scope="module")
def thinking_llm(tiny_folder, tmp_path_factory):
    from kvserve import LLM

    folder = tmp_path_factory.mktemp("thinking")
    shutil.copytree(tiny_folder, folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").write_text(THINKING)
    return LLM(str(folder), kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_folder):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tiny_folder / "tokenizer.json"), bos_token="<bos>",
                                   eos_token="<eos>")


def _hf_render(hf_tokenizer, conversation: list[dict], **kw) -> str:
    """transformers' apply_chat_template over the same template: the rendering oracle."""
    plain = [{"role": "system" if m["role"] == "developer" else m["role"],
              "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
             for m in conversation]
    return hf_tokenizer.apply_chat_template(plain, chat_template=THINKING, tokenize=False, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(chat_template_kwargs={"enable_thinking": True}),
                                dict(add_generation_prompt=False),
                                dict(add_generation_prompt=False, continue_final_message=True)])
def test_llm_chat_renders_as_transformers_and_generates_from_it(thinking_llm, hf_tokenizer, kw):
    from kvserve import SamplingParams

    convs = CONVERSATIONS[1:] if kw.get("continue_final_message") else CONVERSATIONS
    greedy = SamplingParams(temperature=0, max_tokens=4)
    outs = thinking_llm.chat(convs, greedy, **kw)
    hf_kw = {"add_generation_prompt": kw.get("add_generation_prompt", True),
             "continue_final_message": kw.get("continue_final_message", False), **kw.get("chat_template_kwargs", {})}
    for conv, out in zip(convs, outs, strict=True):
        expected = _hf_render(hf_tokenizer, conv, **hf_kw)
        assert out.prompt == expected
        ids = thinking_llm.tokenizer.encode(expected, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.token_ids == thinking_llm.generate([ids], sampling_params=greedy)[0].token_ids
    assert thinking_llm.chat(convs[0], greedy, **kw)[0].token_ids == outs[0].token_ids  # one conversation


def test_llm_chat_with_a_given_template_and_bad_arguments(thinking_llm, tmp_path):
    conv = CONVERSATIONS[0]
    out = thinking_llm.chat(conv, chat_template=TEMPLATE)[0]
    assert out.prompt == "<bos>user: The quick brown fox\nassistant:"
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert thinking_llm.chat(conv, chat_template=str(tmp_path / "t.jinja"))[0].prompt == out.prompt
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        thinking_llm.chat([{"role": "system", "content": "x"}], chat_template=TEMPLATE)
    with pytest.raises(ValueError, match="chat_template /no/such.jinja: no such file"):
        thinking_llm.chat(conv, chat_template="/no/such.jinja")
    bad = {"not a list": ("hi", "messages must be"), "no role": ([{"content": "x"}], r"messages\[0\] must be a dict"),
           "image part": ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\].content"),
           "empty conversation": ([[{"role": "user", "content": "x"}], []], r"messages\[1\] must be a non-empty")}
    for messages, message in bad.values():
        with pytest.raises(ValueError, match=message):
            thinking_llm.chat(messages)
    for kw, message in [(dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages"),
                        (dict(chat_template_kwargs=["x"]), "chat_template_kwargs must be"),
                        (dict(continue_final_message=True), "cannot both be true")]:
        with pytest.raises(ChatTemplateError, match=message):
            thinking_llm.chat(conv, **kw)
    assert thinking_llm.engine.block_manager.num_free_blocks == thinking_llm.engine.num_blocks


def test_server_chat_template_flag_and_kwargs(tmp_path, tiny_folder, thinking_llm, hf_tokenizer):
    """--chat-template replaces the model's template; chat_template_kwargs reach it; the server's
    reply is the offline chat's reply."""
    from kvserve import SamplingParams

    (tmp_path / "t.jinja").write_text(THINKING)
    given = read_chat_template(str(tmp_path / "t.jinja"), "--chat-template")
    conv = CONVERSATIONS[0]
    kwargs = {"enable_thinking": True}
    expected = thinking_llm.chat(conv, SamplingParams(temperature=0, max_tokens=4), chat_template_kwargs=kwargs)[0]
    assert expected.prompt.endswith("assistant: <think>")
    engine = make_engine(load_model(tiny_folder), kv_cache_gib=0.01)  # the model's own: the default template
    with live_server(engine, "tiny", chat_template=given) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": "tiny", "messages": conv, "max_tokens": 4, "temperature": 0}
        r = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text
        ids = hf_tokenizer.encode(_hf_render(hf_tokenizer, conv, add_generation_prompt=True, **kwargs),
                                  add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(ids) == len(expected.prompt_token_ids)
        assert r.json()["choices"][0]["message"]["content"] == expected.text
        # The final assistant message left open (vLLM's continue_final_message), as transformers cuts it.
        conv = [{"role": "user", "content": "jumps over"}, {"role": "assistant", "content": "the lazy"}]
        r = http.post("/v1/chat/completions", json={**body, "messages": conv, "add_generation_prompt": False,
                                                    "continue_final_message": True})
        assert r.status_code == 200, r.text
        ids = hf_tokenizer.encode(_hf_render(hf_tokenizer, conv, continue_final_message=True), add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        bad = {"kwargs not an object": ({"chat_template_kwargs": "x"}, "chat_template_kwargs", None),
               "a reserved variable": ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages",
                                       "set by kvserve"),
               "the template raises": ({"chat_template_kwargs": {"forbid": True}}, "messages",
                                       f"chat template {tmp_path / 't.jinja'} (--chat-template) raised: forbidden"),
               "continue and a generation prompt": ({"continue_final_message": True}, "continue_final_message",
                                                    "add_generation_prompt")}
        for extra, param, message in bad.values():
            r = http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and (message or param) in err["message"], err
        assert srv.wait_pool_full()


def test_chat_template_flag_errors_before_loading(tmp_path, capsys):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    cases = {str(tmp_path / "missing.jinja"): "no such file", str(tmp_path): "a folder, not a file",
             str(tmp_path / "broken.jinja"): "does not parse", "not a template": "no such file"}
    for value, message in cases.items():
        assert main(["serve", "--model", "/no/such/model.gguf", "--chat-template", value]) == 2
        err = capsys.readouterr().err
        assert "--chat-template" in err and message in err and "/no/such/model.gguf" not in err, err
