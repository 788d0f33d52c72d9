"""Retention leases in the SDK (issue 17): the sans-IO core on an injected clock, the drivers
against a small recording HTTP server (a real socket server, for client-side behaviour only),
and the contract against a real router in front of simulator processes."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import agentkv
from agentkv._lease import (
    LEASES_PATH,
    LeaseCore,
    LeaseRenewer,
    LeaseSchedule,
    LiveSet,
    RenewalRequest,
    check_lease_s,
    lease_path,
    openai_http_settings,
)
from agentkv.protocol import HEADER_CONVERSATION_ID, HEADER_LEASE
from tests._support.threaded_server import serve_in_thread


class Conv:
    """Stands in for a conversation object in the sans-IO tests (only its identity matters)."""


def ok_body(request: RenewalRequest, lease_s: float | None = None) -> dict[str, Any]:
    granted = request.body["lease_s"] if lease_s is None else lease_s
    return {
        "object": "list",
        "data": [
            {"id": i, "object": "conversation.lease", "lease_s": granted} for i in request.ids
        ],
    }


# -- the sans-IO core ------------------------------------------------------------------------------
def test_one_batched_request_per_tick_for_all_open_conversations() -> None:
    core = LeaseCore(30)
    convs = [Conv() for _ in range(5)]
    for i, c in enumerate(convs):
        core.track(c, f"c{i}", now=100.0)
    assert core.wait_s(100.0) == pytest.approx(10.0)
    assert core.poll(109.9) is None
    request = core.poll(110.0)
    assert request is not None
    assert request.path == LEASES_PATH == "/v1/conversations/leases"
    assert request.body == {"lease_s": 30, "ids": ["c0", "c1", "c2", "c3", "c4"]}
    assert core.poll(110.0) is None  # one request per tick, however many conversations
    assert core.wait_s(110.0) == pytest.approx(10.0)
    core.answered(request, 200, ok_body(request))
    assert core.stats.requests == 1 and core.stats.renewed == 5 and core.stats.failures == 0


def test_nothing_is_sent_before_a_turn_or_when_no_conversation_is_open() -> None:
    core = LeaseCore(3)
    assert core.wait_s(0.0) is None and core.poll(1e9) is None
    conv = Conv()
    core.track(conv, "a", now=0.0)
    core.forget(conv)
    assert core.poll(1.0) is None  # due, but nothing open
    assert core.wait_s(1.0) == pytest.approx(1.0)


def test_a_garbage_collected_conversation_is_renewed_no_more() -> None:
    core = LeaseCore(3)
    keep, drop = Conv(), Conv()
    core.track(keep, "keep", now=0.0)
    core.track(drop, "drop", now=0.0)
    assert core.live.ids() == ["keep", "drop"]
    del drop
    gc.collect()
    request = core.poll(1.0)
    assert request is not None and request.ids == ["keep"]


def test_close_drops_one_object_and_a_shared_id_lives_while_any_copy_does() -> None:
    live = LiveSet()
    a, b, other = Conv(), Conv(), Conv()
    live.track(a, "x")
    live.track(b, "x")  # a resumed copy of the same conversation
    live.track(other, "y")
    assert live.ids() == ["x", "y"]
    live.forget(a)
    assert live.ids() == ["x", "y"]
    live.forget(b)
    assert live.ids() == ["y"]
    live.forget(Conv())  # never tracked: nothing happens
    live.track(a, "x")  # a new turn after close keeps it alive again
    assert live.ids() == ["y", "x"] and len(live) == 2


def test_schedule_ticks_every_third_of_the_lease_without_catch_up_bursts() -> None:
    s = LeaseSchedule(30, now=0.0)
    assert s.interval_s == 10 and not s.due(9.99) and s.due(10.0)
    s.advance(10.5)  # a little late: the next tick is a whole interval later
    assert s.next_at == 20.5
    s.advance(75.0)  # the process was suspended for a minute: one tick, then the normal pace
    assert s.next_at == 85.0 and s.wait_s(80.0) == 5.0
    s.grant(6.0)  # the server capped the lease: renew in time for what it granted
    assert s.interval_s == 2.0
    s.grant(None)
    assert s.interval_s == 10.0
    s.grant(float("nan"))
    s.grant(0.0)
    assert s.interval_s == 10.0


def test_a_capped_grant_shortens_the_interval() -> None:
    core = LeaseCore(30)
    core.track(Conv(), "a", now=0.0)
    conv = Conv()
    core.track(conv, "b", now=0.0)
    request = core.poll(10.0)
    assert request is not None
    core.answered(request, 200, ok_body(request, lease_s=9))
    assert core.wait_s(10.0) == pytest.approx(3.0)


def test_failures_are_counted_and_retried_on_the_next_tick() -> None:
    core = LeaseCore(3)
    conv = Conv()
    core.track(conv, "a", now=0.0)
    first = core.poll(1.0)
    assert first is not None
    core.failed(first, httpx.ConnectError("refused"))
    core.answered(first, 503, None)
    core.answered(first, 401, {"error": {"message": "bad key"}})
    assert core.stats.failures == 3 and core.stats.last_error == "HTTP 401"
    assert not core.stopped
    again = core.poll(2.0)
    assert again is not None and again.ids == ["a"]
    core.answered(again, 200, {"not": "a list"})  # a 200 without data still renewed the batch
    assert core.stats.requests == 1 and core.stats.renewed == 1


@pytest.mark.parametrize("status", [404, 405])
def test_a_server_without_lease_routes_stops_the_renewals(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    core = LeaseCore(3)
    conv = Conv()
    core.track(conv, "a", now=0.0)
    request = core.poll(1.0)
    assert request is not None
    with caplog.at_level(logging.DEBUG, logger="agentkv.lease"):
        core.answered(request, status, None)
        core.answered(request, status, None)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "no lease routes" in infos[0].getMessage()
    assert core.stopped and core.stats.stopped
    assert core.wait_s(2.0) is None and core.poll(100.0) is None


def test_header_values_and_bad_leases() -> None:
    headers: dict[str, str] = {}
    LeaseCore(30).add_header(headers)
    assert headers == {HEADER_LEASE: "30"}
    LeaseCore(2.5).add_header(headers)
    assert headers == {HEADER_LEASE: "30"}  # a per-turn value the caller set wins
    headers.clear()
    LeaseCore(2.5).add_header(headers)
    assert headers == {"X-AgentKV-Lease": "2.5"}
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="lease_s"):
            check_lease_s(bad)
    with pytest.raises(ValueError, match="lease_s"):
        agentkv.Client(base_url="http://127.0.0.1:9/v1", api_key="k", lease_s=0)
    assert lease_path("abc") == "/v1/conversations/abc/lease"
    assert lease_path("a/b?c#d%e") == "/v1/conversations/a%2Fb%3Fc%23d%25e/lease"


def test_http_settings_come_from_the_openai_client() -> None:
    client = openai.OpenAI(
        base_url="http://10.0.0.1:8000/v1/",
        api_key="tenant-key",
        default_headers={"X-Team": "blue"},
        timeout=12,
    )
    root, headers, timeout = openai_http_settings(client, 30)
    assert root == "http://10.0.0.1:8000"
    assert headers["Authorization"] == "Bearer tenant-key" and headers["X-Team"] == "blue"
    assert all(isinstance(v, str) for v in headers.values())
    assert timeout.read == 10.0 and timeout.connect == 10.0  # capped at one interval
    _, _, long = openai_http_settings(client, 300)
    assert long.read == 12.0
    _, _, short = openai_http_settings(openai.OpenAI(base_url="http://h/v1", api_key="k"), 0.3)
    assert short.connect == 2.0 and short.read == 2.0
    client.close()


def test_close_stops_the_thread_at_once_whatever_the_interval() -> None:
    renewer = LeaseRenewer(3600, root="http://127.0.0.1:9")
    conv = Conv()
    headers: dict[str, str] = {}
    renewer.turn(conv, "a", headers)
    thread = renewer._thread
    assert thread is not None and thread.is_alive() and thread.daemon
    started = time.monotonic()
    renewer.close()
    assert time.monotonic() - started < 0.5 and not thread.is_alive()
    renewer.turn(conv, "a", headers)  # a turn after close sends the header, starts nothing
    assert renewer._thread is thread and headers == {HEADER_LEASE: "3600"}


# -- a small recording server (client-side behaviour only) -----------------------------------------
@dataclass
class Recorded:
    turns: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    renewals: list[tuple[float, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    lease_routes: bool = True
    fail_next: int = 0

    def reset(self) -> None:
        self.turns.clear()
        self.renewals.clear()
        self.deletes.clear()
        self.lease_routes, self.fail_next = True, 0

    def renewed_ids(self) -> list[list[str]]:
        return [list(body["ids"]) for _, body, _ in self.renewals]


def recording_app(rec: Recorded) -> Starlette:
    async def chat(request: Request) -> Response:
        body = await request.json()
        rec.turns.append((time.monotonic(), dict(request.headers)))
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(rec.turns)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )

    async def leases(request: Request) -> Response:
        body = await request.json()
        rec.renewals.append((time.monotonic(), body, dict(request.headers)))
        if not rec.lease_routes:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if rec.fail_next > 0:
            rec.fail_next -= 1
            return JSONResponse({"error": {"message": "try later"}}, status_code=503)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": i, "object": "conversation.lease", "lease_s": body["lease_s"]}
                    for i in body["ids"]
                ],
            }
        )

    async def delete(request: Request) -> Response:
        cid = request.path_params["cid"]
        rec.deletes.append(cid)
        return JSONResponse({"id": cid, "object": "conversation.deleted", "released": True})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/conversations/leases", leases, methods=["POST"]),
            Route("/v1/conversations/{cid}", delete, methods=["DELETE"]),
        ]
    )


@dataclass
class Server:
    url: str
    rec: Recorded


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    rec = Recorded()
    with serve_in_thread(recording_app(rec), "recording server", lifespan="off") as url:
        yield Server(url, rec)


@pytest.fixture
def rec(server: Server) -> Iterator[Recorded]:
    server.rec.reset()
    yield server.rec
    server.rec.reset()


LEASE = 0.3  # renewals every 0.1 s


def sync_client(server: Server, lease_s: float | None = LEASE) -> agentkv.Client:
    return agentkv.Client(base_url=f"{server.url}/v1", api_key="tenant-key", lease_s=lease_s)


def turn(conv: agentkv.Conversation, text: str = "hi") -> None:
    conv.add_user(text)
    conv.create()


def wait_for(predicate: Any, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_turns_carry_the_lease_and_open_conversations_are_renewed_in_one_batch(
    server: Server, rec: Recorded
) -> None:
    with sync_client(server) as client:
        convs = [client.conversation(model="m", mode="messages") for _ in range(4)]
        for c in convs:
            turn(c)
        assert [h[HEADER_LEASE.lower()] for _, h in rec.turns] == ["0.3"] * 4
        assert [h[HEADER_CONVERSATION_ID.lower()] for _, h in rec.turns] == [c.id for c in convs]
        first = len(rec.renewals)  # ticks while the turns were being sent had fewer ids
        wait_for(lambda: len(rec.renewals) >= first + 3)
        ids = {c.id for c in convs}
        assert all(set(batch) == ids for batch in rec.renewed_ids()[first : first + 3])
        times = [t for t, _, _ in rec.renewals]
        # one request per tick for the whole client, not one per conversation
        assert all(b - a > 0.08 for a, b in itertools.pairwise(times))
        _, body, headers = rec.renewals[0]
        assert body["lease_s"] == 0.3
        assert headers["authorization"] == "Bearer tenant-key"

        assert convs[0].close() is True
        assert rec.deletes == [convs[0].id]
        gone = convs[1].id
        del convs[1]
        gc.collect()
        seen = len(rec.renewals)
        wait_for(lambda: len(rec.renewals) >= seen + 2)
        assert set(rec.renewed_ids()[-1]) == {convs[1].id, convs[2].id}
        assert gone not in rec.renewed_ids()[-1]
        thread = client._lease._thread if client._lease is not None else None
    assert thread is not None and not thread.is_alive()  # __exit__ stopped it
    after = len(rec.renewals)
    stats = client.lease_stats
    assert stats is not None and stats.requests == after and stats.failures == 0
    assert not stats.stopped
    time.sleep(0.25)
    assert len(rec.renewals) == after


def test_a_tool_wait_longer_than_the_lease_is_covered_by_renewals(
    server: Server, rec: Recorded
) -> None:
    lease = 0.6  # renewals every 0.2 s: room for a busy test machine
    with sync_client(server, lease_s=lease) as client:
        conv = client.conversation(model="m", mode="messages")
        turn(conv)
        time.sleep(3 * lease)  # the tool runs for three leases
        turn(conv, "tool done")
    started, ended = rec.turns[0][0], rec.turns[1][0]
    during = [t for t, body, _ in rec.renewals if started < t < ended and conv.id in body["ids"]]
    marks = [started, *during, ended]
    assert len(during) >= 5
    assert max(b - a for a, b in itertools.pairwise(marks)) < lease  # never lapsed


def test_without_a_lease_nothing_changes(server: Server, rec: Recorded) -> None:
    with sync_client(server, lease_s=None) as client:
        assert client.lease_stats is None
        conv = client.conversation(model="m", mode="messages")
        turn(conv)
        time.sleep(0.15)
    assert HEADER_LEASE.lower() not in rec.turns[0][1] and rec.renewals == []


def test_a_router_without_lease_routes_stops_the_renewer_and_turns_go_on(
    server: Server, rec: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    rec.lease_routes = False
    with caplog.at_level(logging.INFO, logger="agentkv.lease"), sync_client(server) as client:
        conv = client.conversation(model="m", mode="messages")
        turn(conv)
        wait_for(lambda: client.lease_stats is not None and client.lease_stats.stopped)
        thread = client._lease._thread if client._lease is not None else None
        assert thread is not None
        thread.join(1)
        assert not thread.is_alive()
        time.sleep(3 * LEASE / 3)
        turn(conv, "again")  # turns are unaffected (and still carry the header)
        assert rec.turns[-1][1][HEADER_LEASE.lower()] == "0.3"
    assert len(rec.renewals) == 1
    assert [r.levelno for r in caplog.records if "no lease routes" in r.getMessage()] == [
        logging.INFO
    ]


def test_failed_renewals_are_retried_on_the_next_tick(server: Server, rec: Recorded) -> None:
    rec.fail_next = 2
    with sync_client(server) as client:
        conv = client.conversation(model="m", mode="messages")
        turn(conv)
        wait_for(lambda: client.lease_stats is not None and client.lease_stats.requests >= 1)
        stats = client.lease_stats
        assert stats is not None and stats.failures == 2 and stats.last_error == "HTTP 503"
        assert not stats.stopped


def test_an_unreachable_server_never_raises_into_user_code() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with agentkv.Client(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", lease_s=0.06) as c:
        assert c._lease is not None
        conv = Conv()
        c._lease.turn(conv, "a", {})  # a tracked conversation, without a turn's I/O
        wait_for(lambda: c.lease_stats is not None and c.lease_stats.failures >= 2)
        assert c.lease_stats is not None and "ConnectError" in (c.lease_stats.last_error or "")


def test_async_client_renews_from_a_task_and_close_cancels_it(
    server: Server, rec: Recorded
) -> None:
    async def until(n: int) -> None:
        deadline = time.monotonic() + 3
        while len(rec.renewals) < n:
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def main() -> tuple[int, bool]:
        client = agentkv.AsyncClient(base_url=f"{server.url}/v1", api_key="k", lease_s=LEASE)
        try:
            assert client._lease is not None and client._lease._task is None
            convs = [client.conversation(model="m", mode="messages") for _ in range(3)]
            for c in convs:
                c.add_user("hi")
                await c.create()
            task = client._lease._task
            assert task is not None
            first = len(rec.renewals)
            await until(first + 2)
            assert all(set(b) == {c.id for c in convs} for b in rec.renewed_ids()[first:])
            await convs[0].close()
            seen = len(rec.renewals)
            await until(seen + 2)
            assert set(rec.renewed_ids()[-1]) == {convs[1].id, convs[2].id}
        finally:
            await client.close()
        return len(rec.renewals), task.cancelled()

    after, cancelled = asyncio.run(main())
    assert cancelled
    assert [h[HEADER_LEASE.lower()] for _, h in rec.turns] == ["0.3"] * 3
    time.sleep(0.2)
    assert len(rec.renewals) == after


def test_async_client_outside_a_loop_starts_no_task() -> None:
    client = agentkv.AsyncClient(base_url="http://127.0.0.1:9/v1", api_key="k", lease_s=30)
    assert client._lease is not None
    headers: dict[str, str] = {}
    client._lease.turn(Conv(), "a", headers)
    assert client._lease._task is None and headers == {HEADER_LEASE: "30"}
    asyncio.run(client.close())


# -- against a real router (simulator P and D processes) -------------------------------------------
E2E_LEASE = 1.0

CHILD = """
import sys, time
import agentkv

