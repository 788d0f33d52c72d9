"""Relaying D's answer to the client: SSE chunks as they come, with internal fields removed.

D's transfer handle never reaches a client, and the token ids the router asks D for are only
passed on when the client asked for them (the prompt's not when the client sent them itself).
A backend that puts no handle on streams (vLLM 0.32) is read without streaming and its answer
re-streamed in vLLM's chunk format.

:class:`EventRelay` is the streamed path. It works on what one read from D returned (usually
several events) and parses only what the router needs: vLLM 0.33 puts the handle
(``kv_transfer_params``) and ``finish_reason`` on the last chunks only, with ``null`` on the
others, so a block of events in which neither is set is passed through as D's bytes, with the
token-id lists found by ``bytes.find`` (the prompt's echo, 128k ids at agent sizes, costs one scan
for its closing bracket), read, and replaced by ``null`` when the client must not see them. An
event that sets one is parsed once (and so is every event when the relay reads the answer's
deltas for token identity), and only the handle's event is re-serialized: the others keep D's
bytes. ``usage``, which ``continuous_usage_stats`` (a Messages turn asks for it) puts on every
chunk, is read once, from the last event that sets it. The block goes to the client in one write.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from agentkv.protocol.deltas import DeltaFold
from agentkv.protocol.http import sse

__all__ = [
    "Captured",
    "EventRelay",
    "ParsedEvents",
    "aiter_chunks",
    "clean_response",
    "rewrite_chunk",
    "synthesize_stream",
]

_READ = re.compile(rb'"(?:kv_transfer_params|finish_reason)"\s*:\s*[^n\s]')
"""A field the router must read at once is set (not ``null``) in this event. A match inside a
string value is impossible (its quotes would be escaped); a spurious one only costs a parse."""
_USAGE = re.compile(rb'"usage"\s*:\s*[^n\s]')
"""``usage`` is set: read once, from the last event that sets it."""
_SPACE = frozenset(b" \t\n\r")
_OPENERS = frozenset(b"{,")
_DONE = b"data: [DONE]"


@dataclass
class Captured:
    """What the router keeps from D's answer."""

    handle: dict[str, Any] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    message: dict[str, Any] | None = None
    """A non-streamed chat answer's assistant message."""
    answer: DeltaFold | None = None
    """A streamed chat answer's, accumulated when the relay is asked to."""

    def assistant_message(self) -> dict[str, Any] | None:
        """The assistant message the client received (None: not kept)."""
        if self.answer is not None:
            return self.answer.message()
        return self.message


def _strip(obj: dict[str, Any], keep_ids: bool, keep_prompt_ids: bool) -> None:
    if "kv_transfer_params" in obj:
        obj["kv_transfer_params"] = None
    if not keep_prompt_ids and "prompt_token_ids" in obj:
        obj["prompt_token_ids"] = None
    for choice in obj.get("choices") or []:
        if not keep_ids and "token_ids" in choice:
            choice["token_ids"] = None
        if not keep_prompt_ids and "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None


def rewrite_chunk(
    chunk: dict[str, Any],
    captured: Captured,
    *,
    keep_ids: bool,
    keep_prompt_ids: bool | None = None,
) -> dict[str, Any]:
    """Record what a streamed chunk carries, then remove what the client must not see."""
    if chunk.get("kv_transfer_params"):
        captured.handle = chunk["kv_transfer_params"]
    if chunk.get("usage"):
        captured.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        if choice.get("token_ids"):
            captured.output_ids.extend(choice["token_ids"])
        if choice.get("finish_reason"):
            captured.finish_reason = choice["finish_reason"]
    _strip(chunk, keep_ids, keep_ids if keep_prompt_ids is None else keep_prompt_ids)
    return chunk


def clean_response(
    body: dict[str, Any], *, keep_ids: bool, keep_prompt_ids: bool | None = None
) -> Captured:
    """Capture a non-streamed answer's handle and ids, and strip them for the client
    (``keep_prompt_ids`` defaults to ``keep_ids``)."""
    captured = Captured(handle=body.get("kv_transfer_params"), usage=body.get("usage"))
    choices = body.get("choices") or []
    if choices:
        captured.output_ids = list(choices[0].get("token_ids") or [])
        captured.finish_reason = choices[0].get("finish_reason")
        message = choices[0].get("message")
        captured.message = dict(message) if isinstance(message, dict) else None
    _strip(body, keep_ids, keep_ids if keep_prompt_ids is None else keep_prompt_ids)
    return captured


class ParsedEvents(bytes):
    """Whole SSE events' bytes as the relay writes them, with the JSON object of each event as
    the relay parsed it (None: not parsed), in order: an edge codec re-encoding the stream
    reads those instead of parsing the events again. The objects are the events' before the
    ids lists were cut (the client's bytes have them ``null``): read them, do not change them."""

    chunks: list[dict[str, Any] | None]

    @classmethod
    def of(cls, data: bytes, chunks: list[dict[str, Any] | None]) -> ParsedEvents:
        out = cls(data)
        out.chunks = chunks
        return out


