"""The relay (:class:`agentkv.router.relay.Relay`) on real sockets, as the router runs it.

D is a socket server that writes a recorded simulator stream (a tool call, token ids on every
chunk, the handle on the finish chunk) as HTTP/1.1 chunks, each when the test says; the router
side reads it with its own aiohttp client and serves the relay's bytes with Starlette on uvicorn
to an httpx client. Checked: the fast path (events that set nothing go out as D's bytes, in one
write per read), the slow path (the finish event is parsed, its handle stored before the client
sees it and kept from the client), a client hang-up (D read to the end and its handle stored, or
D's connection closed when too many streams already drain, or after ``drain_timeout_s``), and
D dying mid-stream (an error event in OpenAI's shape and a clean end).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from agentkv.router.http import AiohttpClient, Pool
from agentkv.router.relay import Relay, StreamOutcome
from agentkv.router.sse import Captured

STREAM = (Path(__file__).parent / "data" / "d_stream_tool_call.sse").read_bytes()
EVENTS = [event + b"\n\n" for event in STREAM.split(b"\n\n") if event.strip()]
FINISH = next(i for i, e in enumerate(EVENTS) if b'"kv_transfer_params":{' in e)
DIE = b"<die>"

pytestmark = pytest.mark.anyio


class D:
    """D's side of streamed answers on a real socket; each item of ``writes`` is one write
    (``None``: the end of the body, :data:`DIE`: the connection reset)."""

    def __init__(self) -> None:
        self.writes: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.hung_up = asyncio.Event()
        """The router closed the connection of the answer."""
        self.url = ""

    async def __aenter__(self) -> D:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        found = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(found.group(1)) if found else 0)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        eof = asyncio.ensure_future(reader.read(1))
        try:
            while True:
                get = asyncio.ensure_future(self.writes.get())
                await asyncio.wait({get, eof}, return_when=asyncio.FIRST_COMPLETED)
                if eof.done():
                    get.cancel()
                    break
                data = get.result()
                if data == DIE:
                    writer.transport.abort()
                    return
                writer.write(b"0\r\n\r\n" if data is None else b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
            self.hung_up.set()
        except ConnectionError:
            self.hung_up.set()
        finally:
            eof.cancel()
            writer.close()

    def send(self, *events: bytes) -> None:
        """One write of ``events`` (what one read of the router then returns)."""
        self.writes.put_nowait(b"".join(events))


@dataclass
class Router:
    relay: Relay
    url: str
    stored: list[Captured] = field(default_factory=list)
    ended: asyncio.Queue[StreamOutcome] = field(default_factory=asyncio.Queue)
    sent_at_store: list[int] = field(default_factory=list)
    """How many bytes the client had got when the handle was stored."""
    got: list[bytes] = field(default_factory=list)
    left: asyncio.Event = field(default_factory=asyncio.Event)
    """The server stopped the relay's stream (the client hung up)."""


@contextlib.asynccontextmanager
async def router(
    d: D, *, max_drains: int = 4, drain_timeout_s: float = 30.0
) -> AsyncIterator[Router]:
    """The relay between D and a client, served on a real socket."""
    relay = Relay(drain_timeout_s=drain_timeout_s, max_drains=max_drains)
    engine = AiohttpClient(d.url, Pool(timeout_s=10.0))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    r = Router(relay, f"http://127.0.0.1:{sock.getsockname()[1]}")

    async def on_handle(captured: Captured) -> None:
        r.stored.append(captured)
        r.sent_at_store.append(sum(map(len, r.got)))

    async def chat(request: Request) -> StreamingResponse:
        upstream = await engine.stream("/v1/chat/completions", {"stream": True})
        stream = relay.stream(
            upstream, keep_ids=False, on_handle=on_handle, on_end=r.ended.put_nowait
        )

        async def watched() -> AsyncIterator[bytes]:
            try:
                async for data in stream:
                    yield data
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
                r.left.set()

        return StreamingResponse(watched(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http="h11", loop="asyncio")
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
        await asyncio.sleep(0.01)
    try:
        yield r
    finally:
        server.should_exit = True
        await serving
        await relay.aclose()
        await engine.aclose()
        sock.close()


async def stream(r: Router, http: httpx.AsyncClient) -> AsyncIterator[bytes]:
    async with http.stream("POST", r.url + "/v1/chat/completions", json={}) as response:
        assert response.status_code == 200
        async for data in response.aiter_raw():
            r.got.append(data)
            yield data


async def draining(relay: Relay, count: int) -> None:
    async with asyncio.timeout(5):
        while relay.draining != count:  # noqa: ASYNC110 (a counter, no event)
            await asyncio.sleep(0.005)


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=10, trust_env=False)


