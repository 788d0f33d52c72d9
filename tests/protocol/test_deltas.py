"""protocol.deltas.DeltaFold folds a stream's deltas as openai-python folds them."""

from __future__ import annotations

from typing import Any

import pytest
from openai.lib.streaming._deltas import accumulate_delta

from agentkv.protocol.deltas import DeltaFold, ToolCall

STREAMS: dict[str, list[dict[str, Any]]] = {
    "text": [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}],
    "reasoning then text": [
        {"reasoning": "thin"},
        {"reasoning": "k"},
        {"content": "done"},
    ],
    "two tool calls in pieces": [
        {"role": "assistant", "content": None},
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "ls"}},
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"pa'}}]},
        {
            "tool_calls": [
                {"index": 0, "function": {"arguments": 'th": "."}'}},
                {"index": 1, "id": "call_b", "type": "function", "function": {"name": "cat"}},
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ],
}


def openai_message(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    acc: dict[object, object] = {}
    for delta in deltas:
        acc = accumulate_delta(acc, dict(delta))
    calls = [
        {
            "id": c.get("id"),
            "type": "function",
            "function": {
                "name": c["function"].get("name", ""),
                "arguments": c["function"].get("arguments", ""),
            },
        }
        for c in acc.get("tool_calls") or []  # type: ignore[attr-defined]
    ]
    message: dict[str, Any] = {"role": "assistant", "content": acc.get("content") or None}
    if acc.get("reasoning"):
        message["reasoning"] = acc["reasoning"]
    if calls:
        message["tool_calls"] = calls
    return message


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_the_fold_is_openai_pythons(name: str) -> None:
    fold = DeltaFold()
    for delta in STREAMS[name]:
        fold.feed(delta)
    assert fold.message() == openai_message(STREAMS[name])


def test_feed_says_when_text_came_and_absent_parts_stay_none() -> None:
    fold = DeltaFold()
    assert fold.feed({"role": "assistant"}) is False
    assert fold.content is None and fold.reasoning is None
    assert fold.feed({"content": ""}) is False and fold.content == ""
    assert fold.feed({"reasoning_content": "r"}) is True and fold.reasoning == "r"
    assert fold.feed({"tool_calls": [{"function": {"name": "f"}}]}) is False
    assert fold.tool_calls() == [
        {"id": None, "type": "function", "function": {"name": "f", "arguments": ""}}
    ]
    assert fold.calls() == [ToolCall("", "f", "")]
