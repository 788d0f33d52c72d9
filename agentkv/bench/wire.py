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

from agentkv.protocol.deltas import ToolCall

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
    "Stream",
    "ToolCall",
    "Turn",
    "WireError",
    "chat_tool_calls",
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
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)

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
            calls = chat_tool_calls(m.calls)
            out.append({"role": "assistant", "content": m.text, "tool_calls": calls})
        elif m.role == "tool":
            out.append({"role": "tool", "content": m.text, "tool_call_id": m.call_id or ""})
        else:
            out.append({"role": m.role, "content": m.text})
    return out


def chat_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """``calls`` as a Chat Completions assistant message's ``tool_calls``."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


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
