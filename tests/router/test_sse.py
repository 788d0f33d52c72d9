"""The streamed relay (:class:`EventRelay`) against the per-chunk parse it replaced.

The stream is a real one from the simulator's D (a tool call whose arguments contain the text
``"token_ids":[1]``, token ids on every chunk, the handle on the finish chunk, usage last),
fed whole, one byte at a time and split at every offset: the client must see the same JSON
events and the router must capture the same handle, ids, finish reason and usage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from agentkv.router.sse import Captured, EventRelay, rewrite_chunk

STREAM = (Path(__file__).parent / "data" / "d_stream_tool_call.sse").read_bytes()


def reference(keep_ids: bool, keep_prompt_ids: bool) -> tuple[list[object], Captured]:
    captured = Captured()
    out: list[object] = []
    for line in STREAM.decode().splitlines():
        if not line.startswith("data: "):
            continue
        if line[6:] == "[DONE]":
            out.append("[DONE]")
            continue
        chunk = orjson.loads(line[6:])
        out.append(
            rewrite_chunk(chunk, captured, keep_ids=keep_ids, keep_prompt_ids=keep_prompt_ids)
        )
    return out, captured


def events(data: bytes) -> list[object]:
    out: list[object] = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def relay(pieces: list[bytes], keep_ids: bool, keep_prompt_ids: bool) -> tuple[bytes, Captured]:
    captured = Captured()
    r = EventRelay(captured, keep_ids=keep_ids, keep_prompt_ids=keep_prompt_ids)
    out = b"".join(r.feed(p) for p in pieces) + r.close()
    assert r.done
    return out, captured


@pytest.mark.parametrize(
    ("keep_ids", "keep_prompt_ids"), [(False, False), (True, False), (True, True)]
)
def test_relay_matches_the_per_chunk_parse(keep_ids: bool, keep_prompt_ids: bool) -> None:
    want, want_cap = reference(keep_ids, keep_prompt_ids)
    splits = [[STREAM], [STREAM[i : i + 1] for i in range(len(STREAM))]]
    splits += [[STREAM[:i], STREAM[i:]] for i in range(1, len(STREAM), 7)]
    for pieces in splits:
        out, cap = relay(pieces, keep_ids, keep_prompt_ids)
        assert events(out) == want
        assert cap == want_cap
    assert want_cap.handle and want_cap.handle["remote_block_ids"]
    assert want_cap.finish_reason == "tool_calls" and want_cap.usage
    assert len(want_cap.output_ids) == want_cap.usage["completion_tokens"]


def test_internal_fields_never_reach_the_client() -> None:
    out, _ = relay([STREAM], keep_ids=False, keep_prompt_ids=False)
    for event in events(out):
        if isinstance(event, dict):
            assert event.get("kv_transfer_params") is None
            assert event.get("prompt_token_ids") is None
            assert all(c.get("token_ids") is None for c in event["choices"])
    assert b"remote_block_ids" not in out
    # the tool call's arguments (text that looks like a token-id list) pass unchanged
    assert b'Paris \\\\\\"token_ids\\\\\\":[1]' in out


def test_unchanged_events_pass_as_the_engine_sent_them() -> None:
    out, _ = relay([STREAM], keep_ids=True, keep_prompt_ids=True)
    first = STREAM.split(b"\n\n")[1]  # a content chunk: nothing set, ids kept
    assert first + b"\n\n" in out


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_long_echo_in_many_reads_is_cut_and_the_answer_kept(accumulate: bool) -> None:
    """Issue 23: a 128k-token prompt echo, read 64 KiB at a time, leaves as ``null`` whatever
    the read boundaries, and the output ids and the answer are read around it."""
    echo = list(range(100_000, 228_000))
    first = {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    first["prompt_token_ids"] = echo
    stream = b"data: " + orjson.dumps(first) + b"\n\n" + STREAM
    relay = EventRelay(Captured(), keep_ids=False, keep_prompt_ids=False, accumulate=accumulate)
    out = b"".join(relay.feed(stream[i : i + 65_536]) for i in range(0, len(stream), 65_536))
    out += relay.close()
    assert b'"prompt_token_ids":null' in out and b"100000" not in out
    want = reference(keep_ids=False, keep_prompt_ids=False)[1]
    assert relay.captured.output_ids == want.output_ids and relay.done
    assert relay.captured.handle == want.handle
    if accumulate:
        assert relay.captured.answer is not None and relay.captured.answer.tool_calls()


@pytest.mark.parametrize("accumulate", [False, True])
def test_continuous_usage_passes_as_sent_and_the_last_counts(accumulate: bool) -> None:
    """``continuous_usage_stats`` (a Messages turn's): every chunk carries ``usage``; the
    events pass as D sent them (only the handle's is rewritten), the last usage is captured."""
    lines: list[bytes] = []
    for n, line in enumerate(STREAM.split(b"\n\n")):
        if line.startswith(b"data: {"):
            chunk = orjson.loads(line[6:])
            chunk["usage"] = chunk.get("usage") or {"prompt_tokens": 7, "completion_tokens": n}
            line = b"data: " + orjson.dumps(chunk)
        lines.append(line)
    stream = b"\n\n".join(lines)
    captured = Captured()
    r = EventRelay(captured, keep_ids=False, keep_prompt_ids=False, accumulate=accumulate)
    out = b"".join(r.feed(stream[i : i + 100]) for i in range(0, len(stream), 100)) + r.close()
    want, want_cap = reference(keep_ids=False, keep_prompt_ids=False)
    got = events(out)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, dict):
            assert isinstance(g, dict) and g.pop("usage")
            assert {**w, "usage": None} == {**g, "usage": None}
    assert (captured.handle, captured.output_ids) == (want_cap.handle, want_cap.output_ids)
    assert captured.finish_reason == want_cap.finish_reason
    assert captured.usage == want_cap.usage  # the last chunk's
    plain = [e for e in lines if e.startswith(b"data: {") and b"remote_block_ids" not in e]
    for event in plain[1:3]:  # content chunks: D's bytes, ids nulled in place
        assert b'"usage":{' in event
        assert event.replace(b"token_ids", b"").split(b"[")[0] in out


@pytest.mark.anyio
@pytest.mark.parametrize("encoder", ["messages", "responses"])
async def test_the_edge_reencodes_from_the_relay_s_own_parse(encoder: str) -> None:
    """An accumulating relay hands its parse of each event to the edge codecs (one parse per
    event, not two): what they write is what they write from the bytes alone."""
    from agentkv.protocol.responses_stream import ResponsesEncoder
    from agentkv.router.edge import Encoder, _reencode
    from agentkv.router.messages import MessagesEncoder
    from agentkv.router.sse import ParsedEvents

    def make() -> Encoder:
        if encoder == "messages":
            return MessagesEncoder()
        return ResponsesEncoder({"model": "m", "input": "hi"}, response_id="resp_1")

    relay = EventRelay(Captured(), keep_ids=False, keep_prompt_ids=False, accumulate=True)
    parts = [relay.feed(STREAM[i : i + 300]) for i in range(0, len(STREAM), 300)]
    parts = [p for p in [*parts, relay.close()] if p]
    parsed = [p for p in parts if isinstance(p, ParsedEvents)]
    assert parsed and all(len(p.chunks) == p.count(b"\n\n") for p in parsed)

    async def source(items: list[bytes]) -> Any:
        for item in items:
            yield item

    async def encoded(items: list[bytes]) -> bytes:
        return b"".join([out async for out in _reencode(source(items), make())])

    def stable(data: bytes) -> list[object]:  # a thinking block's signature is random
        out: list[object] = []
        for line in data.split(b"\n"):
            if line.startswith(b"data: "):
                event = orjson.loads(line[6:])
                delta = event.get("delta")
                if isinstance(delta, dict) and delta.get("type") == "signature_delta":
                    event["delta"]["signature"] = "-"
                out.append(event)
        return out

    from_parse = await encoded(parts)
    from_bytes = await encoded([bytes(p) for p in parts])
    assert from_parse and stable(from_parse) == stable(from_bytes)
    if encoder == "messages":
        assert from_parse.replace(b" ", b"").count(b"tool_use") >= 1
