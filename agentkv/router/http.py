"""The router's one HTTP client to an engine: one bounded keep-alive pool, bodies encoded once.

:class:`EngineClient` is all the router asks of it: ``post`` a JSON body and ``get``, each a
whole :class:`Reply`; ``stream`` a POST whose body is read as it arrives (a :class:`Stream`);
``aclose``. Whatever goes wrong on the way raises :class:`TransportError` (could not connect,
connection dropped) or its subclass :class:`Timeout`; an engine's error status is a reply
like any other.

:class:`AiohttpClient` is the implementation: aiohttp's C-accelerated client, chosen by
measurement. Its pool hands out an idle connection in O(1) whatever its size, where httpcore's
walked every pooled connection on every request and release, so the router's CPU per turn grew
with concurrency (docs/benchmarks.md, "Router data plane"). ``create_app(config,
engine_client=...)`` takes another implementation (:data:`ClientFactory`): the in-process
tests' fake, which reaches the simulators' ASGI apps without sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import aiohttp
import orjson

__all__ = [
    "AiohttpClient",
    "Body",
    "ClientFactory",
    "EngineClient",
    "Headers",
    "Pool",
    "Reply",
    "Stream",
    "Timeout",
    "TransportError",
    "encode",
    "request_headers",
]

_JSON = {"content-type": "application/json"}

Body: TypeAlias = Mapping[str, Any] | bytes
"""A request body: a JSON object (encoded once with orjson) or bytes already encoded."""
Headers: TypeAlias = Mapping[str, str] | None
"""A request's extra headers (trace context), or none."""


class TransportError(Exception):
    """The engine could not be reached, or dropped the connection."""


class Timeout(TransportError):
    """The engine did not answer in time."""


def encode(body: Body) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def request_headers(data: bytes | None, extra: Headers) -> Headers:
    """A request's headers: JSON's content type with a body, and any extra (trace context)."""
    if not extra:
        return _JSON if data is not None else None
    return {**_JSON, **extra} if data is not None else dict(extra)


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole response: its status, headers (case-insensitive) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


class Stream(Protocol):
    """A response whose body has not been read yet: iterate it as it arrives (each item what
    one read returned: several SSE events when they arrived together), or ``read`` it whole;
    ``aclose`` once done with it."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    """One engine, at one base URL. ``timeout``: for the whole reply (default: the pool's,
    between reads); ``headers``: extra request headers."""

    async def post(
        self, path: str, body: Body, *, timeout: float | None = None, headers: Headers = None
    ) -> Reply: ...

    async def get(self, path: str, *, timeout: float | None = None) -> Reply: ...

    async def stream(self, path: str, body: Body, headers: Headers = None) -> Stream: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Pool:
    """One client's connection pool: ``timeout_s`` for a reply (between reads), at most
    ``max_connections`` connections, idle ones closed after ``keepalive_s`` (shorter than the
    engine's own keep-alive timeout, so the router never sends on a connection the engine is
    closing)."""

    timeout_s: float
    connect_timeout_s: float = 5.0
    max_connections: int = 256
    keepalive_s: float = 4.0


ClientFactory: TypeAlias = Callable[[str, Pool], EngineClient]
"""Makes the client of the engine at a base URL (:class:`AiohttpClient` unless injected)."""

_CAUGHT = (asyncio.TimeoutError, aiohttp.ClientError)
"""What aiohttp raises when the engine does not answer in time, or cannot be talked to."""


def _error(exc: BaseException, where: str) -> TransportError:
    """aiohttp's exception as the router's (asyncio's TimeoutError says nothing: name it)."""
    if isinstance(exc, asyncio.TimeoutError):
        return Timeout(f"{where}: timed out")
    return TransportError(f"{where}: {exc!r}")


class _AiohttpStream:
    """:class:`Stream` over an aiohttp response."""

    __slots__ = ("_response", "_where", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse, where: str) -> None:
        self._response, self._where = response, where
        self.status, self.headers = response.status, response.headers

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except _CAUGHT as exc:
            raise _error(exc, self._where) from exc

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except _CAUGHT as exc:
            raise _error(exc, self._where) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpClient:
    """One engine over aiohttp, its connections as ``pool`` says."""

    def __init__(self, base_url: str, pool: Pool) -> None:
        self.base_url, self.pool = base_url.rstrip("/"), pool
        self._connect_s = pool.connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        # created on first use, inside the running loop (aiohttp binds a session to its loop)
        if self._session is None:
            pool = self.pool
            connector = aiohttp.TCPConnector(
                limit=pool.max_connections, limit_per_host=0, keepalive_timeout=pool.keepalive_s
            )
            self._session = aiohttp.ClientSession(
                base_url=self.base_url,
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self._connect_s, sock_read=pool.timeout_s
                ),
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def _request(
        self, method: str, path: str, data: bytes | None, timeout: float | None, headers: Headers
    ) -> Reply:
        session = self._open()
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(
                total=timeout, connect=min(self._connect_s, timeout)
            )
        try:
            async with session.request(
                method, path, data=data, headers=request_headers(data, headers), **kwargs
            ) as r:
                return Reply(r.status, r.headers, await r.read())
        except _CAUGHT as exc:
            raise _error(exc, f"{method} {self.base_url}{path}") from exc

    async def post(
        self, path: str, body: Body, *, timeout: float | None = None, headers: Headers = None
    ) -> Reply:
        return await self._request("POST", path, encode(body), timeout, headers)

    async def get(self, path: str, *, timeout: float | None = None) -> Reply:
        return await self._request("GET", path, None, timeout, None)

    async def stream(self, path: str, body: Body, headers: Headers = None) -> Stream:
        session = self._open()
        where = f"POST {self.base_url}{path}"
        try:
            r = await session.request(
                "POST", path, data=encode(body), headers=request_headers(b"", headers)
            )
        except _CAUGHT as exc:
            raise _error(exc, where) from exc
        return _AiohttpStream(r, where)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
