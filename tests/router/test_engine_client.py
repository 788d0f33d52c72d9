"""The router's one engine client (aiohttp, agentkv.router.http) against a real simulator process
on loopback: what the in-process tests' fake stands in for. A streamed answer arrives in parts;
an engine's error status is a reply, not an exception; an engine that sends nothing is a
:class:`Timeout` (or the router's own first-byte deadline cancels the request); a stream cut
mid-answer and a port nobody listens on are :class:`TransportError` (not timeouts): the errors
pd.py and relay.py map to failovers and the client's SSE error event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from agentkv.procs import free_port
from agentkv.protocol import HEADER_SIM_ENGINE_ID
from agentkv.router.http import AiohttpClient, EngineClient, Pool, Timeout, TransportError
from agentkv.sim.launch import SimProcess, start_sim

pytestmark = pytest.mark.e2e

PROMPT = [(7919 * i) % 30_000 + 100 for i in range(40)]


def completion(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    # a small time scale: tokens are spaced out, so a stream arrives in several reads
    with start_sim("--time-scale", "0.2", "--block-size", "16") as s:
        yield s


def faults(sim: SimProcess, **knobs: Any) -> None:
    httpx.post(f"{sim.url}/_sim/faults", json=knobs, timeout=10).raise_for_status()


def run(url: str, use: Callable[[EngineClient], Awaitable[Any]], *, timeout_s: float = 10.0) -> Any:
    """``use`` with a fresh client of the engine at ``url`` (its pool's read timeout
    ``timeout_s``), closed afterwards."""

    async def go() -> Any:
        client: EngineClient = AiohttpClient(url, Pool(timeout_s=timeout_s, connect_timeout_s=2))
        try:
            return await use(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_stream_arrives_in_parts_and_a_whole_reply_in_one(sim: SimProcess) -> None:
    async def use(client: EngineClient) -> tuple[int, str | None, list[bytes], Any]:
        stream = await client.stream("/v1/completions", completion(12, stream=True))
        try:
            parts = [part async for part in stream]
        finally:
            await stream.aclose()
        whole = await client.post("/v1/completions", completion(4, stream=False))
        return stream.status, stream.headers.get(HEADER_SIM_ENGINE_ID), parts, whole

    status, engine_id, parts, whole = run(sim.url, use)
    assert status == 200 and engine_id
    body = b"".join(parts)
    assert len(parts) > 1, "one read: the stream was buffered"
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    tokens = "".join(orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert tokens
    assert whole.status == 200 and whole.headers.get(HEADER_SIM_ENGINE_ID) == engine_id
    assert whole.json()["usage"]["completion_tokens"] == 4


def test_an_engine_error_status_is_a_reply(sim: SimProcess) -> None:
    faults(sim, fail_next=2, fail_status=503, fail_message="Injected overload")

    async def use(client: EngineClient) -> tuple[int, bytes, int, Any]:
        stream = await client.stream("/v1/completions", completion(4, stream=True))
        try:
            body = await stream.read()
        finally:
            await stream.aclose()
        reply = await client.post("/v1/completions", completion(4, stream=False))
        return stream.status, body, reply.status, reply.json()

    try:
        status, body, reply_status, error = run(sim.url, use)
    finally:
        faults(sim, fail_next=0)
    assert status == 503 and b"Injected overload" in body
    assert reply_status == 503 and "Injected overload" in error["error"]["message"]


def test_an_engine_that_sends_nothing_times_out(sim: SimProcess) -> None:
    faults(sim, delay_s=3.0)

    async def use(client: EngineClient) -> list[tuple[str, float]]:
        seen: list[tuple[str, float]] = []

        async def attempt(what: str, call: Awaitable[Any]) -> None:
            t0 = time.monotonic()
            try:
                await call
                seen.append((f"{what}: answered", time.monotonic() - t0))
            except (TransportError, asyncio.TimeoutError) as exc:
                seen.append((f"{what}: {type(exc).__name__}", time.monotonic() - t0))

        body = completion(4, stream=True)
        # P's request: its own deadline; D's: the router's first-byte deadline around it, and
        # the pool's read timeout under that
        await attempt("post", client.post("/v1/completions", body, timeout=0.5))
        await attempt("first byte", asyncio.wait_for(client.stream("/v1/completions", body), 0.5))
        return seen

    def use_short_pool(client: EngineClient) -> Awaitable[Any]:
        return client.stream("/v1/completions", completion(4, stream=True))

    try:
        seen = run(sim.url, use)
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            run(sim.url, use_short_pool, timeout_s=0.5)
        pool_s = time.monotonic() - t0
    finally:
        faults(sim, delay_s=0.0)
    assert [what for what, _ in seen] == ["post: Timeout", "first byte: TimeoutError"]
    assert all(s < 2.0 for _, s in seen) and pool_s < 2.0, (seen, pool_s)
    # the client still answers once the engine does
    assert run(sim.url, lambda c: c.get("/health")).status == 200


def test_a_stream_cut_mid_answer_is_a_transport_error(sim: SimProcess) -> None:
    faults(sim, cut_stream_after=2)

    async def use(client: EngineClient) -> tuple[int, list[bytes], BaseException | None]:
        stream = await client.stream("/v1/completions", completion(12, stream=True))
        parts: list[bytes] = []
        try:
            async for part in stream:
                parts.append(part)
        except Exception as exc:
            return stream.status, parts, exc
        finally:
            await stream.aclose()
        return stream.status, parts, None

    try:
        status, parts, error = run(sim.url, use)
    finally:
        faults(sim, cut_stream_after=None)
    assert status == 200 and parts
    assert isinstance(error, TransportError) and not isinstance(error, Timeout), error


def test_a_port_nobody_listens_on_is_a_transport_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def use(client: EngineClient) -> list[BaseException]:
        errors: list[BaseException] = []
        for call in (
            lambda: client.post("/v1/completions", completion(4, stream=False), timeout=5),
            lambda: client.get("/health"),
            lambda: client.stream("/v1/completions", completion(4, stream=True)),
        ):
            try:
                await call()
            except Exception as exc:
                errors.append(exc)
        return errors

    errors = run(url, use)
    assert len(errors) == 3
    for exc in errors:
        assert type(exc) is TransportError, repr(exc)
        assert url in str(exc)
