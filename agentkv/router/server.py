"""How the router is served: uvicorn, with every request's head (line and headers) bounded.

A limit on headers cannot live in the ASGI app: by the time the app runs, uvicorn has parsed and
held the whole head. uvicorn's httptools protocol has no limit at all (a 32 MiB header is read,
copied and handed over before any key is checked); its h11 protocol has h11's 16 KiB but answers
400. :func:`bounded_protocol` is uvicorn's own protocol (httptools when installed, as uvicorn
picks, else h11) that counts a request's head as it arrives and, once it passes ``max_bytes`` or
``max_fields`` header fields, answers 431 in OpenAI's error shape and closes the connection: the
app never sees the request. The connection is read (and dropped) for up to a second after the
answer, so a client still sending its head reads the 431 instead of a reset.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson

from agentkv.protocol.errors import error_body

__all__ = ["HeadLimits", "bounded_protocol"]

log = logging.getLogger("agentkv.router")

_LINGER_S = 1.0
"""How long a refused connection is still read (and dropped) before it is closed."""


@dataclass(frozen=True)
class HeadLimits:
    """What one request's head may hold."""

    max_bytes: int
    """Request line and header fields together, in bytes."""
    max_fields: int
    """Header fields."""


def _answer_431(message: str) -> bytes:
    body = orjson.dumps(error_body(431, message))
    head = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n\r\n"
    ) % len(body)
    return head + body


class _Served(Protocol):
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None


def _refuse(protocol: _Served, message: str) -> None:
    """Answer 431, stop parsing; close after :data:`_LINGER_S` or when the client does."""
    client = "{}:{}".format(*protocol.client) if protocol.client else "?"
    log.warning("request head refused (431) client=%s: %s", client, message)
    transport = protocol.transport
    transport.write(_answer_431(message))
    if transport.can_write_eof():
        transport.write_eof()
    protocol.loop.call_later(_LINGER_S, transport.close)


class _Refused(Exception):
    """Raised from httptools' header callback: httptools stops parsing."""


def bounded_protocol(
    limits: HeadLimits, parser: Literal["auto", "httptools", "h11"] = "auto"
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (for ``uvicorn.Config(http=...)``) with ``limits``;
    ``parser`` as uvicorn's ``--http`` (``auto``: httptools when installed)."""
    if parser == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            parser = "h11"
    return _h11_protocol(limits) if parser == "h11" else _httptools_protocol(limits)


def _too_large(limits: HeadLimits) -> str:
    return f"The request line and header fields are over {limits.max_bytes} bytes."


def _too_many(limits: HeadLimits) -> str:
    return f"The request has more than {limits.max_fields} header fields."


def _over(limits: HeadLimits, fields: int, size: int) -> str | None:
    """Why a head with ``fields`` fields of ``size`` bytes so far is refused, or None."""
    if fields > limits.max_fields:
        return _too_many(limits)
    if size > limits.max_bytes:
        return _too_large(limits)
    return None


def _httptools_protocol(limits: HeadLimits) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """Counts the bytes received while a head is incomplete (a head that never ends), and
        the fields and bytes parsed (a head that ends within one large read)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.received = 0
            self.in_head = True
            self.fields = self.parsed = 0
            self.over: str | None = None
            self.refused = False

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return  # drop what is still coming until the connection closes
            if self.in_head:
                self.received += len(data)
            super().data_received(data)  # a field over the limits: send_400_response, below
            if not self.refused and self.in_head and self.received > limits.max_bytes:
                self.refused = True
                _refuse(self, _too_large(limits))

        def send_400_response(self, msg: str) -> None:
            if self.over is not None:
                self.refused = True
                _refuse(self, self.over)
            else:
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.fields = self.parsed = 0

        def on_url(self, url: bytes) -> None:
            self.parsed += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self.fields += 1
            self.parsed += len(name) + len(value) + 4  # ": " and CRLF
            self.over = _over(limits, self.fields, self.parsed)
            if self.over is not None:
                raise _Refused  # httptools stops parsing and raises HttpParserCallbackError
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.in_head, self.received = True, 0

    return BoundedHttpToolsProtocol


def _h11_protocol(limits: HeadLimits) -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedConnection(h11.Connection):
        """h11 bounds an incomplete head itself (``max_incomplete_event_size``); this also
        bounds a complete one, and its fields."""

        def __init__(self) -> None:
            super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_bytes)
            self.over: str | None = None

        def next_event(self) -> Any:
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as exc:
                if exc.error_status_hint == 431:
                    self.over = _too_large(limits)
                raise
            if isinstance(event, h11.Request):
                size = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
                self.over = _over(limits, len(event.headers), size)
                if self.over is not None:
                    raise h11.RemoteProtocolError(self.over, error_status_hint=431)
            return event

    class BoundedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = self.bounded = BoundedConnection()

        def data_received(self, data: bytes) -> None:
            if self.bounded.over is None:
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            if self.bounded.over is not None:
                _refuse(self, self.bounded.over)
            else:
                super().send_400_response(msg)

    return BoundedH11Protocol