class EventRelay:
    """D's SSE bytes in, the client's out, :class:`Captured` filled on the way.

    ``feed`` takes what one read returned and gives back the bytes of the complete events in
    it, cleaned (empty while an event is incomplete); ``close`` what is left at the end. The
    handle is captured before the bytes of its event are returned, so the router can store it
    before the client sees the end of the turn.

    ``accumulate``: also read every event's delta into ``captured.answer`` (the assistant
    message, for token identity: one parse per event, the bytes still pass unchanged)."""

    def __init__(
        self,
        captured: Captured,
        *,
        keep_ids: bool,
        keep_prompt_ids: bool,
        accumulate: bool = False,
    ) -> None:
        self.captured = captured
        self.keep_ids, self.keep_prompt_ids = keep_ids, keep_prompt_ids
        self.done = False
        self._parts: list[bytes] = []
        self._usage: bytes | None = None
        """The last event that set ``usage`` and was not parsed (:meth:`_read_usage`)."""
        self._chunks: list[dict[str, Any] | None] = []
        if accumulate:
            captured.answer = DeltaFold()

    def feed(self, data: bytes) -> bytes:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        # only the new bytes are searched, and an incomplete event's parts are joined once, when
        # it is complete (a 128k-token echo arrives in many reads)
        end = data.rfind(b"\n\n")
        if end >= 0:
            cut = end + 2
        elif data[:1] == b"\n" and self._parts and self._parts[-1][-1:] == b"\n":
            cut = 1
        else:
            if data:
                self._parts.append(data)
            return b""
        block = b"".join((*self._parts, data[:cut])) if self._parts else data[:cut]
        self._parts = [data[cut:]] if cut < len(data) else []
        return self._block(block)

    def close(self) -> bytes:
        rest = b"".join(self._parts)
        self._parts = []
        out = self._block(rest + b"\n\n") if rest.strip() else b""
        if self._usage is not None:
            self._read_usage()
        return out

    def _block(self, block: bytes) -> bytes:
        if not self.keep_prompt_ids:
            # first: the prompt's echo (D sends it, vLLM has no switch for it alone) leaves
            # here, so nothing below reads its bytes
            block = _without_prompt_ids(block)
        if _DONE in block:
            self.done = True
        answer = self.captured.answer
        if _READ.search(block) is not None:  # the handle's or the finish's: event by event
            self._chunks = []
            out = b"".join(self._event(e, answer) for e in block.split(b"\n\n") if e)
            if any(c is not None for c in self._chunks):
                out = ParsedEvents.of(out, self._chunks)
        elif answer is not None:  # every event parsed once: its delta, its usage
            chunks = [self._read(e, answer) for e in block.split(b"\n\n") if e]
            out = ParsedEvents.of(self._ids(block), chunks)
        else:
            if _USAGE.search(block) is not None:
                self._usage_event(block)
            out = self._ids(block)
        if self.done and self._usage is not None:
            self._read_usage()
        return out

    def _event(self, event: bytes, answer: DeltaFold | None) -> bytes:
        """One event's bytes for the client. Parsed once when the router reads something in it
        (the handle, a ``finish_reason``, the deltas); re-serialized only when it carries the
        handle. The ids lists are read and cut in the bytes (:meth:`_ids`), the usage is read
        at the end (:meth:`_read_usage`): with ``continuous_usage_stats`` every chunk carries
        one, and only the last counts."""
        read = _READ.search(event) is not None
        chunks = self._chunks
        if not read and answer is None:
            if _USAGE.search(event) is not None:
                self._usage_event(event)
            chunks.append(None)
            return self._ids(event) + b"\n\n"
        light = _without_prompt_ids(event) if self.keep_prompt_ids else event
        chunk = _data(light)
        if chunk is None:
            if read:
                return b""
            chunks.append(None)
            return self._ids(event) + b"\n\n"
        chunks.append(chunk)
        if answer is not None:
            self._take(chunk, answer)
        elif chunk.get("usage"):
            self._usage, self.captured.usage = None, chunk["usage"]
        if not read:
            return self._ids(event) + b"\n\n"
        if chunk.get("kv_transfer_params") is None:
            for choice in chunk.get("choices") or []:
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    self.captured.finish_reason = choice["finish_reason"]
            return self._ids(event) + b"\n\n"
        # the handle: the one event the client gets re-serialized (it must not see the handle)
        if light is not event:
            chunk = _data(event) or chunk
        rewrite_chunk(
            chunk, self.captured, keep_ids=self.keep_ids, keep_prompt_ids=self.keep_prompt_ids
        )
        chunks[-1] = chunk
        return sse(chunk)

    def _read(self, event: bytes, answer: DeltaFold) -> dict[str, Any] | None:
        """Parse an event that sets neither the handle nor a ``finish_reason``: its delta
        and its usage are read."""
        light = _without_prompt_ids(event) if self.keep_prompt_ids else event
        chunk = _data(light)
        if chunk is not None:
            self._take(chunk, answer)
        return chunk

    def _take(self, chunk: dict[str, Any], answer: DeltaFold) -> None:
        """A parsed chunk's delta (into ``answer``) and usage."""
        choices = chunk.get("choices")
        if choices and isinstance(choices[0], dict):
            delta = choices[0].get("delta")
            if isinstance(delta, dict):
                answer.feed(delta)
        if chunk.get("usage"):
            self._usage, self.captured.usage = None, chunk["usage"]

    def _usage_event(self, block: bytes) -> None:
        """Keep the last event of ``block`` that sets ``usage``, for :meth:`_read_usage`."""
        for event in reversed(block.split(b"\n\n")):
            if _USAGE.search(event) is not None:
                self._usage = event
                return

    def _read_usage(self) -> None:
        """The usage of the last event that set one (parsed once, at the end of the stream)."""
        event, self._usage = self._usage, None
        chunk = _data(event) if event is not None else None
        if chunk is not None and chunk.get("usage"):
            self.captured.usage = chunk["usage"]

    def _ids(self, block: bytes) -> bytes:
        """Read the output ids of events that need no parse; null the lists the client must
        not see."""
        if b"token_ids" not in block:
            return block
        ids = self.captured.output_ids
        out: list[bytes] = []
        done = 0
        for prompt, start, end in _id_lists(block):
            if not prompt:
                ids.extend(orjson.loads(block[start:end]))
            if not (self.keep_prompt_ids if prompt else self.keep_ids):
                out.append(block[done:start])
                out.append(b"null")
                done = end
        if not out:
            return block
        out.append(block[done:])
        return b"".join(out)