client = agentkv.Client(base_url=sys.argv[1], api_key="k", lease_s=float(sys.argv[2]))
conv = client.conversation(model="agentkv-sim", system="You are a patient agent. " * 20)
conv.add_user("Run the test suite.")
conv.create(max_tokens=40)
print(conv.id, flush=True)
while client.lease_stats.requests < 2:  # the tool runs; the renewer keeps the lease
    time.sleep(0.05)
print("renewing", flush=True)
time.sleep(600)  # killed here, mid-wait
"""


@pytest.fixture(scope="module")
def router_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests._support.stack import stack

    # the kept reuse is checked as P's read of D's KV (a pull), not D's own prefix cache
    pull = {"paths": {"mode": "pull"}}
    tmp = tmp_path_factory.mktemp("lease")
    with stack(tmp, p_args=(("--no-prefix-caching",),), router=pull) as s:
        yield s


def held(s: Any) -> int:
    return int(s.retained(s.decode[0]))


@pytest.mark.e2e
@pytest.mark.slow
def test_router_lease_routes_keep_a_live_agent_and_free_a_gone_one(router_stack: Any) -> None:
    s, lease = router_stack, E2E_LEASE
    live = agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k", lease_s=lease)
    gone = agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k", lease_s=lease)
    try:
        conv = live.conversation(model="agentkv-sim", system="You are terse. " * 20)
        conv.add_user("Read the file.")
        conv.create(max_tokens=40)

        # the routes, as the contract has them (the tenant's key, like every route)
        with httpx.Client(
            base_url=s.router.url, headers={"Authorization": "Bearer k"}, timeout=30
        ) as h:
            one = h.post(f"/v1/conversations/{conv.id}/lease", json={"lease_s": 30})
            assert one.status_code == 200, one.text
            assert one.json() == {"id": conv.id, "object": "conversation.lease", "lease_s": 30}
            many = h.post("/v1/conversations/leases", json={"lease_s": 30, "ids": [conv.id]})
            assert many.status_code == 200, many.text
            assert many.json() == {
                "object": "list",
                "data": [{"id": conv.id, "object": "conversation.lease", "lease_s": 30}],
            }

        # a live agent: a tool wait longer than the lease keeps its reuse
        time.sleep(2.5 * lease)
        stats = live.lease_stats
        assert stats is not None and stats.requests >= 2 and not stats.stopped
        assert stats.failures == 0
        conv.add_user("The tool answered.")
        conv.create(max_tokens=40)
        receipt = conv.last_receipt
        assert receipt is not None and receipt.decision == "pull"
        assert (receipt.reused_tokens or 0) > 0

        # a gone agent (its renewals stop, no close): D's blocks are freed soon after
        before = held(s)
        other = gone.conversation(model="agentkv-sim", system="You are brief. " * 20)
        other.add_user("Hello.")
        other.create(max_tokens=40)
        wait_for(lambda: held(s) > before, timeout_s=10)
        gone.close()
        wait_for(lambda: held(s) <= before, timeout_s=lease + 5)

        # close() releases at once
        assert conv.close() is True
        wait_for(lambda: held(s) < before, timeout_s=5)
    finally:
        live.close()
        gone.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_client_process_frees_its_kv_within_the_lease(
    router_stack: Any, tmp_path: Path
) -> None:
    import subprocess

    s, lease = router_stack, E2E_LEASE
    before = held(s)
    script = tmp_path / "agent.py"
    script.write_text(CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), f"{s.router.url}/v1", str(lease)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        cid = child.stdout.readline().strip()
        assert cid, "the agent process made no turn"
        assert child.stdout.readline().strip() == "renewing"
        assert held(s) == before + 1
        time.sleep(2 * lease)  # alive and waiting on a tool: kept past its lease
        assert child.poll() is None and held(s) == before + 1
        child.kill()
        child.wait(10)
        killed = time.monotonic()
        wait_for(lambda: held(s) == before, timeout_s=lease + 5)
        assert time.monotonic() - killed < lease + 5
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
