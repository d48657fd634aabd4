"""Engine logprobs (token ids -> floats) in the two OpenAI shapes.

The completions API reports parallel lists (tokens, token_logprobs, top_logprobs as
{token: logprob}, text_offset); chat reports one object per token with its bytes and a
sorted top list. Token strings are the token decoded alone (what a client can display).
"""
from __future__ import annotations

from kvserve.engine.outputs import CompletionOutput
from kvserve.loading.tokenizer import Tokenizer
from kvserve.sequence import Logprob
from kvserve.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def delta_logprobs(c: CompletionOutput) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """Logprobs of the tokens new in this output (the engine reports the whole list)."""
    k = len(c.delta_token_ids)
    lps, tops = c.logprobs or [], c.top_logprobs or []
    return (lps[len(lps) - k:], tops[len(tops) - k:]) if k else ([], [])


def _with_sampled(top: dict[int, float] | None, token_id: int, logprob: float | None) -> dict[int, float]:
    """The top alternatives, always including the sampled token (as vLLM reports them)."""
    out = dict(top or {})
    if logprob is not None:
        out.setdefault(token_id, logprob)
    return out


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float | None],
                        top: list[dict[int, float] | None], text_offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    offset = text_offset
    for tid, lp, alts in zip(token_ids, logprobs, top):
        text = token_text(tokenizer, tid)
        result.tokens.append(text)
        result.token_logprobs.append(lp)
        if lp is None and alts is None:  # an echoed prompt's first token: nothing predicts it
            result.top_logprobs.append(None)
        else:
            result.top_logprobs.append({token_text(tokenizer, t): v for t, v in _with_sampled(alts, tid, lp).items()})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float | None, cls: type[TopLogprob] = TopLogprob,
           **extra) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return cls(token=text, logprob=logprob if logprob is not None else float("-inf"),
               bytes=list(text.encode("utf-8")), **extra)


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float | None],
                  top: list[dict[int, float] | None], num_top: int) -> ChatLogprobs:
    content = []
    for tid, lp, alts in zip(token_ids, logprobs, top):
        ranked = sorted((alts or {}).items(), key=lambda kv: -kv[1])[:num_top]
        content.append(_entry(tokenizer, tid, lp, TokenLogprob,
                              top_logprobs=[_entry(tokenizer, t, v) for t, v in ranked]))
    return ChatLogprobs(content=content)


def prompt_logprobs_wire(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """The engine's prompt logprobs as vLLM sends them: per prompt token (None for the first)
    {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                                    for t, lp in e.items()} for e in entries]
