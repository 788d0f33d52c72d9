"""Fault knobs (``POST /_sim/faults``): injected failures, delays, cut streams, health, exits.

Every request goes through the real ASGI app; ``os._exit`` is replaced for the exit tests so
that the knob can be tested in-process.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from agentkv.chat import load_template, load_tokenizer
from agentkv.protocol.promtext import parse_metrics
from agentkv.sim import SimConfig, SimState, create_app
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.transfer import TransferClient
from tests._support.cluster import openai_error

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Say something."}]
CHAT = "/v1/chat/completions"
TOKENIZER = load_tokenizer()
TEMPLATE = load_template(None, TOKENIZER)
TRANSFER = TransferClient()


@pytest.fixture
def app() -> Starlette:
    return create_app(
        SimConfig(time_scale=0.0, num_blocks=1024),
        tokenizer=TOKENIZER,
        template=TEMPLATE,
        cost=PRESETS["zero"],
        transfer=TRANSFER,
    )


@pytest.fixture
def state(app: Starlette) -> SimState:
    sim: SimState = app.state.sim
    return sim


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
        yield c


async def set_faults(client: httpx.AsyncClient, **knobs: Any) -> dict[str, Any]:
    r = await client.post("/_sim/faults", json=knobs)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_metrics((await client.get("/metrics")).text)


# -- injected failures -------------------------------------------------------------------------
@pytest.mark.parametrize("status", [500, 503, 429], ids=["500", "503", "429"])
async def test_fail_next_fails_that_many_then_recovers(client, status):
    knobs = await set_faults(client, fail_next=2, fail_status=status, fail_message="try later")
    assert knobs["fail_next"] == 2 and knobs["fail_status"] == status
    kind = {500: "InternalServerError", 503: "ServiceUnavailableError"}.get(
        status, "RateLimitError"
    )
    before = await metrics(client)
    for path, body in ((CHAT, {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"})):
        r = await client.post(path, json=body)
        assert r.status_code == status
        assert r.json()["error"] == openai_error("try later", kind, status)
    assert await metrics(client) == before  # the engine never saw them
    assert (await client.get("/_sim/faults")).json()["fail_next"] == 0
    ok = await client.post(CHAT, json={"messages": MESSAGES})
    assert ok.status_code == 200


async def test_fail_next_fails_a_stream_before_any_byte(client):
    await set_faults(client, fail_next=1, fail_status=503)
    r = await client.post(CHAT, json={"messages": MESSAGES, "stream": True})
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == 503


async def test_tokenize_is_not_failed(client):
    await set_faults(client, fail_next=1)
    r = await client.post("/tokenize", json={"prompt": "hi"})
    assert r.status_code == 200
    assert (await client.get("/_sim/faults")).json()["fail_next"] == 1


# -- delay -------------------------------------------------------------------------------------
async def test_delay_s_holds_every_generation_request(client):
    await set_faults(client, delay_s=0.15)
    for _ in range(2):
        start = time.perf_counter()
        r = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200
        assert time.perf_counter() - start >= 0.15
    await set_faults(client, delay_s=0)
    start = time.perf_counter()
    await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})
    assert time.perf_counter() - start < 0.15


# -- cut streams --------------------------------------------------------------------------------
async def read_cut_stream(app: Starlette, **body: Any) -> httpx.Response:
    """What a client receives from a stream the server drops: status 200 and the bytes sent
    before the drop (the transport hands them over instead of raising)."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
        return await c.post(CHAT, json={"messages": MESSAGES, "stream": True, **body})


@pytest.mark.parametrize("cut", [0, 1, 3], ids=["cut-0", "cut-1", "cut-3"])
async def test_cut_stream_after_drops_the_stream_without_done(app, client, state, cut):
    await set_faults(client, cut_stream_after=cut)
    r = await read_cut_stream(app, return_token_ids=True, max_tokens=20)
    assert r.status_code == 200 and "[DONE]" not in r.text
    frames = [f for f in r.text.split("\n\n") if f]
    assert len(frames) == 1 + cut  # the role chunk, then one chunk per token sent
    assert all('"finish_reason":null' in f for f in frames)
    assert state.engine.pool.num_used == 0  # the aborted request gave its blocks back


async def test_cut_stream_is_a_dropped_connection(client):
    await set_faults(client, cut_stream_after=2)
    with pytest.raises(ConnectionAbortedError):
        await client.post(CHAT, json={"messages": MESSAGES, "stream": True})


async def test_cut_stream_counts_an_abort_and_the_next_stream_is_whole(app, client):
    await set_faults(client, cut_stream_after=2)
    await read_cut_stream(app, max_tokens=20)
    success = parse_metrics((await client.get("/metrics")).text, by="finished_reason")
    assert success["vllm:request_success_total[abort]"] == 1
    assert success["vllm:request_success_total[length]"] == 0
    await set_faults(client, cut_stream_after=None)
    r = await client.post(CHAT, json={"messages": MESSAGES, "stream": True})
    assert r.text.endswith("data: [DONE]\n\n")


async def test_cut_stream_does_not_touch_plain_responses(client):
    await set_faults(client, cut_stream_after=1)
    r = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


# -- health ------------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [503, 500, 200], ids=["503", "500", "200"])
async def test_health_status(client, status):
    await set_faults(client, health_status=status)
    assert (await client.get("/health")).status_code == status
    await set_faults(client, health_status=200)
    assert (await client.get("/health")).status_code == 200


# -- invalid knobs -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        {"fail_next": -1},
        {"fail_next": "x"},
        {"fail_status": 200},
        {"fail_status": 600},
        {"delay_s": -0.5},
        {"cut_stream_after": -1},
        {"health_status": 100},
        {"exit_after_s": -1},
        {"fail_nxt": 1},
        [{"fail_next": 1}],
    ],
    ids=[
        "negative-count", "count-string", "status-ok", "status-600", "negative-delay",
        "negative-cut", "health-100", "negative-exit", "unknown-knob", "array-body",
    ],
)  # fmt: skip
async def test_invalid_knobs_are_400_and_change_nothing(client, body):
    before = (await client.get("/_sim/faults")).json()
    r = await client.post("/_sim/faults", json=body)
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert (await client.get("/_sim/faults")).json() == before


async def test_a_bad_knob_among_good_ones_sets_none_of_them(client):
    r = await client.post("/_sim/faults", json={"fail_next": 3, "delay_s": -1})
    assert r.status_code == 400
    assert (await client.get("/_sim/faults")).json()["fail_next"] == 0


# -- exit --------------------------------------------------------------------------------------
@pytest.fixture
def exits(monkeypatch) -> list[int]:
    """Calls to ``os._exit`` (replaced: the test process stays alive)."""
    calls: list[int] = []
    monkeypatch.setattr(os, "_exit", calls.append)
    return calls


async def test_exit_after_s_exits_with_status_1(client, exits):
    await set_faults(client, exit_after_s=0.0)
    await asyncio.sleep(0.05)
    assert exits == [1]


async def test_exit_after_s_null_cancels_a_pending_exit(client, exits):
    await set_faults(client, exit_after_s=0.05)
    await set_faults(client, exit_after_s=None)
    await asyncio.sleep(0.15)
    assert exits == []


async def test_other_knobs_do_not_schedule_another_exit(client, exits):
    await set_faults(client, exit_after_s=0.05)
    await set_faults(client, fail_next=1)
    await set_faults(client, delay_s=0.0)
    await asyncio.sleep(0.15)
    assert exits == [1]
