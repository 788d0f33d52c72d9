"""The markup of a Qwen-family model's raw output as vLLM 0.33's parsers read it: the tags, the
lexer of the qwen3 parser engine, and text cut out of the raw output that keeps each character's
offset in it (so a parsed part can be streamed at the token that generated it)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "CLOSE_ANGLE",
    "EMPTY",
    "FUNC_END",
    "FUNC_PREFIX",
    "PARAM_END",
    "PARAM_START",
    "THINK_END",
    "THINK_START",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "Call",
    "Text",
    "lex",
]

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNC_PREFIX = "<function="
FUNC_END = "</function>"
PARAM_START = "<parameter="
PARAM_END = "</parameter>"
CLOSE_ANGLE = ">"


@dataclass(frozen=True)
class Text:
    """A string cut out of the raw output, with each character's offset in the raw output."""

    text: str
    at: list[int]

    @staticmethod
    def whole(raw: str) -> Text:
        return Text(raw, list(range(len(raw))))

    def pick(self, spans: Iterable[tuple[int, int]]) -> Text:
        parts = list(spans)
        at: list[int] = []
        for start, end in parts:
            at.extend(self.at[start:end])
        return Text("".join(self.text[start:end] for start, end in parts), at)

    def cut(self, start: int, end: int) -> Text:
        return Text(self.text[start:end], self.at[start:end])

    def strip(self) -> Text:
        left = len(self.text) - len(self.text.lstrip())
        right = len(self.text.rstrip())
        return self.cut(left, max(left, right))


EMPTY = Text("", [])


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str
    name_at: int  # raw offset of the character after which vLLM knows the name
    end_at: int  # raw offset of the call's last character


# -- the lexer of vLLM's qwen3 parser engine -------------------------------------------------
_QWEN3_TERMINALS = (
    THINK_START,
    THINK_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    FUNC_PREFIX,
    FUNC_END,
    PARAM_START,
    PARAM_END,
    CLOSE_ANGLE,
)
# Leftmost, then longest, like vllm/parser/engine/incremental_lexer.py.
_LEXER = re.compile("|".join(re.escape(t) for t in sorted(_QWEN3_TERMINALS, key=len, reverse=True)))


def lex(text: str) -> Iterator[tuple[str | None, int, int]]:
    """(terminal or None for plain text, start, end) in order."""
    pos = 0
    for m in _LEXER.finditer(text):
        if m.start() > pos:
            yield None, pos, m.start()
        yield m.group(), m.start(), m.end()
        pos = m.end()
    if pos < len(text):
        yield None, pos, len(text)
