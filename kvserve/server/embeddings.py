"""POST /v1/embeddings (OpenAI's shape): one vector per input, pooled from the model's final
hidden states as `--pooler-config` says (kvserve/pooling_params.py).

Each input is one engine request (prefill only: it samples nothing and its KV blocks are freed
when it finishes); a batch runs together like a batch of completion prompts.
"""
from __future__ import annotations

import base64
import uuid
from typing import Sequence

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from kvserve.engine.async_engine import RequestStream
from kvserve.engine.outputs import EmbeddingRequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, now
from kvserve.server.state import ServerState
from kvserve.server.streams import collect_finals, submit_each, unless_disconnected


async def create_embedding(state: ServerState, request: Request, req: EmbeddingRequest) -> Response:
    arrival = state.engine.clock()
    state.check_model(req.model)
    inputs = req.inputs
    if len(inputs) > state.limits.max_request_seqs:
        raise APIError(400, f"input has {len(inputs)} items; this server allows at most "
                            f"{state.limits.max_request_seqs} in one request (--max-request-seqs)",
                       "input", "limit_exceeded")
    hidden = state.engine.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        raise APIError(400, f"dimensions must be this model's embedding size {hidden} (it cannot shorten its "
                            f"embeddings), got {req.dimensions}", "dimensions", "invalid_value")
    params = PoolingParams(normalize=req.normalize)
    state.admit(len(inputs))
    batch = not (isinstance(req.input, str) or isinstance(req.input[0], int))  # errors name input[i]
    prompts = [await _tokenize(state, x, req.add_special_tokens, i, batch) for i, x in enumerate(inputs)]
    rid = f"embd-{uuid.uuid4().hex}"
    streams = _submit(state, prompts, params, rid, arrival)
    finals = await unless_disconnected(request, _collect(streams))
    data = [Embedding(index=i, embedding=_encode(out.outputs.embedding, req.encoding_format))
            for i, out in enumerate(finals)]
    num_tokens = sum(len(p) for p in prompts)
    body = EmbeddingResponse(id=rid, created=now(), model=state.model_name, data=data,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
    return Response(body.model_dump_json(), media_type="application/json")


async def _tokenize(state: ServerState, x: str | list[int], add_special_tokens: bool, index: int,
                    batch: bool) -> list[int]:
    """One input as validated token ids that fit the context, a 400 naming it otherwise."""
    param = f"input[{index}]" if batch else "input"
    if not x:
        raise APIError(400, f"{param} is empty", param, "invalid_input")
    ids = await state.engine.encode(x, add_special_tokens) if isinstance(x, str) else x
    vocab = state.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:  # a tokenizer's added tokens past the embedding, or ids sent as such
        raise APIError(400, f"{param} has token id {bad}, outside the vocabulary [0, {vocab})", param,
                       "invalid_input")
    if len(ids) > state.max_model_len:
        raise APIError(400, f"{param} has {len(ids)} tokens; this model's context (max_model_len) is "
                            f"{state.max_model_len}", param, "context_length_exceeded")
    return ids


def _submit(state: ServerState, prompts: list[list[int]], params: PoolingParams, rid: str,
            arrival: float) -> list[RequestStream]:
    return submit_each(prompts, lambda i, ids: state.engine.embed(
        ids, params, f"{rid}-{i}", arrival, deadline=arrival + state.limits.request_timeout))


async def _collect(streams: list[RequestStream]) -> list[EmbeddingRequestOutput]:
    finals = await collect_finals(streams)
    for out in finals:  # a server-side abort (shutdown) ends a request without its embedding
        if not isinstance(out, EmbeddingRequestOutput) or out.outputs is None:
            raise APIError(503, "the request was aborted before its embedding was computed", None, "aborted")
    return finals  # type: ignore[return-value]


def _encode(embedding: Sequence[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the float32 values' little-endian bytes (OpenAI's encoding)."""
    if encoding_format == "float":
        return list(embedding)
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
