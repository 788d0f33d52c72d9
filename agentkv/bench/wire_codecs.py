"""The three APIs a client that knows nothing of agentkv speaks (:mod:`agentkv.bench.wire` says
what each sends): Chat Completions, Anthropic Messages and OpenAI Responses, each a
:class:`~agentkv.bench.wire.Codec` that writes a request from the neutral history and reads its
streamed answer back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentkv.bench.wire import (
    TOOL_CALL,
    Answer,
    Codec,
    Message,
    RawClientName,
    Stream,
    ToolCall,
    Turn,
    WireError,
    chat_tool_calls,
)
from agentkv.protocol import (
    BODY_SIM_SCRIPT,
    HEADER_CLAUDE_CODE_SESSION_ID,
    HEADER_SESSION_ID,
)
from agentkv.protocol.deltas import DeltaFold

__all__ = ["ChatCodec", "MessagesCodec", "ResponsesCodec", "codec_for"]

_TOOL_DESCRIPTION = "Run a shell command."
_TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}
_ANTHROPIC_VERSION = "2023-06-01"


def _error(data: Any) -> WireError:
    err = data.get("error") if isinstance(data, dict) else None
    return WireError(json.dumps(err if err is not None else data)[:300])


def _system(history: Sequence[Message]) -> tuple[str | None, list[Message]]:
    """The leading system message's text (Messages' ``system``, Responses' ``instructions``)
    and the rest."""
    if history and history[0].role == "system":
        return history[0].text, list(history[1:])
    return None, list(history)


# -- Chat Completions --------------------------------------------------------------------------
class _ChatStream:
    def __init__(self) -> None:
        self.out = Answer()
        self._message = DeltaFold()

    def feed(self, event: str | None, data: Any) -> bool:
        if "error" in data:
            raise _error(data)
        first = False
        usage = data.get("usage")
        if usage:
            self.out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.out.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.out.cached_tokens = details.get("cached_tokens")
        for choice in data.get("choices") or []:
            first = self._message.feed(choice.get("delta") or {}) or first
            if choice.get("finish_reason"):
                self.out.finish_reason = choice["finish_reason"]
        return first

    def answer(self) -> Answer:
        message = self._message
        self.out.text = message.content or ""
        self.out.reasoning = message.reasoning or None
        self.out.calls = message.calls()
        return self.out


class ChatCodec:
    """Plain Chat Completions, as a harness on vLLM sends it."""

    name: RawClientName = "chat"
    path = "/chat/completions"

    def request(
        self, history: Sequence[Message], turn: Turn
    ) -> tuple[dict[str, str], dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        for m in history:
            if m.role == "tool":
                messages.append({"role": "tool", "tool_call_id": m.call_id, "content": m.text})
            elif m.role == "assistant" and m.calls:
                calls = chat_tool_calls(m.calls)
                messages.append({"role": "assistant", "content": m.text, "tool_calls": calls})
            else:  # reasoning returned apart is not sent back (OpenAI clients drop it)
                messages.append({"role": m.role, "content": m.text})
        body = {
            "model": turn.model,
            "messages": messages,
            "max_tokens": turn.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": TOOL_CALL["name"],
                        "description": _TOOL_DESCRIPTION,
                        "parameters": _TOOL_SCHEMA,
                    },
                }
            ],
            "chat_template_kwargs": dict(turn.chat_template_kwargs),
            "cache_salt": turn.salt,
            BODY_SIM_SCRIPT: dict(turn.script),
        }
        headers = {"Authorization": f"Bearer {turn.api_key}", HEADER_SESSION_ID: turn.session}
        return headers, body

    def stream(self) -> Stream:
        return _ChatStream()


# -- Anthropic Messages ------------------------------------------------------------------------
class _MessagesStream:
    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}
        self.stop: str | None = None

    def feed(self, event: str | None, data: Any) -> bool:
        kind = data.get("type") or event
        if kind == "error":
            raise _error(data)
        if kind == "message_start":
            self.usage.update((data.get("message") or {}).get("usage") or {})
        elif kind == "message_delta":
            self.usage.update({k: v for k, v in (data.get("usage") or {}).items() if v is not None})
            self.stop = (data.get("delta") or {}).get("stop_reason") or self.stop
        elif kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            block["partial"] = ""
            self.blocks[int(data.get("index", 0))] = block
        elif kind == "content_block_delta":
            block = self.blocks.setdefault(int(data.get("index", 0)), {"partial": ""})
            delta = data.get("delta") or {}
            kind = delta.get("type")
            if kind == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
                return bool(delta.get("text"))
            if kind == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
                return bool(delta.get("thinking"))
            if kind == "signature_delta":
                block["signature"] = delta.get("signature")
            elif kind == "input_json_delta":
                block["partial"] += delta.get("partial_json", "")
        return False

    def answer(self) -> Answer:
        out = Answer(finish_reason=self.stop)
        for _, block in sorted(self.blocks.items()):
            kind = block.get("type")
            if kind == "text":
                out.text += block.get("text", "")
            elif kind == "thinking":
                out.reasoning = (out.reasoning or "") + block.get("thinking", "")
                out.signature = block.get("signature")
            elif kind == "tool_use":
                arguments = block["partial"] or json.dumps(block.get("input") or {})
                out.calls.append(ToolCall(block.get("id", ""), block.get("name", ""), arguments))
        cached = int(self.usage.get("cache_read_input_tokens") or 0)
        created = int(self.usage.get("cache_creation_input_tokens") or 0)
        out.prompt_tokens = int(self.usage.get("input_tokens") or 0) + cached + created
        out.cached_tokens = cached
        out.completion_tokens = int(self.usage.get("output_tokens") or 0)
        return out


class MessagesCodec:
    """The Anthropic Messages API, as Claude Code sends it."""

    name: RawClientName = "messages"
    path = "/messages?beta=true"

    def request(
        self, history: Sequence[Message], turn: Turn
    ) -> tuple[dict[str, str], dict[str, Any]]:
        system, rest = _system(history)
        messages: list[dict[str, Any]] = []
        for m in rest:
            if m.role == "tool":
                block = {"type": "tool_result", "tool_use_id": m.call_id, "content": m.text}
                messages.append({"role": "user", "content": [block]})
            elif m.role == "assistant":
                blocks: list[dict[str, Any]] = []
                if m.reasoning is not None:
                    blocks.append(
                        {"type": "thinking", "thinking": m.reasoning, "signature": m.signature}
                    )
                if m.text or not m.calls:
                    blocks.append({"type": "text", "text": m.text})
                for c in m.calls:
                    blocks.append(
                        {
                            "type": "tool_use",
                            "id": c.id,
                            "name": c.name,
                            "input": json.loads(c.arguments or "{}"),
                        }
                    )
                messages.append({"role": "assistant", "content": blocks})
            else:
                messages.append({"role": m.role, "content": [{"type": "text", "text": m.text}]})
        user_id = json.dumps(
            {"device_id": turn.device, "account_uuid": "", "session_id": turn.session}
        )
        body: dict[str, Any] = {"model": turn.model, "max_tokens": turn.max_tokens}
        if system is not None:
            body["system"] = [{"type": "text", "text": system}]
        body |= {
            "messages": messages,
            "tools": [
                {
                    "name": TOOL_CALL["name"],
                    "description": _TOOL_DESCRIPTION,
                    "input_schema": _TOOL_SCHEMA,
                }
            ],
            "thinking": {"type": "disabled"},
            "metadata": {"user_id": user_id},
            "stream": True,
            "cache_salt": turn.salt,
            BODY_SIM_SCRIPT: dict(turn.script),
        }
        headers = {
            "x-api-key": turn.api_key,
            "anthropic-version": _ANTHROPIC_VERSION,
            HEADER_CLAUDE_CODE_SESSION_ID: turn.session,
        }
        return headers, body

    def stream(self) -> Stream:
        return _MessagesStream()


# -- OpenAI Responses --------------------------------------------------------------------------
class _ResponsesStream:
    def __init__(self) -> None:
        self.final: dict[str, Any] | None = None

    def feed(self, event: str | None, data: Any) -> bool:
        kind = data.get("type") or event
        if kind in ("error", "response.failed", "response.incomplete"):
            raise _error(data.get("response") or data)
        if kind == "response.completed":
            self.final = data.get("response") or {}
        return kind in ("response.output_text.delta", "response.reasoning_text.delta") and bool(
            data.get("delta")
        )

    def answer(self) -> Answer:
        if self.final is None:
            raise WireError("the stream ended without response.completed")
        out = Answer(finish_reason=self.final.get("status"))
        for item in self.final.get("output") or []:
            kind = item.get("type")
            if kind == "message":
                out.text += "".join(
                    part.get("text", "")
                    for part in item.get("content") or []
                    if part.get("type") == "output_text"
                )
            elif kind == "function_call":
                out.calls.append(
                    ToolCall(item.get("call_id", ""), item.get("name", ""), item["arguments"])
                )
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                out.reasoning = (out.reasoning or "") + "".join(p.get("text", "") for p in parts)
        usage = self.final.get("usage") or {}
        out.prompt_tokens = int(usage.get("input_tokens") or 0)
        out.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        out.completion_tokens = int(usage.get("output_tokens") or 0)
        return out


class ResponsesCodec:
    """The OpenAI Responses API, stateless, as Codex sends it."""

    name: RawClientName = "responses"
    path = "/responses"

    def request(
        self, history: Sequence[Message], turn: Turn
    ) -> tuple[dict[str, str], dict[str, Any]]:
        system, rest = _system(history)
        items: list[dict[str, Any]] = []
        for m in rest:
            if m.role == "tool":
                result = {"type": "function_call_output", "call_id": m.call_id, "output": m.text}
                items.append(result)
            elif m.role == "assistant":
                # reasoning items come back only encrypted, which a store=false client without
                # `include` never gets: they are not sent back
                if m.text or not m.calls:
                    part = {"type": "output_text", "text": m.text}
                    items.append({"type": "message", "role": "assistant", "content": [part]})
                for c in m.calls:
                    items.append(
                        {
                            "type": "function_call",
                            "call_id": c.id,
                            "name": c.name,
                            "arguments": c.arguments,
                        }
                    )
            else:
                part = {"type": "input_text", "text": m.text}
                items.append({"type": "message", "role": m.role, "content": [part]})
        body: dict[str, Any] = {"model": turn.model}
        if system is not None:
            body["instructions"] = system
        body |= {
            "input": items,
            "tools": [
                {
                    "type": "function",
                    "name": TOOL_CALL["name"],
                    "description": _TOOL_DESCRIPTION,
                    "parameters": _TOOL_SCHEMA,
                    "strict": False,
                }
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "none"},
            "store": False,
            "stream": True,
            "include": [],
            "prompt_cache_key": turn.session,
            "max_output_tokens": turn.max_tokens,
            "cache_salt": turn.salt,
            BODY_SIM_SCRIPT: dict(turn.script),
        }
        headers = {"Authorization": f"Bearer {turn.api_key}", "session-id": turn.session}
        return headers, body

    def stream(self) -> Stream:
        return _ResponsesStream()


_CODECS: dict[RawClientName, type[ChatCodec | MessagesCodec | ResponsesCodec]] = {
    "chat": ChatCodec,
    "messages": MessagesCodec,
    "responses": ResponsesCodec,
}


def codec_for(client: RawClientName) -> Codec:
    return _CODECS[client]()
