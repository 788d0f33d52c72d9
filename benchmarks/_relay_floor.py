"""The floor for a Python P/D proxy: raw asyncio, pooled keep-alive connections, D's bytes through.

What every P/D proxy must do and nothing more: read the client's request, send P the same body
with ``max_tokens: 1`` and the previous turn's D handle (or ``do_remote_decode``), send D the
body with P's handle, and pass D's response bytes to the client as they arrive (one write per
read). Like vLLM's example proxy it keeps D's handle per ``conversation_id`` (found in D's
bytes by a substring search, parsed only on that line), verifies nothing and strips nothing.
HTTP/1.1 only as far as the engines (uvicorn) and the benchmark's client speak it: requests
with ``Content-Length``, responses with ``Content-Length`` or chunked, where a chunked SSE body
ends with ``\\r\\n0\\r\\n\\r\\n`` (an SSE event ends with a blank line, so a data chunk never
does). Not a product: a measuring stick.

Run: ``python -m benchmarks._relay_floor PORT PREFILL_URL DECODE_URL``.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import orjson

IDLE_S = 4.0
MARK = b'"kv_transfer_params":{'
PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Pool:
    """Idle keep-alive connections to one engine."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.idle: collections.deque[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]
        self.idle = collections.deque()

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        now = time.monotonic()
        while self.idle:
            r, w, t = self.idle.pop()
            if now - t < IDLE_S and not r.at_eof():
                return r, w
            w.close()
        return await asyncio.open_connection(self.host, self.port)

    def put(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.idle.append((r, w, time.monotonic()))

    def head(self, path: str, n: int) -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
        ).encode()


async def read_head(r: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes]]:
    raw = await r.readuntil(b"\r\n\r\n")
    lines = raw.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        if v:
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers


async def post(pool: Pool, path: str, body: bytes) -> bytes:
    r, w = await pool.get()
    w.write(pool.head(path, len(body)) + body)
    _, headers = await read_head(r)
    data = await r.readexactly(int(headers[b"content-length"]))
    pool.put(r, w)
    return data


def handle_in(line: bytes) -> dict[str, Any] | None:
    """D's handle in its finish chunk (``data: {...}``) or whole JSON answer, if any."""
    payload = line.strip()
    payload = payload[6:] if payload.startswith(b"data: ") else payload
    try:
        params = orjson.loads(payload).get("kv_transfer_params")
    except orjson.JSONDecodeError:
        return None
    return params if isinstance(params, dict) and params else None


def prefill_request(
    body: bytes, handles: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """The client's request (without ``conversation_id``), its conversation and P's body:
    ``max_tokens: 1``, not streamed, with the conversation's last D handle (taken from
    ``handles``) or ``do_remote_decode``."""
    req = orjson.loads(body)
    conv = req.pop("conversation_id", None)
    held = handles.pop(conv, None) if conv else None
    params = dict(held, do_remote_decode=True, do_remote_prefill=False) if held else PREFILL
    p_body = dict(req, max_tokens=1, stream=False, kv_transfer_params=params)
    p_body.pop("stream_options", None)
    return req, conv, p_body


class Floor:
    def __init__(self, prefill: str, decode: str) -> None:
        self.p, self.d = Pool(prefill), Pool(decode)
        self.handles: dict[str, dict[str, Any]] = {}

    def keep(self, conv: str | None, line: bytes) -> None:
        if conv and (params := handle_in(line)):
            params["remote_host"] = self.d.host
            self.handles[conv] = params

    async def serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    start, headers = await read_head(r)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = await r.readexactly(int(headers.get(b"content-length", b"0")))
                path = start.split(b" ")[1].decode()
                if path == "/health":
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    continue
                await self.turn(path, body, w)
        finally:
            w.close()

    async def turn(self, path: str, body: bytes, w: asyncio.StreamWriter) -> None:
        req, conv, p_body = prefill_request(body, self.handles)
        p_params = orjson.loads(await post(self.p, path, orjson.dumps(p_body)))
        d_params = p_params["kv_transfer_params"]
        d_params["remote_host"] = self.p.host
        d_body = orjson.dumps(dict(req, kv_transfer_params=d_params))
        dr, dw = await self.d.get()
        dw.write(self.d.head(path, len(d_body)) + d_body)
        status, headers = await read_head(dr)
        kind = headers.get(b"content-type", b"application/json")
        if b"content-length" in headers:
            data = await dr.readexactly(int(headers[b"content-length"]))
            self.d.put(dr, dw)
            if MARK in data:
                self.keep(conv, data)
            w.write(
                status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                b"%d\r\n\r\n" % len(data) + data
            )
            return
        w.write(status + b"\r\nContent-Type: " + kind + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        carry = tail = b""
        while True:
            data = await dr.read(65536)
            if not data:
                raise ConnectionError("D closed the stream")
            w.write(data)
            seen = carry + data
            at = seen.find(MARK)
            if at >= 0 and seen.find(b"\n", at) >= 0:
                line_start = seen.rfind(b"\n", 0, at) + 1
                self.keep(conv, seen[line_start : seen.find(b"\n", at)])
                carry = b""
            else:
                carry = seen[seen.rfind(b"\n") + 1 :] if at < 0 else seen
            tail = (tail + data)[-7:]  # the end may be split over two reads
            if tail.endswith(b"\r\n0\r\n\r\n"):
                break
        self.d.put(dr, dw)


async def main(port: int, prefill: str, decode: str) -> None:
    floor = Floor(prefill, decode)
    server = await asyncio.start_server(floor.serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
