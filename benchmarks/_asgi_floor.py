"""The floor for a P/D proxy built on the router's own stack: uvicorn (httptools, uvloop), a bare
ASGI callable, aiohttp to the engines, orjson.

The same steps as :mod:`benchmarks._relay_floor` (P with ``max_tokens: 1`` and the previous
turn's D handle or ``do_remote_decode``, D with P's handle, D's bytes to the client as they
arrive, D's handle kept per ``conversation_id`` from a substring search) and nothing more: no
routing table, no middleware, no verification, no receipts. What it costs over the raw floor is
what the router's stack costs before the router does anything; what the router costs over it
is the router's own work. Not a product: a measuring stick.

Run: ``python -m benchmarks._asgi_floor PORT PREFILL_URL DECODE_URL``.
"""

from __future__ import annotations

import sys
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import uvicorn

from benchmarks._relay_floor import MARK, handle_in, prefill_request

JSON = {"Content-Type": "application/json"}


class AsgiFloor:
    def __init__(self, prefill: str, decode: str) -> None:
        self.p, self.d = prefill.rstrip("/"), decode.rstrip("/")
        self.p_host = urlsplit(prefill).hostname or "127.0.0.1"
        self.d_host = urlsplit(decode).hostname or "127.0.0.1"
        self.handles: dict[str, dict[str, Any]] = {}
        self.session: aiohttp.ClientSession | None = None

    def keep(self, conv: str | None, line: bytes) -> None:
        if conv and (params := handle_in(line)):
            params["remote_host"] = self.d_host
            self.handles[conv] = params

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=4.0)
                    self.session = aiohttp.ClientSession(connector=connector)
                    await send({"type": "lifespan.startup.complete"})
                else:
                    if self.session is not None:
                        await self.session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await self.turn(scope["path"], b"".join(parts), send)

    async def turn(self, path: str, body: bytes, send: Any) -> None:
        assert self.session is not None
        req, conv, p_body = prefill_request(body, self.handles)
        async with self.session.post(self.p + path, data=orjson.dumps(p_body), headers=JSON) as r:
            d_params = orjson.loads(await r.read())["kv_transfer_params"]
        d_params["remote_host"] = self.p_host
        d_body = orjson.dumps(dict(req, kv_transfer_params=d_params))
        async with self.session.post(self.d + path, data=d_body, headers=JSON) as r:
            kind = r.headers.get("Content-Type", "application/json").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": r.status,
                    "headers": [(b"content-type", kind)],
                }
            )
            carry = b""
            async for data in r.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
                seen = carry + data
                at = seen.find(MARK)
                if at >= 0 and (end := seen.find(b"\n", at)) >= 0:
                    self.keep(conv, seen[seen.rfind(b"\n", 0, at) + 1 : end])
                    carry = b""
                else:
                    carry = seen[seen.rfind(b"\n") + 1 :] if at < 0 else seen
            if carry and MARK in carry:
                self.keep(conv, carry[carry.rfind(b"\n", 0, carry.find(MARK)) + 1 :])
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def main(port: int, prefill: str, decode: str) -> None:
    uvicorn.run(
        AsgiFloor(prefill, decode),
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
