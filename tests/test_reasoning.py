"""Reasoning apart from the answer (`--reasoning-parser`, kvserve/reasoning.py): the splitter on
its own (any chunking of a stream gives the whole text's split), then a live server over a tiny
Qwen2 whose output a regex forces, whole and streamed, with tool calls parsed from the content."""
from __future__ import annotations

import time

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.loading import load_model
from kvserve.reasoning import ReasoningSplitter, opens_reasoning
from tests.server_harness import live_server, make_engine
from tests.test_tool_calls import HERMES_TEMPLATE, TOOLS, USER
from tests.tiny_models import make_model

MODEL = "tiny-thinker"


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nstep 1\n</think>\n\nParis.", False, "\nstep 1\n", "\n\nParis."),
    ("step 1</think>Paris.", True, "step 1", "Paris."),  # the prompt opened the block
    ("<think>again</think>Paris.", True, "again", "Paris."),  # a leading tag is dropped either way
    ("Paris.", False, "", "Paris."),
    ("Paris. <think>no</think>", False, "", "Paris. <think>no</think>"),  # not at the start: content
    ("<think>ran out of tokens", False, "ran out of tokens", ""),
    ("ran out", True, "ran out", ""),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # one block
    ("<thin", False, "", "<thin"),  # an unfinished tag is text
    ("", True, "", ""),
    ("<th", True, "<th", ""),
])
def test_split(text, opened, reasoning, content):
    assert ReasoningSplitter(in_reasoning=opened).split(text) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(["<", "/", "think", ">", "<think>", "</think>", "a", " ", "\n", "<th"]),
                    max_size=30).map("".join),
       opened=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_in_any_pieces_splits_as_the_whole_text(text, opened, cuts):
    whole = ReasoningSplitter(in_reasoning=opened)
    want = whole.split(text)
    splitter = ReasoningSplitter(in_reasoning=opened)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    got = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [splitter.finish()]
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want
    assert splitter.saw_reasoning == whole.saw_reasoning
    assert "".join(r + c for r, c in got) in (text, text.replace("<think>", "", 1).replace("</think>", "", 1),
                                             text.replace("</think>", "", 1), text.replace("<think>", "", 1))


def test_a_prompt_opens_reasoning_when_it_ends_in_the_tag():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking turned off
    assert not opens_reasoning("<|im_start|>assistant\n")


# A Hermes template whose generation prompt opens a reasoning block when asked (as a thinking
# model's template does), through chat_template_kwargs.
THINKING_TEMPLATE = HERMES_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                            "<|im_start|>assistant\n{% if open_think %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    assert THINKING_TEMPLATE != HERMES_TEMPLATE
    folder = tmp_path_factory.mktemp("tiny-qwen2-thinker")
    make_model("qwen2", folder, max_position_embeddings=4096)
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    engine = make_engine(load_model(folder), kv_cache_gib=0.05, max_model_len=4096, reasoning_parser="qwen3")
    with live_server(engine, MODEL) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _forced(regex: str, **kw) -> dict:
    """A request whose output the regex forces (the tiny model's own text is noise)."""
    return dict(model=MODEL, messages=USER, temperature=1.0, seed=3, max_tokens=kw.pop("max_tokens", 120),
                extra_body={"structured_outputs": {"regex": regex}, **kw.pop("extra_body", {})}, **kw)


def _streamed(stream) -> tuple[str, str, dict, str | None]:
    """(reasoning, content, {index: [name, arguments]}, finish_reason) reassembled from the chunks;
    `reasoning` and `reasoning_content` must agree."""
    reasoning = content = ""
    calls: dict[int, list] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, [None, ""])
                entry[0] = d.function.name or entry[0]
                entry[1] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_and_content_come_apart_whole_and_streamed(thinker):
    kw = _forced(r"<think>\nThe user asks about [a-z]{3,8}\.\n</think>\n\nIt is [a-z]{2,6}\.")
    whole = thinker.chat.completions.create(**kw).choices[0]
    extra = whole.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"]
    assert extra["reasoning"].startswith("\nThe user asks about ") and extra["reasoning"].endswith(".\n")
    assert whole.message.content.startswith("\n\nIt is ") and "think>" not in whole.message.content
    reasoning, content, calls, finish = _streamed(thinker.chat.completions.create(**kw, stream=True))
    assert (reasoning, content, calls, finish) == (extra["reasoning"], whole.message.content, {}, whole.finish_reason)


