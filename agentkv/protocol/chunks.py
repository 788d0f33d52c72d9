"""What the edge codecs read from a chat completion chunk on their fast path."""

from __future__ import annotations

from typing import Any

__all__ = ["plain_text"]


def plain_text(chunk: dict[str, Any]) -> str | None:
    """The text of a chunk that only adds content to one unfinished choice, else None (the
    common chunk of a stream: its events can be written from a template)."""
    choices = chunk.get("choices")
    if not choices or len(choices) != 1:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if (
        choice.get("finish_reason") is None
        and isinstance(delta, dict)
        and len(delta) == 1
        and isinstance(text := delta.get("content"), str)
        and text
    ):
        return text
    return None
