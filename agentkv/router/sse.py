"""Relaying D's answer to the client: SSE chunks as they come, with internal fields removed.

D's transfer handle never reaches a client, and the token ids the router asks D for are only
passed on when the client asked for them. A backend that puts no handle on streams (vLLM 0.32)
is read without streaming and its answer re-streamed in vLLM's chunk format.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["Captured", "clean_response", "rewrite_chunk", "sse", "synthesize_stream"]


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


@dataclass
class Captured:
    """What the router keeps from D's answer."""

    handle: dict[str, Any] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


def _strip(obj: dict[str, Any], keep_ids: bool) -> None:
    if "kv_transfer_params" in obj:
        obj["kv_transfer_params"] = None
    if not keep_ids:
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None
        for choice in obj.get("choices") or []:
            if "token_ids" in choice:
                choice["token_ids"] = None
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None


def rewrite_chunk(chunk: dict[str, Any], captured: Captured, *, keep_ids: bool) -> dict[str, Any]:
    """Record what a streamed chunk carries, then remove what the client must not see."""
    if chunk.get("kv_transfer_params"):
        captured.handle = chunk["kv_transfer_params"]
    if chunk.get("usage"):
        captured.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        if choice.get("token_ids"):
            captured.output_ids.extend(choice["token_ids"])
        if choice.get("finish_reason"):
            captured.finish_reason = choice["finish_reason"]
    _strip(chunk, keep_ids)
    return chunk


def clean_response(body: dict[str, Any], *, keep_ids: bool) -> Captured:
    """Capture a non-streamed answer's handle and ids, and strip them for the client."""
    captured = Captured(handle=body.get("kv_transfer_params"), usage=body.get("usage"))
    choices = body.get("choices") or []
    if choices:
        captured.output_ids = list(choices[0].get("token_ids") or [])
        captured.finish_reason = choices[0].get("finish_reason")
    _strip(body, keep_ids)
    return captured


def synthesize_stream(body: dict[str, Any], *, chat: bool, include_usage: bool) -> Iterator[bytes]:
    """vLLM-style SSE chunks for a complete (already cleaned) response."""
    base = {"id": body.get("id"), "created": body.get("created"), "model": body.get("model")}
    obj = "chat.completion.chunk" if chat else "text_completion"
    choices = body.get("choices") or [{}]
    choice = choices[0]

    def chunk(c: dict[str, Any], **extra: Any) -> bytes:
        return sse({**base, "object": obj, "choices": [c], **extra})

    if chat:
        message = choice.get("message") or {}
        first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        yield chunk(first, prompt_token_ids=body.get("prompt_token_ids"))
        delta: dict[str, Any] = {}
        if message.get("reasoning"):
            delta["reasoning"] = message["reasoning"]
        if message.get("content"):
            delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                dict(call, index=i) for i, call in enumerate(message["tool_calls"])
            ]
        last = {"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}
    else:
        last = {
            "index": 0,
            "text": choice.get("text", ""),
            "finish_reason": choice.get("finish_reason"),
        }
    last["stop_reason"] = choice.get("stop_reason")
    if choice.get("token_ids") is not None:
        last["token_ids"] = choice["token_ids"]
    yield chunk(last)
    if include_usage and body.get("usage"):
        yield sse({**base, "object": obj, "choices": [], "usage": body["usage"]})
    yield sse("[DONE]")