def test_a_block_the_template_opened_holds_the_output_until_its_end_tag(thinker):
    """The prompt ends in <think>: the tiny model's noise, which never closes the block, is all
    reasoning; without the open block the same request is all content."""
    kw = dict(model=MODEL, messages=USER, temperature=1.0, seed=7, max_tokens=6)
    opened = dict(extra_body={"chat_template_kwargs": {"open_think": True}})
    whole = thinker.chat.completions.create(**kw, **opened).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert whole.message.model_extra["reasoning"] and "</think>" not in whole.message.model_extra["reasoning"]
    assert _streamed(thinker.chat.completions.create(**kw, **opened, stream=True)) == \
        (whole.message.model_extra["reasoning"], "", {}, "length")
    plain = thinker.chat.completions.create(**kw).choices[0]
    assert plain.message.content and plain.message.model_extra.get("reasoning") is None


def test_plain_answers_carry_no_reasoning(thinker):
    kw = _forced(r"It is [a-z]{2,6}\.")
    whole = thinker.chat.completions.create(**kw).choices[0]
    assert whole.message.content.startswith("It is ") and whole.message.model_extra.get("reasoning") is None
    reasoning, content, _, _ = _streamed(thinker.chat.completions.create(**kw, stream=True))
    assert (reasoning, content) == ("", whole.message.content)


def test_tool_calls_are_parsed_from_the_content_alone(thinker):
    """A call written inside the reasoning is thought, not a call; the one after it is the call."""
    regex = (r'<think>\nMaybe <tool_call>\n\{"name": "get_time", "arguments": \{"zone": 1\}\}\n</tool_call>\n'
             r'</think>\n\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}", "unit": "c"\}\}'
             r'\n</tool_call>')
    kw = _forced(regex, tools=TOOLS, max_tokens=400)
    whole = thinker.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and "get_time" in whole.message.model_extra["reasoning"]
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    assert not (whole.message.content or "").strip()
    reasoning, content, calls, finish = _streamed(thinker.chat.completions.create(**kw, stream=True))
    assert reasoning == whole.message.model_extra["reasoning"] and finish == "tool_calls"
    assert [(n, a) for n, a in calls.values()] == [("get_weather", whole.message.tool_calls[0].function.arguments)]


