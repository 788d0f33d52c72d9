"""What clients that know nothing of agentkv send: Chat Completions, Anthropic Messages and
OpenAI Responses requests built from one API-neutral history, and their streamed answers read
back (``agentkv bench replay --client chat|messages|responses``).

Each client sends what its harness sends, over plain HTTP (no SDK, no token ids, no agentkv
header or body field):

* ``chat``: ``POST /v1/chat/completions`` with the messages and an ``X-Session-ID`` header (a
  harness's session signal: vllm-router, opencode); tool rounds as ``tool_calls`` and ``tool``
  messages;
* ``messages``: ``POST /v1/messages?beta=true`` as Claude Code sends it: the header
  ``X-Claude-Code-Session-Id`` and ``metadata.user_id`` (a JSON string holding the session),
  ``system`` as a list of text blocks, ``thinking: disabled``, tool rounds as ``tool_use`` and
  ``tool_result`` blocks, thinking blocks sent back with their signatures;
* ``responses``: ``POST /v1/responses`` as Codex sends it: stateless (``store: false``, the
  whole input each turn), the session as ``prompt_cache_key`` and in the ``session-id`` header,
  ``instructions`` for the system prompt, tool rounds as ``function_call`` and
  ``function_call_output`` items.

Every request also carries vLLM's own ``cache_salt`` (so runs never share prefix caches) and the
simulator's script ``agentkv_sim`` (the stand-in for the model's own choice of words: vLLM
ignores it and the router reads nothing from it). A history that the trace rewrites (a
compaction, stripped reasoning) is sent as the changed history, with no epoch.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from agentkv.protocol import (
    BODY_SIM_SCRIPT,
    HEADER_CLAUDE_CODE_SESSION_ID,
    HEADER_SESSION_ID,
)
from agentkv.protocol.deltas import DeltaFold, ToolCall

__all__ = [
    "CLIENTS",
    "HEADER_IDENTITY",
    "RAW_CLIENTS",
    "TOOL_CALL",
    "Answer",
    "ClientName",
    "Codec",
    "Message",
    "RawClientName",
    "ToolCall",
    "WireError",
    "codec_for",
    "raw_text",
    "same_answer",
    "shadow",
    "sse_events",
    "strip_reasoning",
]

ClientName = Literal["sdk", "chat", "messages", "responses"]
RawClientName = Literal["chat", "messages", "responses"]
CLIENTS: tuple[ClientName, ...] = ("sdk", "chat", "messages", "responses")
RAW_CLIENTS: tuple[RawClientName, ...] = ("chat", "messages", "responses")

HEADER_IDENTITY = "X-AgentKV-Identity"
"""The receipt of router-kept token identity (issue 22, item 4), read when a router sends it."""

TOOL_CALL: dict[str, Any] = {"name": "Bash", "arguments": {"command": "ls"}}
"""The call a scripted answer ends with where the trace's answer ended in a tool call."""
_TOOL_DESCRIPTION = "Run a shell command."
_TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
}
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_ANTHROPIC_VERSION = "2023-06-01"

Role = Literal["system", "user", "assistant", "tool"]


class WireError(RuntimeError):
    """A request the server refused, or a stream that ended in an error."""


@dataclass(frozen=True)
class Message:
    """One message of the neutral history (each API writes it its own way)."""

    role: Role
    text: str
    reasoning: str | None = None
    """Reasoning returned apart from the text (a thinking block); sent back as it came."""
    signature: str | None = None
    """The thinking block's signature (Messages)."""
    calls: tuple[ToolCall, ...] = ()
    call_id: str | None = None
    """``tool``: the call this result answers."""
    raw: str | None = None
    """``assistant``: the text the model generated (reasoning, text and tool calls in its own
    syntax), for the replay's ideal; None when it could not be told from the answer."""


@dataclass
class Answer:
    """A streamed answer, read back."""

    text: str = ""
    reasoning: str | None = None
    signature: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None

    def message(self) -> Message:
        return Message(
            "assistant",
            self.text,
            reasoning=self.reasoning,
            signature=self.signature,
            calls=tuple(self.calls),
            raw=raw_text(self),
        )