async def test_plain_events_pass_as_ds_bytes_and_the_handle_is_stored_before_the_end() -> None:
    async with D() as d, router(d) as r, client() as http:
        d.send(*EVENTS[1:4])  # token ids on each: nulled, nothing else parsed
        d.send(*EVENTS[4:FINISH])
        d.send(*EVENTS[FINISH:])
        d.writes.put_nowait(None)
        reads = [data async for data in stream(r, http)]
        outcome = await asyncio.wait_for(r.ended.get(), 5)
    body = b"".join(reads)
    plain = b"".join(EVENTS[1:4])
    want = re.sub(rb'"token_ids":\[[0-9,]*\]', b'"token_ids":null', plain)
    assert body.startswith(want) and b'"token_ids":[' not in body  # D's bytes, ids nulled
    # the slow path: the finish event parsed, its handle stored, and kept from the client
    assert outcome.done and not outcome.abandoned and not outcome.failed
    [captured] = r.stored
    assert captured.handle is not None and captured.finish_reason == "tool_calls"
    assert captured.output_ids and b'kv_transfer_params":{' not in body
    assert r.sent_at_store[0] < len(body)  # stored before the client saw the finish event
    assert body.endswith(b"data: [DONE]\n\n")


async def test_a_client_that_hangs_up_leaves_d_read_to_the_end_and_its_handle_stored() -> None:
    async with D() as d, router(d) as r, client() as http:
        d.send(*EVENTS[:3])
        async for _ in stream(r, http):
            break  # the client leaves after the first read
        await asyncio.wait_for(r.left.wait(), 5)
        d.send(*EVENTS[3:FINISH])
        await draining(r.relay, 1)
        assert not r.stored
        d.send(*EVENTS[FINISH:])
        d.writes.put_nowait(None)
        outcome = await asyncio.wait_for(r.ended.get(), 5)
        assert outcome.abandoned and outcome.drained and outcome.done
        assert r.relay.draining == 0 and len(r.relay._tasks) == 0
        [captured] = r.stored
        assert captured.handle is not None


@pytest.mark.parametrize("why", ["too many drain", "drain timeout"])
async def test_a_client_that_hangs_up_frees_d_when_the_relay_does_not_drain(why: str) -> None:
    limits = {"max_drains": 0} if why == "too many drain" else {"drain_timeout_s": 0.2}
    async with D() as d, router(d, **limits) as r, client() as http:
        d.send(*EVENTS[:3])
        async for _ in stream(r, http):
            break
        await asyncio.wait_for(r.left.wait(), 5)
        if why == "drain timeout":
            d.send(EVENTS[3])
            await draining(r.relay, 1)
            await asyncio.sleep(0.3)
            d.send(EVENTS[4])  # the next read finds the time up
        await asyncio.wait_for(d.hung_up.wait(), 5)  # D's connection closed: D aborts
        outcome = await asyncio.wait_for(r.ended.get(), 5)
        assert outcome.abandoned and not outcome.drained and not outcome.done
        assert r.relay.draining == 0 and len(r.relay._tasks) == 0 and not r.stored


async def test_d_dying_mid_stream_ends_the_clients_stream_with_an_error_event() -> None:
    async with D() as d, router(d) as r, client() as http:
        d.send(*EVENTS[:5])
        d.writes.put_nowait(DIE)
        body = b"".join([data async for data in stream(r, http)])
        outcome = await asyncio.wait_for(r.ended.get(), 5)
    assert outcome.failed and not outcome.done and not r.stored
    last = body.split(b"\n\n")[-3]
    assert last.startswith(b"data: ")
    error = orjson.loads(last[6:])["error"]
    assert error["code"] == 502 and "127.0.0.1" not in error["message"]
    assert body.endswith(b"data: [DONE]\n\n")
