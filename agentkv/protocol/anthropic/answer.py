"""A Chat Completions answer as the Messages API's (``vllm/entrypoints/anthropic/serving.py``:
``messages_full_converter``, ``message_stream_converter``; ``protocol.py``: the error
vocabulary)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson

from agentkv.protocol.chunks import plain_text

__all__ = ["MessageStream", "chat_to_message", "error_body", "error_type"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    """vLLM's ``translate_error_type``: Anthropic's ``error.type`` for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` (vLLM ``AnthropicErrorResponse``)."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _message_id(chat_id: Any) -> str:
    text = str(chat_id or "")
    for prefix in ("chatcmpl-", "chatcmpl_"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return f"msg_{text or uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """``_build_anthropic_usage``: ``input_tokens`` excludes the cache reads and writes, which
    are present only when the engine reported them."""
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, Any] = {"output_tokens": usage.get("completion_tokens") or 0}
    input_tokens = int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    if (read := details.get("cached_tokens")) is not None:
        input_tokens -= read
        out["cache_read_input_tokens"] = read
    if (created := details.get("created_cache_tokens")) is not None:
        input_tokens -= created
        out["cache_creation_input_tokens"] = created
    return {"input_tokens": max(0, input_tokens), **out}


def _stop_reason(
    finish_reason: str | None, stop_reason: Any, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """``_to_anthropic_stop_reason``: (stop_reason, stop_sequence). ``max_tokens`` always wins;
    a matched stop string wins unless the tool calls are complete."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _reasoning(container: dict[str, Any]) -> str | None:
    value = container.get("reasoning")
    if value is None:
        value = container.get("reasoning_content")
    return value if isinstance(value, str) else None


def chat_to_message(chat: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed Chat Completions answer as an Anthropic message (vLLM's
    ``messages_full_converter``, serialized without ``None`` fields as vLLM does).

    Raises :class:`ValueError` when a tool call's arguments are not a JSON object."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    stop_reason, stop_sequence = _stop_reason(
        choice.get("finish_reason"),
        choice.get("stop_reason"),
        tool_used=bool(calls),
        tool_complete=bool(calls),
    )
    content: list[dict[str, Any]] = []
    if reasoning := _reasoning(message):
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        function = call.get("function") or {}
        arguments = json.loads(function.get("arguments") or "{}")
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call {function.get('name')!r}: arguments are not an object")
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": arguments,
            }
        )
    if not content:
        # Anthropic's shape of an empty completion: one empty text block, never []
        content.append({"type": "text", "text": ""})
    out: dict[str, Any] = {
        "id": _message_id(chat.get("id")),
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": chat.get("model"),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat.get("usage")),
    }
    for name in ("kv_transfer_params", "ec_transfer_params"):
        if chat.get(name) is not None:
            out[name] = chat[name]
    return {k: v for k, v in out.items() if v is not None}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    """One SSE event as Anthropic frames them: ``event: <type>`` and its ``data:``."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# ``content_block_delta`` events, the bulk of a stream, from byte templates: the bytes
# ``_event`` writes for ``{"type": "content_block_delta", "index": i, "delta": {"type": t, f: v}}``
_DELTA_HEAD = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_TEXT = b',"delta":{"type":"text_delta","text":'
_THINKING = b',"delta":{"type":"thinking_delta","thinking":'
_SIGNATURE = b',"delta":{"type":"signature_delta","signature":'
_INPUT_JSON = b',"delta":{"type":"input_json_delta","partial_json":'


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class MessageStream:
    """The chat stream's chunks as Anthropic stream events (vLLM's
    ``message_stream_converter``), one instance per stream.

    ``message_start`` on the first chunk; a content block per run of reasoning (``thinking``,
    closed with a ``signature_delta``), text, or tool call (``input_json_delta``); text that comes
    while a tool call is open is held and sent as its own text block after it; the usage chunk
    gives ``message_delta`` (stop reason, usage); :meth:`done` closes the open block and sends
    ``message_stop``. After :meth:`error`, nothing more is sent (vLLM's stream ends there).
    """

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self.delta_sent = False
        self.finish_reason: str | None = None
        self.stop_sequence: Any = None
        self.tool_used = False
        self.last_tool_args: list[str] = []
        self.tool_ids: dict[int, str] = {}
        self.index = 0
        """The next content block's index."""
        self.block_type: str | None = None
        self.block_index: int | None = None
        self.signature: str | None = None
        self.tool_use_id: str | None = None
        self.pending: list[str] = []

    # -- blocks --------------------------------------------------------------------------------
    def _start(self, block: dict[str, Any]) -> bytes:
        self.block_type, self.block_index = block["type"], self.index
        self.signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        self.tool_use_id = block.get("id") if block["type"] == "tool_use" else None
        return _event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def _delta(self, kind: bytes, value: str) -> bytes:
        """A ``content_block_delta`` of the open block: ``kind`` is one of :data:`_DELTAS`."""
        index = self.block_index if self.block_index is not None else self.index
        return _DELTA_HEAD + str(index).encode() + kind + orjson.dumps(value) + b"}}\n\n"

    def _stop(self) -> list[bytes]:
        """``stop_active_block``: the thinking block's signature, then its stop."""
        if self.block_type is None:
            return []
        out = []
        if self.block_type == "thinking" and self.signature is not None:
            out.append(self._delta(_SIGNATURE, self.signature))
        out.append(
            _event("content_block_stop", {"type": "content_block_stop", "index": self.block_index})
        )
        self.block_type = self.block_index = self.signature = self.tool_use_id = None
        self.pending.clear()
        self.index += 1
        return out

    def _stop_and_flush(self) -> list[bytes]:
        """``stop_and_flush``: close the open block, then send the held text as its own."""
        held = "".join(self.pending)
        self.pending.clear()
        out = self._stop()
        if held:
            out.append(self._start({"type": "text", "text": ""}))
            out.append(self._delta(_TEXT, held))
            out.extend(self._stop())
        return out

    # -- the stream ----------------------------------------------------------------------------
    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events for one chat completion chunk."""
        if self.ended:
            return []
        if self.block_type == "text":  # the common chunk: one more token of an open text block
            text = plain_text(chunk)
            if text is not None:
                return [self._delta(_TEXT, text)]
        out: list[bytes] = []
        if not self.started:
            self.started = True
            message: dict[str, Any] = {
                "id": _message_id(chunk.get("id")),
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": chunk.get("model"),
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(chunk.get("usage")),
            }
            out.append(_event("message_start", {"type": "message_start", "message": message}))
        choices = chunk.get("choices") or []
        if not choices:
            if chunk.get("usage") is not None:  # the usage chunk: the end of the message
                out.extend(self._stop_and_flush())
                out.append(self._message_delta(chunk.get("usage")))
            return out
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_sequence = choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if reasoning := _reasoning(delta):
            if self.block_type != "thinking":
                out.extend(self._stop_and_flush())
                out.append(self._start({"type": "thinking", "thinking": ""}))
            out.append(self._delta(_THINKING, reasoning))
        if text := delta.get("content"):
            if self.block_type == "tool_use":
                self.pending.append(text)
            else:
                if self.block_type != "text":
                    out.extend(self._stop_and_flush())
                    out.append(self._start({"type": "text", "text": ""}))
                out.append(self._delta(_TEXT, text))
        for call in delta.get("tool_calls") or []:
            out.extend(self._tool_call(call))
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        function = call.get("function") or {}
        arguments = function.get("arguments")
        call_id = call.get("id")
        if call_id is not None:
            self.tool_ids[call.get("index", 0)] = call_id
            name = function.get("name")
            if self.tool_use_id != call_id and name is not None:
                out.extend(self._stop_and_flush())
                self.tool_used = True
                self.last_tool_args = []
                out.append(
                    self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}})
                )
        else:
            call_id = self.tool_ids.get(call.get("index", 0))
        if call_id is not None and arguments and self.tool_use_id == call_id:
            self.last_tool_args.append(arguments)
            out.append(self._delta(_INPUT_JSON, arguments))
        return out

    def _message_delta(self, usage: dict[str, Any] | None) -> bytes:
        self.delta_sent = True
        stop_reason, stop_sequence = _stop_reason(
            self.finish_reason or "stop",
            self.stop_sequence,
            tool_used=self.tool_used,
            tool_complete=self.tool_used and _is_json("".join(self.last_tool_args)),
        )
        return _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": _usage(usage),
            },
        )

    def done(self) -> list[bytes]:
        """The end of the chat stream: the open block closed, ``message_stop``. (Without a
        usage chunk, which vLLM always asks for, a ``message_delta`` without usage first.)"""
        if self.ended:
            return []
        out = [] if self.started else self.chunk({})
        out.extend(self._stop_and_flush())
        if not self.delta_sent:
            out.append(self._message_delta(None))
        out.append(_event("message_stop", {"type": "message_stop"}))
        self.ended = True
        return out

    def error(self, status: int, message: str) -> list[bytes]:
        """An error in the middle of the stream: the open block closed, an ``error`` event,
        and the stream ends."""
        if self.ended:
            return []
        out = self._stop()
        out.append(_event("error", error_body(status, message)))
        self.ended = True
        return out
