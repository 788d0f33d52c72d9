"""The router's edge for APIs other than Chat Completions: one turn core, codecs around it.

A codec turns its API's request into one Chat Completions body (what the engines run: vLLM 0.33
maps ``/v1/messages`` and ``/v1/responses`` onto its chat path the same way), and the turn's
answer back into its API: a JSON body, an SSE stream of its own events, or an error in its own
shape. :func:`adapt` applies a codec's :class:`Encoder` to the Response the turn core returned;
the receipt headers pass unchanged. Errors the turn raises are rendered in each API's shape by the
app's exception handlers (:mod:`agentkv.protocol.http`), not here.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, Protocol

import orjson
from starlette.responses import Response, StreamingResponse

from agentkv.protocol.errors import UpstreamError
from agentkv.protocol.http import ORJSONResponse
from agentkv.router.sse import ParsedEvents

__all__ = ["Encoder", "adapt", "sse_events"]

_HOP = ("content-length", "content-type", "transfer-encoding", "connection")


class Encoder(Protocol):
    """One turn's answer in an API's own format (a fresh encoder per turn: streams keep
    state, such as which content blocks are open)."""

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed Chat Completions answer as the API's response body."""
        ...

    def chunk(self, chat: dict[str, Any]) -> Iterable[bytes]:
        """The API's SSE events (framed bytes) for one streamed Chat Completions chunk."""
        ...

    def done(self) -> Iterable[bytes]:
        """The API's closing events, after the chat stream's ``[DONE]``."""
        ...

    def stream_error(self, error: dict[str, Any]) -> Iterable[bytes]:
        """An error event in the middle of a stream (the chat stream's ``{"error": …}``)."""
        ...


def _headers(response: Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP}


async def _body(response: Response) -> bytes:
    if isinstance(response, StreamingResponse):
        parts = [
            part if isinstance(part, bytes) else str(part).encode()
            async for part in response.body_iterator
        ]
        return b"".join(parts)
    return bytes(response.body)


async def adapt(response: Response, encoder: Encoder) -> Response:
    """The turn core's Chat Completions answer in the encoder's API. An error response (the turn
    core raises its errors; an OpenAI-shaped body) is raised as an :class:`UpstreamError`, for the
    app's exception handlers to render in the API's shape."""
    headers = _headers(response)
    if response.status_code != 200:
        raise UpstreamError(response.status_code, await _body(response))
    if not (response.media_type or "").startswith("text/event-stream"):
        chat = orjson.loads(await _body(response))
        return ORJSONResponse(encoder.response(chat), headers=headers)
    assert isinstance(response, StreamingResponse)
    return StreamingResponse(
        _reencode(response.body_iterator, encoder),
        media_type="text/event-stream",
        headers=headers,
    )


async def _reencode(source: AsyncIterable[Any], encoder: Encoder) -> AsyncIterator[bytes]:
    """The chat stream's events in the encoder's API: one write per write of the turn core (the
    events of the chunks it carried, joined), ``[DONE]`` ending it."""
    buffer = b""
    async for part in source:
        chunks = part.chunks if isinstance(part, ParsedEvents) else None
        if chunks is not None and not buffer and part.endswith(b"\n\n"):
            events = part[:-2].split(b"\n\n")
            if len(events) == len(chunks):  # the relay's own parse of each event
                out, done = _encode(events, encoder, chunks)
                if out:
                    yield out
                if done:
                    return
                continue
        buffer += part if isinstance(part, bytes) else str(part).encode()
        if b"\n\n" not in buffer:
            continue
        *events, buffer = buffer.split(b"\n\n")
        out, done = _encode(events, encoder)
        if out:
            yield out
        if done:
            return
    if buffer:
        out, _ = _encode([buffer], encoder)
        if out:
            yield out


def _encode(
    events: list[bytes], encoder: Encoder, chunks: list[dict[str, Any] | None] | None = None
) -> tuple[bytes, bool]:
    """The encoder's bytes for whole SSE ``events`` of the chat stream, and whether ``[DONE]``
    was among them (then nothing after it counts). ``chunks``: each event's JSON object as the
    relay parsed it (None: parse it here)."""
    out: list[bytes] = []
    for i, event in enumerate(events):
        parsed = chunks[i] if chunks is not None else None
        if parsed is not None:
            if "error" in parsed:
                out.extend(encoder.stream_error(parsed["error"]))
            else:
                out.extend(encoder.chunk(parsed))
            continue
        for line in event.split(b"\n") if b"\n" in event else (event,):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out.extend(encoder.done())
                return b"".join(out), True
            chunk = orjson.loads(data)
            if "error" in chunk:
                out.extend(encoder.stream_error(chunk["error"]))
            else:
                out.extend(encoder.chunk(chunk))
    return b"".join(out), False


async def sse_events(source: AsyncIterable[Any]) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE byte stream, whatever its writes' boundaries."""
    buffer = b""
    async for part in source:
        buffer += part if isinstance(part, bytes) else str(part).encode()
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()
    for line in buffer.split(b"\n"):
        if line.startswith(b"data:"):
            yield line[5:].strip()
