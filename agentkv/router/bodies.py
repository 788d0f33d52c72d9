"""What the router writes for a turn, pure: P's and D's request bodies, and a whole answer of D
as the client's response (re-streamed when the client asked for a stream)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import Response, StreamingResponse

from agentkv.protocol.http import ORJSONResponse
from agentkv.router import turn as core
from agentkv.router.request import ClientRequest, wire_ids
from agentkv.router.sse import aiter_chunks, synthesize_stream

__all__ = ["answer_response", "decode_body", "prefill_body"]


def prefill_body(req: ClientRequest, action: core.Prefill) -> dict[str, Any]:
    """P's ``/v1/completions`` body: the prompt's ids, one token, the turn's transfer params,
    and the client's model, salt and priority."""
    body: dict[str, Any] = {
        "prompt": wire_ids(action.prompt),
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": action.params,
    }
    for key in ("model", "cache_salt", "priority"):
        if key in req.body:
            body[key] = req.body[key]
    return body


def decode_body(req: ClientRequest, action: core.Decode, *, relay: bool) -> dict[str, Any]:
    """D's body: the client's, with the prompt's ids and the transfer params; not streamed
    unless the router relays D's stream as it comes."""
    ids = action.remember.prompt.prompt
    body = req.copy_body()
    if req.chat:
        body["kv_transfer_params"] = dict(action.params, prompt_token_ids=wire_ids(ids))
    else:
        body["prompt"] = wire_ids(ids)
        body["kv_transfer_params"] = action.params
    body["return_token_ids"] = True
    if not relay:
        body["stream"] = False
        body.pop("stream_options", None)
    return body


def answer_response(
    req: ClientRequest, data: dict[str, Any], headers: Mapping[str, str]
) -> Response:
    """D's whole answer as the client asked for it: as it is, or re-streamed."""
    if not req.stream:
        return ORJSONResponse(data, headers=dict(headers))
    opts = req.body.get("stream_options") or {}
    chunks = synthesize_stream(data, chat=req.chat, include_usage=bool(opts.get("include_usage")))
    return StreamingResponse(
        aiter_chunks(chunks), media_type="text/event-stream", headers=dict(headers)
    )
