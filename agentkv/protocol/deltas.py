"""A streamed chat completion's assistant message, folded from its deltas as a client folds them.

openai-python's rule: strings are concatenated (``id`` too), tool calls are merged by ``index``
(by position in the chunk when a call has none), reasoning comes as ``reasoning`` or
``reasoning_content``. The one implementation behind the router (the message the client saw),
the SDK (the turn it records), the benchmark's raw client and the simulator's streaming tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DeltaFold", "ToolCall"]


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model wrote it."""

    id: str
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class DeltaFold:
    """Feed it each choice's ``delta``; read the message back. A text part that never came is
    None; one that came empty is ``""``."""

    __slots__ = ("_calls", "_content", "_reasoning")

    def __init__(self) -> None:
        self._content: list[str] | None = None
        self._reasoning: list[str] | None = None
        self._calls: dict[int, tuple[list[str], list[str], list[str]]] = {}

    def feed(self, delta: Mapping[str, Any]) -> bool:
        """Take one delta; True when it carried text (content or reasoning)."""
        text = False
        content = delta.get("content")
        if isinstance(content, str):
            if self._content is None:
                self._content = []
            self._content.append(content)
            text = bool(content)
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str):
            if self._reasoning is None:
                self._reasoning = []
            self._reasoning.append(reasoning)
            text = text or bool(reasoning)
        for i, call in enumerate(delta.get("tool_calls") or ()):
            if not isinstance(call, Mapping):
                continue
            index = call.get("index")
            slot = self._calls.setdefault(index if isinstance(index, int) else i, ([], [], []))
            fn = call.get("function")
            fn = fn if isinstance(fn, Mapping) else {}
            for parts, value in zip(
                slot, (call.get("id"), fn.get("name"), fn.get("arguments")), strict=True
            ):
                if isinstance(value, str):
                    parts.append(value)
        return text

    @property
    def content(self) -> str | None:
        return None if self._content is None else "".join(self._content)

    @property
    def reasoning(self) -> str | None:
        return None if self._reasoning is None else "".join(self._reasoning)

    def tool_calls(self) -> list[dict[str, Any]]:
        """The tool calls in index order, in the OpenAI shape (``id`` None when none came)."""
        return [
            {
                "id": "".join(ids) if ids else None,
                "type": "function",
                "function": {"name": "".join(names), "arguments": "".join(arguments)},
            }
            for _, (ids, names, arguments) in sorted(self._calls.items())
        ]

    def calls(self) -> list[ToolCall]:
        """The tool calls in index order (``id`` ``""`` when none came)."""
        return [
            ToolCall("".join(ids), "".join(names), "".join(arguments))
            for _, (ids, names, arguments) in sorted(self._calls.items())
        ]

    def message(self) -> dict[str, Any]:
        """The assistant message: ``content`` (None when empty), ``reasoning`` and
        ``tool_calls`` when there are any."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if reasoning := self.reasoning:
            message["reasoning"] = reasoning
        if self._calls:
            message["tool_calls"] = self.tool_calls()
        return message
