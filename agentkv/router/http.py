"""The router's HTTP client to one engine: one bounded keep-alive pool, bodies encoded once.

Two implementations of one small interface (:class:`EngineClient`):

* :class:`AiohttpClient` (the default): aiohttp's C-accelerated client. Its pool hands out an
  idle connection in O(1) whatever its size, where httpcore's walks every pooled connection
  (``has_expired()``, a socket poll each) on every request and every release, so the router's
  CPU per turn grew with concurrency (docs/benchmarks.md, "Router data plane").
* :class:`HttpxClient`: httpx, for an injected ``httpx.AsyncBaseTransport`` (tests that run the
  engines in-process) and as the measured alternative.

Both take their pool's settings as one :class:`Pool`, request bodies as ``dict`` (encoded once
with orjson) or ``bytes``, and raise only
:class:`TransportError` (connection failed or dropped) and its subclass :class:`Timeout`.
Replies keep httpx's attribute names (``status_code``, ``headers``, ``content``, ``json()``,
``aread()``, ``aclose()``), so the orchestration reads the same over either.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeAlias, TypeVar

import aiohttp
import httpx
import orjson

__all__ = [
    "AiohttpClient",
    "EngineClient",
    "HttpxClient",
    "Pool",
    "Reply",
    "StreamReply",
    "Timeout",
    "TransportError",
    "encode",
]

_JSON = {"content-type": "application/json"}
_R = TypeVar("_R")

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


def _headers(data: bytes | None, extra: Headers) -> Headers:
    """The request's headers: JSON's content type with a body, and any extra (trace context)."""
    if not extra:
        return _JSON if data is not None else None
    return {**_JSON, **extra} if data is not None else dict(extra)


class _Errors:
    """One HTTP library's exceptions as this module's: ``caught`` is what to catch, calling it
    gives the :class:`Timeout` or :class:`TransportError` to raise (``where``: the request)."""

    __slots__ = ("_quiet_timeout", "_timeout", "caught")

    def __init__(
        self, timeout: type[BaseException], error: type[BaseException], *, quiet_timeout: bool
    ) -> None:
        self._timeout, self.caught = timeout, (timeout, error)
        # asyncio's TimeoutError says nothing (``TimeoutError()``): name it instead
        self._quiet_timeout = quiet_timeout

    def __call__(self, exc: BaseException, where: str = "") -> TransportError:
        if not where:
            return (Timeout if isinstance(exc, self._timeout) else TransportError)(repr(exc))
        if isinstance(exc, self._timeout):
            return Timeout(f"{where}: timed out" if self._quiet_timeout else f"{where}: {exc!r}")
        return TransportError(f"{where}: {exc!r}")


_AIOHTTP_ERRORS = _Errors(asyncio.TimeoutError, aiohttp.ClientError, quiet_timeout=True)
_HTTPX_ERRORS = _Errors(httpx.TimeoutException, httpx.HTTPError, quiet_timeout=False)


class Reply:
    """A whole response."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: Mapping[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    def json(self) -> Any:
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class StreamReply(Protocol):
    """A response whose body has not been read yet."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def aread(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each item is what one read returned (several SSE events
        when they arrived together)."""
        ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    async def post(
        self, path: str, body: Body, *, timeout: float | None = None, headers: Headers = None
    ) -> Reply: ...

    async def get(self, path: str, *, timeout: float | None = None) -> Reply: ...

    async def stream(self, path: str, body: Body, headers: Headers = None) -> StreamReply: ...

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


class _Client:
    """What both clients share: the URL and pool, ``post`` and ``get`` over their ``_request``."""

    def __init__(self, base_url: str, pool: Pool) -> None:
        self.base_url, self.pool = base_url, pool

    async def _request(
        self, method: str, path: str, data: bytes | None, timeout: float | None, headers: Headers
    ) -> Reply:
        raise NotImplementedError

    async def post(
        self, path: str, body: Body, *, timeout: float | None = None, headers: Headers = None
    ) -> Reply:
        return await self._request("POST", path, encode(body), timeout, headers)

    async def get(self, path: str, *, timeout: float | None = None) -> Reply:
        return await self._request("GET", path, None, timeout, None)


