"""A recording reverse proxy for the replay tests: a real HTTP server on 127.0.0.1 that passes
every request to the router unchanged (streams included) and keeps what it received: method,
path, headers and body, and the router's status. Put between a replay and the router, it shows
what the router was sent, byte for byte, without touching either side."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests._support.threaded_server import serve_in_thread

# hop-by-hop and framing headers, which the proxy's own server and client set
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Received:
    method: str
    path: str
    """Path and query, as the router got them."""
    headers: dict[str, str]
    """Lower-case names."""
    body: bytes
    status: int = 0

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Recorder:
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> list[Received]:
        with self.lock:
            out, self.requests = self.requests, []
        return out


def _app(target: str, rec: Recorder) -> Starlette:
    client = httpx.AsyncClient(base_url=target, trust_env=False, timeout=120)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k.lower(): v for k, v in request.headers.items()}
        seen = Received(request.method, path, headers, body)
        with rec.lock:
            rec.requests.append(seen)
        upstream = client.build_request(
            request.method,
            path,
            content=body,
            headers={k: v for k, v in headers.items() if k not in _HOP},
        )
        response = await client.send(upstream, stream=True)
        seen.status = response.status_code

        async def relay() -> AsyncIterator[bytes]:
            async for chunk in response.aiter_raw():
                yield chunk

        return StreamingResponse(
            relay(),
            status_code=response.status_code,
            headers={k: v for k, v in response.headers.items() if k.lower() not in _HOP},
            background=BackgroundTask(response.aclose),
        )

    methods = ["GET", "POST", "DELETE", "PUT"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


@contextlib.contextmanager
def recording_proxy(target: str) -> Iterator[tuple[str, Recorder]]:
    """A proxy to ``target`` (a root URL); yields its root URL and what it records."""
    rec = Recorder()
    with serve_in_thread(_app(target, rec), "the proxy", loop="asyncio", http="h11") as url:
        yield url, rec
