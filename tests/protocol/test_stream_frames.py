"""The Messages and Responses stream encoders build their per-token events from byte templates:
every event they write must be exactly what serializing its dict would write (``event: <type>``,
``data:`` orjson's compact JSON, keys in the dict's order), whatever the text holds."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from agentkv.protocol.anthropic import MessageStream
from agentkv.protocol.responses_stream import ResponsesEncoder

TEXTS = ["Hello", ' "quoted" \\ back', "line\nbreak\ttab", "é 漢字 \u2028 😀", "\x00\x1f", ""]


def chunk(delta: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": extra.pop("finish", None)}
    return {"id": "chatcmpl-1", "model": "sim", "choices": [choice], **extra}


def stream() -> list[dict[str, Any]]:
    call = {"index": 0, "id": "call_1", "function": {"name": "get", "arguments": ""}}
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning": t}) for t in TEXTS if t]
    out += [chunk({"content": t}) for t in TEXTS if t]
    out.append(chunk({"tool_calls": [call]}))
    out += [
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": a}}]})
        for a in ('{"a":', '"é"}')
    ]
    out.append(chunk(finish="tool_calls"))
    out.append({"id": "chatcmpl-1", "model": "sim", "choices": [], "usage": {"prompt_tokens": 3}})
    return out


def check(frames: list[bytes]) -> list[dict[str, Any]]:
    events = []
    for frame in frames:
        for event in frame.split(b"\n\n")[:-1]:
            head, data = event.split(b"\n", 1)
            assert head.startswith(b"event: ") and data.startswith(b"data: ")
            parsed = orjson.loads(data[6:])
            assert head[7:].decode() == parsed["type"]
            assert data[6:] == orjson.dumps(parsed)  # orjson's own bytes, key order kept
            events.append(parsed)
    return events


def test_message_stream_events_are_orjson_bytes() -> None:
    encoder = MessageStream()
    frames = [e for c in stream() for e in encoder.chunk(c)] + encoder.done()
    events = check(frames)
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert [d["thinking"] for d in deltas if d["type"] == "thinking_delta"] == [
        t for t in TEXTS if t
    ]
    assert [d["text"] for d in deltas if d["type"] == "text_delta"] == [t for t in TEXTS if t]
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"a":"é"}'
    assert [d["type"] for d in deltas].count("signature_delta") == 1
    assert events[-1] == {"type": "message_stop"}


@pytest.mark.parametrize("logprobs", [False, True])
def test_responses_stream_events_are_orjson_bytes(logprobs: bool) -> None:
    request: dict[str, Any] = {"model": "sim", "input": "hi", "instructions": "sys \u2028 é"}
    if logprobs:
        request["include"] = ["message.output_text.logprobs"]
    encoder = ResponsesEncoder(request, response_id="resp_1", created_at=1)
    frames = [e for c in stream() for e in encoder.chunk(c)] + encoder.done()
    events = check(frames)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[1]["type"] == "response.in_progress"
    assert events[0]["response"] == events[1]["response"]
    assert events[0]["response"]["instructions"] == request["instructions"]
    text = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in text] == [t for t in TEXTS if t]
    assert all(e["logprobs"] == [] and e["content_index"] == 0 for e in text)
    assert {e["item_id"] for e in text} == {text[0]["item_id"]}
    reasoning = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert reasoning == [t for t in TEXTS if t]
    assert events[-1]["type"] == "response.completed"