def _data(event: bytes) -> dict[str, Any] | None:
    """The JSON object of an event's ``data:`` line (None: none, or not an object)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                chunk = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                return None
            return chunk if isinstance(chunk, dict) else None
    return None


def _id_lists(block: bytes) -> Iterator[tuple[bool, int, int]]:
    """(is the prompt's, start, end) of every ``token_ids`` / ``prompt_token_ids`` list in
    ``block``, at any depth (vLLM puts them on the chunk and on its choices). Found with
    ``bytes.find`` (memchr): a prompt's 128k ids cost one scan for their closing bracket, not a
    regular expression's attempt at every comma."""
    pos = 0
    while True:
        key = block.find(b'token_ids"', pos)
        if key < 0:
            return
        pos = key + 10
        prompt = block.endswith(b'"prompt_', 0, key)
        opening = key - (8 if prompt else 1)
        before = opening - 1
        while before >= 0 and block[before] in _SPACE:
            before -= 1
        if block[opening : opening + 1] != b'"' or before < 0 or block[before] not in _OPENERS:
            continue  # inside a string, or another key ending so
        colon = _skip_space(block, pos)
        if block[colon : colon + 1] != b":":
            continue
        start = _skip_space(block, colon + 1)
        if block[start : start + 1] != b"[":
            continue  # null
        end = block.find(b"]", start)
        if end < 0:
            return
        pos = end + 1
        yield prompt, start, end + 1


def _skip_space(block: bytes, pos: int) -> int:
    while pos < len(block) and block[pos] in _SPACE:
        pos += 1
    return pos


def _without_prompt_ids(block: bytes) -> bytes:
    """``block`` with its prompt id lists nulled (what the deltas are read from: a 128k-token
    echo is not parsed for nothing)."""
    out: list[bytes] = []
    done = 0
    for prompt, start, end in _id_lists(block):
        if prompt:
            out += (block[done:start], b"null")
            done = end
    if not out:
        return block
    out.append(block[done:])
    return b"".join(out)


async def aiter_chunks(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    """A synthesized stream (:func:`synthesize_stream`) as a response body, in the event loop."""
    for chunk in chunks:
        yield chunk


def synthesize_stream(body: dict[str, Any], *, chat: bool, include_usage: bool) -> Iterator[bytes]:
    """vLLM-style SSE chunks for a complete (already cleaned) response."""
    base = {"id": body.get("id"), "created": body.get("created"), "model": body.get("model")}
    obj = "chat.completion.chunk" if chat else "text_completion"
    choices = body.get("choices") or [{}]
    choice = choices[0]

    def chunk(c: dict[str, Any], **extra: Any) -> bytes:
        return sse({**base, "object": obj, "choices": [c], **extra})

    if chat:
        message = choice.get("message") or {}
        first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        yield chunk(first, prompt_token_ids=body.get("prompt_token_ids"))
        delta: dict[str, Any] = {}
        if message.get("reasoning"):
            delta["reasoning"] = message["reasoning"]
        if message.get("content"):
            delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                dict(call, index=i) for i, call in enumerate(message["tool_calls"])
            ]
        last = {"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}
    else:
        last = {
            "index": 0,
            "text": choice.get("text", ""),
            "finish_reason": choice.get("finish_reason"),
        }
    last["stop_reason"] = choice.get("stop_reason")
    if choice.get("token_ids") is not None:
        last["token_ids"] = choice["token_ids"]
    yield chunk(last)
    if include_usage and body.get("usage"):
        yield sse({**base, "object": obj, "choices": [], "usage": body["usage"]})
    yield sse("[DONE]")
