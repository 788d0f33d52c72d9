"""Scripted answers for the agentkv simulator (the examples' ``--simulate-tools``, and the tests).

The simulator's model writes free text; its ``agentkv_sim`` body field scripts an answer (a tool
call, a given text). These agentkv clients add the next script of a queue to each chat request
in their HTTP transport, so the agent framework on top runs unchanged. Against a real model,
use plain clients (or connection settings) instead."""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

import httpx

import agentkv


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    """A script: the model calls ``name`` with ``arguments``."""
    return {"content": "", "tool_calls": [{"name": name, "arguments": arguments}]}


def answer(text: str) -> dict[str, Any]:
    """A script: the model answers ``text``."""
    return {"content": text}


class Scripts:
    """The queue of scripts; each chat request takes the next one (none left: free text)."""

    def __init__(self, scripts: Iterable[dict[str, Any]] = ()) -> None:
        self._queue: deque[dict[str, Any]] = deque(scripts)
        self._rules: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []

    def when(self, text: str, script: dict[str, Any]) -> None:
        """Answer every request whose last message contains ``text`` with ``script`` (before
        the queue, which such requests leave alone)."""
        with self._lock:
            self._rules.append((text, script))

    def extend(self, scripts: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            self._queue.extend(scripts)

    @property
    def left(self) -> int:
        return len(self._queue)

    def rewrite(self, request: httpx.Request) -> httpx.Request:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return request
        body = json.loads(request.content)
        last = json.dumps((body.get("messages") or [{}])[-1].get("content"))
        with self._lock:
            rule = next((script for text, script in self._rules if text in last), None)
            if "agentkv_sim" in body:
                pass
            elif rule is not None:
                body["agentkv_sim"] = rule
            elif self._queue:
                body["agentkv_sim"] = self._queue.popleft()
            self.requests.append(
                {"headers": dict(request.headers), "body": {**body, "messages": None}}
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
        return httpx.Request(
            request.method, request.url, headers=headers, content=json.dumps(body).encode()
        )


class _Transport(httpx.BaseTransport):
    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(self.scripts.rewrite(request))

    def close(self) -> None:
        self.inner.close()


class _AsyncTransport(httpx.AsyncBaseTransport):
    def __init__(self, scripts: Scripts, limits: httpx.Limits) -> None:
        self.scripts = scripts
        self.inner = httpx.AsyncHTTPTransport(limits=limits)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(self.scripts.rewrite(request))

    async def aclose(self) -> None:
        await self.inner.aclose()


def clients(
    base_url: str, scripts: Scripts, api_key: str = "agentkv"
) -> tuple[agentkv.Client, agentkv.AsyncClient]:
    """agentkv clients whose chat requests carry the next script.

    The async client keeps no idle connection, so it can serve several event loops one after
    the other (``asyncio.run`` per call, as tests do) without leaking sockets."""
    sync = agentkv.Client(
        base_url=base_url,
        api_key=api_key,
        http_client=httpx.Client(transport=_Transport(scripts), timeout=60),
    )
    no_keepalive = httpx.Limits(max_keepalive_connections=0)
    renderer = agentkv.AsyncRemoteRenderer(
        base_url.rstrip("/").removesuffix("/v1"),
        headers={"Authorization": f"Bearer {api_key}"},
        http_client=httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(limits=no_keepalive), timeout=60
        ),
    )
    asynchronous = agentkv.AsyncClient(
        base_url=base_url,
        api_key=api_key,
        renderer=renderer,
        http_client=httpx.AsyncClient(transport=_AsyncTransport(scripts, no_keepalive), timeout=60),
    )
    return sync, asynchronous
