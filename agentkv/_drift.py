"""Name the hazard behind a drift (``../shared/reference/chat-templates.md``, hazard catalogue).

Given the decoded text around the first token where the re-rendered prompt stops extending the
previous prompt + generated tokens, pick the most specific explanation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["HAZARDS", "classify_drift"]

HAZARDS = {
    "retokenized": "the same text re-tokenized into different ids",
    "reasoning-pruned": "the template dropped earlier reasoning",
    "end-of-turn-rewritten": "the end-of-turn token of the answer was rewritten",
    "tool-call-reserialized": "tool-call arguments were re-serialized by the template",
    "whitespace-normalized": "the template trimmed or changed whitespace",
    "time-dependent": "the template inserts a date or time that changed",
    "moved-block": "the template moved a block (system prompt, tools) to a later message",
    "output-rerendered": "the model's answer re-renders differently from what it generated",
    "history-rerendered": "an earlier message renders differently once more messages follow",
}

_DATE = re.compile(r"\d{1,4}[-/ ](?:\d{1,2}|[A-Z][a-z]{2})[-/ ]\d{1,4}")
_TOOLS = re.compile(r"AVAILABLE_TOOLS|<tools>|# Tools", re.IGNORECASE)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def classify_drift(
    *,
    expected_text: str,
    actual_text: str,
    in_output: bool,
    messages: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, str]:
    """``(hazard, detail)`` for a drift whose decoded windows are given."""
    exp, act = expected_text, actual_text
    prefix = 0
    while prefix < min(len(exp), len(act)) and exp[prefix] == act[prefix]:
        prefix += 1
    shown = f"expected {exp[prefix : prefix + 40]!r}, got {act[prefix : prefix + 40]!r}"
    short = min(len(exp), len(act))
    if short and exp[:short] == act[:short]:
        near = exp[max(0, prefix - 20) : prefix + 20]
        return "retokenized", f"same text, different token ids near {near!r}"
    if ("<think>" in exp[prefix:] or "</think>" in exp[prefix:]) and exp.count(
        "think>"
    ) > act.count("think>"):
        return "reasoning-pruned", shown
    if any(t in exp[prefix : prefix + 12] for t in ("<|return|>", "<|end|>")):
        return "end-of-turn-rewritten", shown
    if _squash(exp) and _squash(exp) == _squash(act[: len(exp) + 32])[: len(_squash(exp))]:
        return "whitespace-normalized", shown
    if _DATE.search(exp[prefix : prefix + 40]) and _DATE.search(act[prefix : prefix + 40]):
        return "time-dependent", shown
    window = exp[prefix : prefix + 20]
    if any(m.get("tool_calls") for m in messages) and ('"' in window or "{" in window):
        return "tool-call-reserialized", shown
    if _TOOLS.search(act[prefix:]) and not _TOOLS.search(exp[prefix:]):
        return "moved-block", shown
    if in_output:
        return "output-rerendered", shown
    return "history-rerendered", shown