class _Stream(Generic[_R]):
    """What both streamed replies share: the status and headers (read when the reply arrived),
    ``aread`` over the library's own read (``_read``), its errors translated by ``_errors``."""

    __slots__ = ("_response", "headers", "status_code")
    _errors: ClassVar[_Errors]

    def __init__(self, response: _R, status_code: int, headers: Mapping[str, str]) -> None:
        self._response, self.status_code, self.headers = response, status_code, headers

    def _read(self) -> Awaitable[bytes]:
        raise NotImplementedError

    async def aread(self) -> bytes:
        try:
            return await self._read()
        except self._errors.caught as exc:
            raise self._errors(exc) from exc


# -- aiohttp ---------------------------------------------------------------------------------


class _AiohttpStream(_Stream[aiohttp.ClientResponse]):
    __slots__ = ()
    _errors = _AIOHTTP_ERRORS

    def _read(self) -> Awaitable[bytes]:
        return self._response.read()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except _AIOHTTP_ERRORS.caught as exc:
            raise _AIOHTTP_ERRORS(exc) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpClient(_Client):
    """One engine over aiohttp, its connections as ``pool`` says."""

    def __init__(self, base_url: str, pool: Pool) -> None:
        super().__init__(base_url.rstrip("/"), pool)
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

    def _timeout(self, timeout: float | None) -> aiohttp.ClientTimeout | None:
        if timeout is None:
            return None  # the session's
        return aiohttp.ClientTimeout(total=timeout, connect=min(self._connect_s, timeout))

    async def _request(
        self, method: str, path: str, data: bytes | None, timeout: float | None, headers: Headers
    ) -> Reply:
        session = self._open()
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = self._timeout(timeout)
        try:
            async with session.request(
                method, path, data=data, headers=_headers(data, headers), **kwargs
            ) as r:
                content = await r.read()
                return Reply(r.status, r.headers, content)
        except _AIOHTTP_ERRORS.caught as exc:
            raise _AIOHTTP_ERRORS(exc, f"{method} {self.base_url}{path}") from exc

    async def stream(self, path: str, body: Body, headers: Headers = None) -> StreamReply:
        session = self._open()
        try:
            r = await session.request(
                "POST", path, data=encode(body), headers=_headers(b"", headers)
            )
        except _AIOHTTP_ERRORS.caught as exc:
            raise _AIOHTTP_ERRORS(exc, f"POST {self.base_url}{path}") from exc
        return _AiohttpStream(r, r.status, r.headers)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# -- httpx -----------------------------------------------------------------------------------


class _HttpxStream(_Stream[httpx.Response]):
    __slots__ = ()
    _errors = _HTTPX_ERRORS

    def _read(self) -> Awaitable[bytes]:
        return self._response.aread()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for data in self._response.aiter_raw():
                yield data
        except _HTTPX_ERRORS.caught as exc:
            raise _HTTPX_ERRORS(exc) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxClient(_Client):
    """One engine over httpx (an injected transport, or the measured alternative), its
    connections as ``pool`` says, at most ``max_keepalive`` of them idle."""

    def __init__(
        self,
        base_url: str,
        pool: Pool,
        *,
        max_keepalive: int = 20,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, pool)
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(pool.timeout_s, connect=pool.connect_timeout_s),
            transport=transport,
            trust_env=False,
            # few idle connections: httpcore walks every pooled one on each request and release
            limits=httpx.Limits(
                max_connections=pool.max_connections,
                max_keepalive_connections=max_keepalive,
                keepalive_expiry=pool.keepalive_s,
            ),
        )

    async def _request(
        self, method: str, path: str, data: bytes | None, timeout: float | None, headers: Headers
    ) -> Reply:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            r = await self._client.request(
                method, path, content=data, headers=_headers(data, headers), **kwargs
            )
        except _HTTPX_ERRORS.caught as exc:
            raise _HTTPX_ERRORS(exc, f"{method} {self.base_url}{path}") from exc
        return Reply(r.status_code, r.headers, r.content)

    async def stream(self, path: str, body: Body, headers: Headers = None) -> StreamReply:
        request = self._client.build_request(
            "POST", path, content=encode(body), headers=_headers(b"", headers)
        )
        try:
            r = await self._client.send(request, stream=True)
        except _HTTPX_ERRORS.caught as exc:
            raise _HTTPX_ERRORS(exc, f"POST {self.base_url}{path}") from exc
        return _HttpxStream(r, r.status_code, r.headers)

    async def aclose(self) -> None:
        await self._client.aclose()
