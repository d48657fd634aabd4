"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Evaluation clients count and cut prompts with the server's own tokenizer through these (lm-
evaluation-harness's `tokenizer_backend=remote`, which it picks by itself when /tokenizer_info and
/tokenize answer), so the ids are exactly those the engine would compute.
"""
from __future__ import annotations

import asyncio

from kvserve.server.chat import render_messages
from kvserve.server.errors import APIError
from kvserve.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.server.state import ServerState

OFF_LOOP_TOKENS = 8192  # longer token lists are decoded in a worker thread


async def tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    state.check_model(req.model)
    if req.prompt is not None:
        text, special = req.prompt, True if req.add_special_tokens is None else req.add_special_tokens
    else:  # the conversation as the chat route renders it (the template writes BOS itself)
        chat = ChatCompletionRequest.model_construct(messages=req.messages,
                                                     add_generation_prompt=req.add_generation_prompt)
        text, special = await asyncio.to_thread(render_messages, state, chat), bool(req.add_special_tokens)
    ids = await state.engine.encode(text, special)
    strs = [state.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(state: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(req.model)
    vocab = state.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}] is {req.tokens[bad]}, outside the vocabulary [0, {vocab})",
                       f"tokens[{bad}]", "invalid_value")
    # Special tokens kept: the text must tokenize back to the same ids.
    decode = state.tokenizer.decode
    if len(req.tokens) > OFF_LOOP_TOKENS:
        return DetokenizeResponse(prompt=await asyncio.to_thread(decode, req.tokens, False))
    return DetokenizeResponse(prompt=decode(req.tokens, False))


def tokenizer_info(state: ServerState) -> dict:
    """The tokenizer's configuration, as vLLM's endpoint gives it (its special tokens, the chat
    template, the context length)."""
    tpl = state.chat_template
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tpl.bos_token or None,
        "eos_token": tpl.eos_token or None,
        "pad_token": None,
        "chat_template": None if tpl.is_default else tpl.source,
        "model_max_length": state.max_model_len,
    }