def test_a_json_schema_comes_after_the_reasoning_the_template_opened(thinker):
    """A constrained request whose template opened a block thinks unconstrained (the engine starts
    its grammar after </think>): the tiny model never closes the block, so its noise is all
    reasoning. Without the open block the grammar shapes the answer from its first token."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0, seed=1,
              response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    r = thinker.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"open_think": True}}).choices[0]
    assert r.message.content is None and r.message.model_extra["reasoning"] and r.finish_reason == "length"
    r = thinker.chat.completions.create(**{**kw, "max_tokens": 60}).choices[0]
    assert r.message.content.startswith("{") and r.message.model_extra.get("reasoning") is None


def test_an_unknown_parser_is_refused_by_name():
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="granite")


def test_the_flag_offers_the_parsers():
    import kvserve.cli as cli

    assert cli.build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert cli.build_parser().parse_args(["serve"]).reasoning_parser is None


def test_reasoning_given_back_is_accepted_on_assistant_turns_only(thinker):
    turn = {"role": "assistant", "content": "It is sunny.", "reasoning": "The user asks about Paris."}
    r = thinker.chat.completions.create(model=MODEL, messages=[*USER, turn, {"role": "user", "content": "And?"}],
                                        max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    for name in ("reasoning", "reasoning_content"):
        with pytest.raises(openai.BadRequestError, match=rf"messages\[0\]\.{name}"):
            thinker.chat.completions.create(model=MODEL, messages=[{**USER[0], name: "x"}], max_tokens=2)
    from kvserve.server.protocol import ChatMessage
    from kvserve.server.tools import message_dict

    # Templates read an earlier turn's reasoning as `reasoning_content` (Qwen3's does).
    assert message_dict(ChatMessage(**turn))["reasoning_content"] == turn["reasoning"]
    assert message_dict(ChatMessage(role="assistant", content="a", reasoning_content="r"))["reasoning_content"] == "r"
    assert "reasoning_content" not in message_dict(ChatMessage(role="assistant", content="a"))


def _scripted(eos_token_ids, script):
    """A sampler that draws the given tokens in turn (whatever the logits), noting at each call
    whether the row came with a grammar."""
    from kvserve.sampling import Sampler, SamplerOutput

    class Scripted(Sampler):
        def __call__(self, logits, requests):
            self.with_grammar.append(requests[0].grammar is not None)
            return SamplerOutput(token_ids=[self.script.pop(0)], logprobs=[None], top_logprobs=[None])

    sampler = Scripted(eos_token_ids)
    sampler.script, sampler.with_grammar = list(script), []
    return sampler


def test_the_engine_starts_a_thinking_requests_grammar_after_the_end_tag(tmp_path, monkeypatch):
    """Under a reasoning parser a constrained request whose prompt opens a block samples without
    its grammar up to and including the tokens of </think>, then under it (a token the grammar
    forbids would fail the request); a prompt that opens none has its grammar from the first token."""
    from kvserve import LLM, SamplingParams
    from kvserve.sampling_params import StructuredOutputsParams

    make_model("qwen2", tmp_path)
    llm = LLM(loaded=load_model(tmp_path), kv_cache_gib=0.05, reasoning_parser="qwen3")
    tok = llm.tokenizer
    thought, end, answer = (tok.encode(t, add_special_tokens=False) for t in (" hmm, ok", "</think>", "ok"))
    eos = tok.eos_token_ids[0]
    params = SamplingParams(temperature=1.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="ok"))
    prompt = tok.encode("Question?<think>\n", add_special_tokens=False)
    assert opens_reasoning(tok.decode(prompt, skip_special_tokens=False))
    llm.engine.sampler = _scripted(tok.eos_token_ids, thought + end + answer + [eos])
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == thought + end + answer + [eos] and out.finish_reason == "stop"
    assert llm.engine.sampler.with_grammar == [False] * len(thought + end) + [True] * (len(answer) + 1)
    assert ReasoningSplitter(in_reasoning=True).split(out.text) == (tok.decode(thought), "ok")
    llm.engine.sampler = _scripted(tok.eos_token_ids, answer + [eos])
    out = llm.generate([tok.encode("Question?", add_special_tokens=False)], params)[0].outputs[0]
    assert out.text == "ok" and llm.engine.sampler.with_grammar == [True] * (len(answer) + 1)
    plain = LLM(loaded=load_model(tmp_path), kv_cache_gib=0.05)
    plain.engine.sampler = _scripted(tok.eos_token_ids, thought + [eos])  # without the parser: masked at once
    failed = plain.generate([prompt], params)[0]
    assert plain.engine.sampler.with_grammar[0] is True and failed.error
    # Multi-step decoding reserves no run for a thinking request: a run past </think> would hold
    # tokens its grammar never masked.
    from kvserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "_cuda_graphs_apply", lambda self: self._cuda_graphs_fit())  # the CPU stand-in
    # Nor do drafts: their verification past </think> would not be under the grammar.
    greedy = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="ok"))
    for cfg in (dict(num_scheduler_steps=4), dict(speculative="ngram", num_speculative_tokens=3)):
        multi = LLM(loaded=load_model(tmp_path), kv_cache_gib=0.05, reasoning_parser="qwen3", **cfg)
        seq = None
        rid = multi.engine.add_request(prompt, greedy)
        for _ in range(200):
            multi.engine.step()
            seq = multi.engine.requests[rid].seqs[0]
            if seq.reasoning_grammar is not None:
                break
            time.sleep(0.01)  # (the grammar compiles beside the step loop)
        assert seq.reasoning_grammar is not None and seq.grammar is None
        assert multi.engine._lookahead(seq) == 0
        if "speculative" in cfg:  # under its grammar, after </think>: drafts
            seq.grammar, seq.reasoning_grammar = seq.reasoning_grammar, None
        else:  # as a plain greedy request: a run of 4
            seq.reasoning_grammar = None
        assert multi.engine._lookahead(seq) == 3