def raw_text(answer: Answer) -> str:
    """The text a Qwen-family model generated for ``answer``, as the simulator writes it:
    a think block when reasoning came apart from the text, the text, then each tool call in
    Hermes syntax (``<tool_call>`` JSON ``</tool_call>``). The replay checks it against the
    answer's token count."""
    out = "" if answer.reasoning is None else f"<think>{answer.reasoning}</think>"
    out += answer.text
    calls = []
    for call in answer.calls:
        try:
            arguments: Any = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = call.arguments
        body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
        calls.append(f"<tool_call>\n{body}\n</tool_call>")
    return out + "\n".join(calls)


def strip_reasoning(history: Sequence[Message]) -> list[Message]:
    """The history without reasoning: thinking blocks dropped, ``<think>`` blocks cut out of
    the assistants' text (what the SDK's ``strip_reasoning()`` does)."""
    out = []
    for m in history:
        if m.role == "assistant":
            m = replace(
                m,
                text=_THINK.sub("", m.text),
                reasoning=None,
                signature=None,
                raw=None if m.raw is None else _THINK.sub("", m.raw),
            )
        out.append(m)
    return out


def same_answer(a: Message, b: Message) -> bool:
    """Whether two assistant messages say the same: text, tool calls and reasoning (an empty
    thinking block is no reasoning, as for the router's digest). A client that sends back an
    answer the same as the engine returned it can be prompted with the answer's generated ids;
    one it changed (reasoning stripped, an edit) must be rendered as it sent it."""
    return (
        a.role == b.role
        and a.text == b.text
        and a.calls == b.calls
        and (a.reasoning or "") == (b.reasoning or "")
    )


def shadow(
    history: Sequence[Message],
    returned: Sequence[Message | None] | None = None,
    *,
    changed_as_generated: bool = False,
) -> list[dict[str, Any]]:
    """The history as chat messages for the replay's ideal (the prompt of the SDK's exact mode),
    rendered by a template that writes messages as they are (the replay's ChatML): each answer
    the client sent back unchanged is the text the model generated (``returned[i]``, the
    message as the engine returned it, ``raw`` included; every answer when ``returned`` is
    None); an answer the client changed is what it sent (its text and tool calls: the template
    renders what it renders of them), or with ``changed_as_generated`` the text the model
    generated less what the client cut out (its reasoning), tool calls as generated; every
    other message as the client sent it."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(history):
        kept = m if returned is None else returned[i]
        if m.role == "assistant" and kept is not None and kept.raw is not None:
            out.append({"role": "assistant", "content": kept.raw})
        elif m.role == "assistant" and changed_as_generated and m.raw is not None:
            out.append({"role": "assistant", "content": m.raw})
        elif m.role == "assistant" and m.calls and returned is not None:
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in m.calls
            ]
            out.append({"role": "assistant", "content": m.text, "tool_calls": calls})
        elif m.role == "tool":
            out.append({"role": "tool", "content": m.text, "tool_call_id": m.call_id or ""})
        else:
            out.append({"role": m.role, "content": m.text})
    return out


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str | None, Any]]:
    """``(event, data)`` of a server-sent event stream (data parsed as JSON; ``[DONE]`` is
    the end)."""
    event: str | None = None
    async for line in lines:
        if not line:
            event = None
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                yield event, json.loads(data)
            except ValueError as exc:
                raise WireError(f"not JSON in the stream: {data[:200]!r}") from exc


@dataclass(frozen=True)
class Turn:
    """What one request carries besides the history."""

    model: str
    session: str
    max_tokens: int
    script: Mapping[str, Any]
    salt: str
    api_key: str
    chat_template_kwargs: Mapping[str, Any]
    device: str = ""
    """Claude Code's device id (in ``metadata.user_id``)."""


class Stream(Protocol):
    """Reads one API's streamed answer."""

    def feed(self, event: str | None, data: Any) -> bool:
        """Take one event; True when it carries the first generated text."""

    def answer(self) -> Answer: ...


class Codec(Protocol):
    """One API: where to send, what to send, how to read the answer."""

    name: RawClientName
    path: str

    def request(
        self, history: Sequence[Message], turn: Turn
    ) -> tuple[dict[str, str], dict[str, Any]]: ...

    def stream(self) -> Stream: ...


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
                calls = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in m.calls
                ]
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
