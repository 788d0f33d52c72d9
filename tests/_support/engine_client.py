"""A fake of the router's engine client for in-process tests: no sockets, no processes.

The router talks to an engine only through :class:`agentkv.router.http.EngineClient`; its one
real implementation is aiohttp's (covered on loopback by tests/router/test_engine_client.py).
:class:`InProcessEngines` is a :data:`~agentkv.router.http.ClientFactory` whose clients send
each request to the ASGI app registered for its URL's port (``httpx.ASGITransport``: the app
runs to the end of its answer, whose parts are then iterated as they were sent). Like the real
client, they raise the router's :class:`~agentkv.router.http.TransportError` (here: nothing
listens on that port) and return an engine's error status as a reply. They take timeouts but
do not enforce them: the in-process simulators answer at once (``time_scale`` 0, a manual
clock), and a deadline on a busy test machine's wall clock would only make them flaky; the real
client's timeouts are tested on loopback.

mypy checks this module against the interface (pyproject.toml, ``[tool.mypy] modules``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from agentkv.router.http import (
    Body,
    ClientFactory,
    EngineClient,
    Headers,
    Pool,
    Reply,
    Stream,
    TransportError,
    encode,
    request_headers,
)

__all__ = ["InProcessEngine", "InProcessEngines"]

Apps = Mapping[int, Any]
"""ASGI apps by the port their URLs name (filled in as the test builds them)."""


class _Stream:
    """:class:`~agentkv.router.http.Stream` over an answer the ASGI app has finished."""

    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status: int = response.status_code
        self.headers: Mapping[str, str] = response.headers

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self._response.aiter_raw():
            yield data

    async def read(self) -> bytes:
        return await self._response.aread()

    async def aclose(self) -> None:
        await self._response.aclose()


class InProcessEngine:
    """One engine's client: its requests go to ``apps[port of base_url]``."""

    def __init__(self, apps: Apps, base_url: str, pool: Pool) -> None:
        self.apps, self.base_url, self.pool = apps, base_url.rstrip("/"), pool
        self._port = httpx.URL(base_url).port or 80

    async def _send(
        self, method: str, path: str, data: bytes | None, headers: Headers
    ) -> httpx.Response:
        app = self.apps.get(self._port)
        if app is None:
            where = f"{method} {self.base_url}{path}"
            raise TransportError(f"{where}: nothing listens on port {self._port}")
        request = httpx.Request(
            method, self.base_url + path, content=data, headers=request_headers(data, headers)
        )
        return await httpx.ASGITransport(app=app).handle_async_request(request)

    async def post(
        self, path: str, body: Body, *, timeout: float | None = None, headers: Headers = None
    ) -> Reply:
        r = await self._send("POST", path, encode(body), headers)
        return Reply(r.status_code, r.headers, await r.aread())

    async def get(self, path: str, *, timeout: float | None = None) -> Reply:
        r = await self._send("GET", path, None, None)
        return Reply(r.status_code, r.headers, await r.aread())

    async def stream(self, path: str, body: Body, headers: Headers = None) -> Stream:
        return _Stream(await self._send("POST", path, encode(body), headers))

    async def aclose(self) -> None:
        return None


class InProcessEngines:
    """The router's ``engine_client``: each engine's client reaches its app in ``apps``."""

    def __init__(self, apps: Apps) -> None:
        self.apps = apps

    def __call__(self, base_url: str, pool: Pool) -> EngineClient:
        return InProcessEngine(self.apps, base_url, pool)


_FACTORY: ClientFactory = InProcessEngines({})  # its type, checked by mypy
