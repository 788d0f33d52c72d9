"""The digests token identity compares (:mod:`agentkv.router.identity`): of a message as it
says something (role, text, reasoning, tool calls), of an answer, of the rendering context
(model, tools, chat template and its kwargs) and of a history's prefixes. Blake2b, 16 bytes,
over sorted-key JSON."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "CONTEXT_KEYS",
    "DIGEST_SIZE",
    "answer_digest",
    "context_digest",
    "digest",
    "mark_digest",
    "message_digest",
    "prefix_digests",
]

DIGEST_SIZE = 16
CONTEXT_KEYS = ("model", "tools", "chat_template", "chat_template_kwargs")
"""What the rendering depends on besides the messages."""
_ANSWER_KEYS = frozenset({"role", "content", "reasoning", "reasoning_content", "tool_calls"})
_EMPTY: tuple[Any, ...] = (None, "", [], {})


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def _canonical_digest(value: Any) -> bytes:
    """The digest of a JSON value with sorted keys: orjson's text, or for a value nested past
    its depth (orjson reads 1024 levels, writes 254) a walk without recursion."""
    try:
        return digest(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    except TypeError:
        pass
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"deep")
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            h.update(b"{%d" % len(item))
            for k in sorted(item, reverse=True):
                stack += [item[k], str(k)]
        elif isinstance(item, list):
            h.update(b"[%d" % len(item))
            stack += reversed(item)
        else:
            h.update(b"%d:" % len(repr(item)) + repr(item).encode())
    return h.digest()


def _content(content: Any) -> Any:
    """Text as text: None is empty, a list of plain text parts is their text joined as vLLM
    joins them; anything else as it is."""
    if content is None:
        return ""
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, Mapping)
            and p.get("type") == "text"
            and isinstance(p.get("text"), str)
            and set(p) <= {"type", "text"}
            for p in content
        )
    ):
        return "\n".join(p["text"] for p in content)
    return content


def _calls(calls: Any) -> Any:
    """Tool calls as (id, function name, arguments as sent): ``type`` and a stream's
    ``index`` are not the call."""
    if not isinstance(calls, list):
        return calls or []
    out: list[Any] = []
    for call in calls:
        if not isinstance(call, Mapping):
            out.append(call)
            continue
        fn = call.get("function")
        fn = fn if isinstance(fn, Mapping) else {}
        rest = {k: v for k, v in call.items() if k not in ("id", "type", "index", "function")}
        out.append([call.get("id"), fn.get("name"), fn.get("arguments"), rest or None])
    return out


def _normalized(message: Mapping[str, Any]) -> dict[str, Any]:
    """What a message says: role, content text, reasoning (either name), tool calls, and every
    other field that is set (``tool_call_id``, ``name``, ...)."""
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    return {
        "role": message.get("role"),
        "content": _content(message.get("content")),
        "reasoning": reasoning or "",
        "tool_calls": _calls(message.get("tool_calls")),
        "rest": {k: v for k, v in message.items() if k not in _ANSWER_KEYS and v not in _EMPTY},
    }


def message_digest(message: Any) -> bytes:
    """A message's digest (:func:`_normalized`; anything that is not a message digests as
    itself)."""
    return _canonical_digest(_normalized(message) if isinstance(message, Mapping) else message)


def answer_digest(message: Mapping[str, Any]) -> bytes:
    """The digest of an assistant message, as the engine returned it or as a client sends it
    back (the same as :func:`message_digest`, with the role fixed)."""
    return message_digest({**message, "role": "assistant"})


def context_digest(body: Mapping[str, Any]) -> bytes:
    """What the rendering depends on besides the messages: model, tools, chat template and
    its kwargs."""
    return _canonical_digest({k: body.get(k) for k in CONTEXT_KEYS})


def prefix_digests(messages: Sequence[Any], counts: set[int]) -> dict[int, bytes]:
    """The digest of ``messages[:n]`` for every ``n`` in ``counts`` (one pass)."""
    out: dict[int, bytes] = {}
    running = hashlib.blake2b(digest_size=DIGEST_SIZE)
    if 0 in counts:
        out[0] = running.digest()
    for i, message in enumerate(messages, 1):
        running.update(message_digest(message))
        if i in counts:
            out[i] = running.digest()
    return out


def mark_digest(history: bytes, answer: bytes) -> bytes:
    """The digest of messages ``[:n]`` (``history``, :func:`prefix_digests`) followed by the
    answer ``n`` (its :func:`message_digest`)."""
    return digest(history + answer)
