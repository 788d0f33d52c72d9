"""The SDK's messages as plain data: copies of what an application or a framework passes, the
fingerprint frameworks round-trip, the tool calls still open, and the rewritten histories
(reasoning stripped, compacted) the ledger adopts. No state: :class:`~agentkv._ledger.Ledger`
keeps the history these read."""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agentkv._exceptions import ConversationError

__all__ = [
    "clean_message",
    "compacted",
    "fingerprint",
    "open_tool_calls",
    "wire_messages",
    "without_reasoning",
]

_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def clean_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict deep copy (accepts openai's pydantic message objects too)."""
    dump = getattr(message, "model_dump", None)
    data = dump(exclude_none=True) if callable(dump) else dict(message)
    if not isinstance(data, dict):
        raise ConversationError("A message must be a mapping.")
    return copy.deepcopy(data)


def fingerprint(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a framework round-trips of a message (it may drop reasoning or re-encode args):
    reasoning dropped, tool-call arguments compared as JSON values, ``<think>`` blocks stripped
    from assistant text. ``Conversation.sync`` and :mod:`agentkv.pool` compare by it."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                args = json.loads(args)
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    content = content or ""
    if message.get("role") == "assistant" and isinstance(content, str):
        content = _THINK.sub("", content).strip()
    return (message.get("role"), content, tuple(calls), message.get("tool_call_id"))


def open_tool_calls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ids of the last assistant message's tool calls that no tool result answers yet."""
    open_ids: list[str] = []
    for msg in messages:
        if msg.get("role") == "assistant":
            open_ids = [str(c.get("id")) for c in msg.get("tool_calls") or []]
        elif msg.get("role") == "tool" and msg.get("tool_call_id") in open_ids:
            open_ids.remove(str(msg["tool_call_id"]))
    return open_ids


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History as generated; reasoning under both names servers accept.

    ``messages`` themselves (the ledger's), not copies (a turn is sent and encoded before the
    ledger changes, and nothing on the way writes to them): copying every message of a long
    history on every turn cost more than encoding it."""
    out = []
    for m in messages:
        reasoning = m.get("reasoning") or m.get("reasoning_content")
        if reasoning and m.get("role") == "assistant":
            m = {**m, "reasoning": reasoning, "reasoning_content": reasoning}
        out.append(m)
    return out


def without_reasoning(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` with the assistants' reasoning and ``<think>`` blocks taken out."""
    out = []
    for msg in messages:
        m = copy.deepcopy(msg)
        if m.get("role") == "assistant":
            m.pop("reasoning", None)
            m.pop("reasoning_content", None)
            if isinstance(m.get("content"), str):
                m["content"] = _THINK.sub("", m["content"])
        out.append(m)
    return out


def compacted(
    messages: Sequence[dict[str, Any]], summary: str, keep_last: int
) -> list[dict[str, Any]]:
    """System messages, a user message holding ``summary``, then the last ``keep_last``
    messages (moved back so the kept part starts at a user message); ``keep_last`` >= 0."""
    head = [m for m in messages if m.get("role") in ("system", "developer")]
    body = [m for m in messages if m.get("role") not in ("system", "developer")]
    cut = max(0, len(body) - keep_last)
    while cut < len(body) and body[cut].get("role") != "user":
        cut += 1
    tail = body[cut:]
    return copy.deepcopy(
        [
            *head,
            {"role": "user", "content": f"Summary of the conversation so far:\n{summary}"},
            *tail,
        ]
    )
