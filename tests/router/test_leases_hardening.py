"""Leases are a bounded, fairly released resource (issue 21, item 3).

Units against :class:`MemoryLeases` and :class:`RedisLeases` (a real redis-server), then the
router's lease routes end to end on real processes (router + simulators on loopback): a lease
for a conversation with no stored KV is 404 and adds nothing, the per-tenant bound is a 429 in
OpenAI's error shape, and 100,000 lease calls on unknown ids leave the lease count unchanged."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv._lease import LeaseCore
from agentkv.protocol.promtext import parse_metrics
from agentkv.router.config import RouterConfig
from agentkv.router.guard import GuardedStore
from agentkv.router.leases import Leases, MemoryLeases, RedisLeases
from agentkv.router.memory_store import MemoryStore
from agentkv.router.metrics import RouterMetrics
from agentkv.router.retention import Retention
from agentkv.router.store import StoredHandle, StoreKey
from tests._support.clock import FakeClock
from tests._support.stack import MODEL, Stack, rss_mib, stack

FLOOD = 200_000
BATCH = 10_000


@dataclass
class Harness:
    kind: str
    leases: MemoryLeases | RedisLeases
    advance: Callable[[float], Awaitable[None]]
    """Let this much time pass for the leases (a fake clock in memory, a real sleep in Redis)."""


@pytest.fixture(params=["memory", "redis"])
async def h(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Harness]:
    if request.param == "memory":
        clock = FakeClock()

        async def advance(s: float) -> None:
            clock.now += s

        yield Harness("memory", MemoryLeases(clock=clock), advance)
        return
    import redis.asyncio as aioredis

    url: str = request.getfixturevalue("redis_url")
    client = aioredis.Redis.from_url(url)

    async def sleep(s: float) -> None:
        await asyncio.sleep(s)

    try:
        yield Harness("redis", RedisLeases(client, prefix=f"test-{uuid.uuid4().hex}:"), sleep)
    finally:
        await client.aclose()


async def flood(leases: Leases, tenant: str, n: int, seconds: float) -> None:
    """``n`` leases of ``tenant`` for ``seconds``, as lease calls would add them (10,000 a call)."""
    for i in range(0, n, BATCH):
        ids = [f"{tenant}-{j}" for j in range(i, min(n, i + BATCH))]
        assert all(await leases.renew(tenant, ids, seconds, limit=n))


# -- fairness ---------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_one_lapsed_lease_beside_200k_of_another_tenant_is_in_the_first_check(
    h: Harness,
) -> None:
    await flood(h.leases, "noisy", FLOOD, 0.05)
    await h.advance(0.01)
    assert await h.leases.renew("quiet", ["agent"], 0.1, limit=10) == [True]
    await h.advance(0.3)  # every lease lapsed; the noisy tenant's lapsed first
    first = await h.leases.lapsed(1000)
    assert ("quiet", "agent") in first
    assert len(first) == 1000 and len(set(first)) == 1000
    assert await h.leases.size() == FLOOD + 1 - 1000


@pytest.mark.anyio
async def test_lapsed_leases_are_shared_round_robin_across_tenants(h: Harness) -> None:
    for tenant in ("a", "b", "c"):
        await flood(h.leases, tenant, 10, 0.05)
    await flood(h.leases, "d", 2, 0.05)
    await h.advance(0.2)
    first = await h.leases.lapsed(11)
    by_tenant = {t: sum(1 for k in first if k[0] == t) for t in "abcd"}
    assert by_tenant["d"] == 2 and sorted(by_tenant.values()) == [2, 3, 3, 3]
    rest = await h.leases.lapsed(1000)
    assert len(first) + len(rest) == 32 and not set(first) & set(rest)
    assert await h.leases.lapsed(1000) == [] and await h.leases.size() == 0


@pytest.mark.anyio
async def test_a_lease_renewed_in_time_does_not_lapse(h: Harness) -> None:
    await h.leases.renew("t", ["kept", "gone"], 0.2, limit=10)
    await h.advance(0.1)
    await h.leases.renew("t", ["kept"], 0.5, limit=10)
    await h.advance(0.2)
    assert await h.leases.lapsed() == [("t", "gone")]
    await h.leases.drop(("t", "kept"))
    await h.advance(0.5)
    assert await h.leases.lapsed() == [] and await h.leases.size() == 0


# -- bounds -----------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_tenant_holds_at_most_its_bound_and_renewals_always_succeed(h: Harness) -> None:
    assert await h.leases.renew("a", ["1", "2", "3"], 30, limit=3) == [True] * 3
    # a renewal of a held lease succeeds; a new one past the bound does not
    assert await h.leases.renew("a", ["2", "4", "1"], 30, limit=3) == [True, False, True]
    assert await h.leases.renew("b", ["1"], 30, limit=3) == [True]  # another tenant: its own
    assert (await h.leases.held("a"), await h.leases.held("b")) == (3, 1)
    await h.leases.drop(("a", "1"))
    assert await h.leases.renew("a", ["4", "5"], 30, limit=3) == [True, False]
    assert await h.leases.size() == 4


@pytest.mark.anyio
async def test_lapsed_leases_count_until_released_then_make_room(h: Harness) -> None:
    await h.leases.renew("a", ["1", "2"], 0.05, limit=2)
    await h.advance(0.2)
    assert await h.leases.renew("a", ["3"], 30, limit=2) == [False]
    assert sorted(await h.leases.lapsed()) == [("a", "1"), ("a", "2")]
    assert await h.leases.renew("a", ["3"], 30, limit=2) == [True]


@pytest.mark.anyio
async def test_redis_leaves_no_empty_lease_sets_and_every_key_expires(redis_url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    leases = RedisLeases(client, prefix=f"test-{uuid.uuid4().hex}:")
    try:
        await leases.renew("a:b%c", ["x"], 5, limit=2)
        key = leases.tenant_key("a:b%c")
        assert key.endswith("leases:t:a%3Ab%25c")
        assert 5000 < await client.pttl(key) <= 65_000
        await leases.renew("a:b%c", ["x"], 0.05, limit=2)
        await asyncio.sleep(0.2)
        assert await leases.lapsed() == [("a:b%c", "x")]
        prefix = key.split("leases:")[0]
        assert await client.smembers(f"{prefix}leases:tenants") == set()
        assert await client.exists(key) == 0
    finally:
        await client.aclose()


# -- the reaper -------------------------------------------------------------------------------
class Released:
    def __init__(self) -> None:
        self.handles: list[tuple[StoredHandle, str]] = []

    async def __call__(self, handle: StoredHandle, reason: str) -> None:
        self.handles.append((handle, reason))


def stored(n: int) -> StoredHandle:
    return StoredHandle(
        params={"do_remote_prefill": True, "remote_block_ids": [[n]], "remote_num_tokens": 16},
        block_hashes=bytes([n % 256]) * 16,
        tail_tokens=[n],
        num_tokens=16,
        block_size=16,
        epoch=0,
        decode_url="http://127.0.0.1:1",
    )


def retention(leases: Leases, **config: Any) -> tuple[Retention, MemoryStore, Released]:
    cfg = RouterConfig.model_validate(
        {
            "upstream": {
                "prefill": [{"url": "http://127.0.0.1:1"}],
                "decode": [{"url": "http://127.0.0.1:2"}],
            },
            "retention": config,
        }
    )
    store = MemoryStore(max_entries=1000)
    released = Released()
    r = Retention(cfg, GuardedStore(store), leases, [], released, RouterMetrics())
    return r, store, released


@pytest.mark.anyio
async def test_the_first_check_releases_the_quiet_tenants_lapsed_kv(h: Harness) -> None:
    r, store, released = retention(h.leases, max_leases_per_tenant=FLOOD)
    quiet: StoreKey = ("quiet", "agent")
    await store.put(quiet, stored(1), 600)
    await flood(h.leases, "noisy", FLOOD, 0.05)  # nothing stored under these: nothing to free
    await h.advance(0.01)
    assert await r.renew(quiet, 0.1) == 0.1  # the turn's X-AgentKV-Lease
    await h.advance(0.3)
    assert await r.reap_leases(budget_s=0) == 1  # one batch only
    assert [(hd.tail_tokens, why) for hd, why in released.handles] == [([1], "lease")]
    assert await store.candidates(quiet) == []


@pytest.mark.anyio
async def test_one_check_drains_the_whole_backlog_within_its_budget(h: Harness) -> None:
    r, _, _ = retention(h.leases, max_leases_per_tenant=FLOOD)
    await flood(h.leases, "noisy", FLOOD, 0.05)
    await h.advance(0.2)
    started = time.monotonic()
    await r.reap_leases(budget_s=60)
    print(
        f"\n{h.kind}: {FLOOD} lapsed leases reaped in one check, {time.monotonic() - started:.2f} s"
    )
    assert await h.leases.size() == 0 and await h.leases.lapsed() == []
    metric = r.metrics.registry.get_sample_value("agentkv_router_leases")
    assert metric == 0


@pytest.mark.anyio
async def test_lease_calls_renew_only_what_has_stored_kv(h: Harness) -> None:
    r, store, _ = retention(h.leases, max_leases_per_tenant=2)
    await store.put(("t", "real"), stored(1), 600)
    await store.put(("t", "real-2"), stored(2), 600)
    await store.put(("t", "real-3"), stored(3), 600)
    granted, out = await r.renew_held("t", [f"ghost-{i}" for i in range(1000)], 30)
    assert granted == 30 and all(o is not None and o.status == 404 for o in out)
    assert await h.leases.size() == 0  # nothing added
    granted, out = await r.renew_held("t", ["real", "ghost", "real-2", "real-3", "real"], 30)
    assert [o and o.status for o in out] == [None, 404, None, 429, None]
    assert out[3] is not None and "max_leases_per_tenant" in out[3].message
    assert await h.leases.held("t") == 2
    # a turn's header past the bound: the turn is served, no lease is started
    assert await r.renew(("t", "real-3"), 30) == 0.0 and await h.leases.held("t") == 2


@pytest.mark.anyio
async def test_a_lease_whose_kv_is_gone_is_not_extended_and_lapses(h: Harness) -> None:
    r, _, _ = retention(h.leases)
    key: StoreKey = ("t", "c")
    await r.renew(key, 0.3)  # a turn's header: the lease starts before the handle exists
    await h.advance(0.1)
    _, [out] = await r.renew_held("t", ["c"], 30)  # no handle (taken by a turn, or evicted)
    assert out is not None and out.status == 404
    await h.advance(0.4)
    assert await h.leases.lapsed() == [key]  # not extended to 30 s


# -- the SDK reads the refusals -------------------------------------------------------------------
def test_the_sdk_counts_only_renewed_items_and_takes_the_grant_from_them() -> None:
    core = LeaseCore(30)

    class Conv:
        pass

    convs = [Conv() for _ in range(3)]
    for i, c in enumerate(convs):
        core.track(c, f"c{i}", now=0.0)
    request = core.poll(10.0)
    assert request is not None
    body = {
        "object": "list",
        "data": [
            {"id": "c0", "object": "conversation.lease", "lease_s": 9},
            {"id": "c1", "object": "conversation.lease", "error": {"code": 404, "message": "x"}},
            {"id": "c2", "object": "conversation.lease", "error": {"code": 429, "message": "y"}},
        ],
    }
    core.answered(request, 200, body)
    assert core.stats.renewed == 1 and core.stats.requests == 1 and not core.stopped
    assert core.wait_s(10.0) == pytest.approx(3.0)  # the grant of the renewed item


# -- end to end -----------------------------------------------------------------------------------
ADMIN = "sk-admin"
TENANTS = [{"name": "team-a", "api_keys": ["sk-a"]}, {"name": "team-b", "api_keys": ["sk-b"]}]
CHECK_S = 0.2


def turn(s: Stack, key: str, conv: str, lease: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "X-Conversation-Id": conv}
    if lease is not None:
        headers["X-AgentKV-Lease"] = lease
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "kv_transfer_params": {"prompt_token_ids": list(range(1, 41))},
    }
    return httpx.post(f"{s.router.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def lease(s: Stack, key: str, conv: str) -> httpx.Response:
    return httpx.post(
        f"{s.router.url}/v1/conversations/{conv}/lease",
        json={"lease_s": 30},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def leases(s: Stack, key: str, ids: list[str]) -> httpx.Response:
    return httpx.post(
        f"{s.router.url}/v1/conversations/leases",
        json={"lease_s": 30, "ids": ids},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def lease_gauge(s: Stack) -> float:
    r = httpx.get(f"{s.router.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)["agentkv_router_leases"]


def gauge_settles_at(s: Stack, value: float, timeout_s: float = 10) -> float:
    """The lease gauge once it has held still for three lease checks (or ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    last = lease_gauge(s)
    while time.monotonic() < deadline:
        time.sleep(3 * CHECK_S)
        now = lease_gauge(s)
        if now == last == value:
            return now
        last = now
    return last


def is_openai_error(r: httpx.Response, status: int, word: str) -> bool:
    body = r.json()
    error = body.get("error", {})
    return (
        r.status_code == status
        and set(body) == {"error"}
        and set(error) == {"message", "type", "param", "code"}
        and error["code"] == status
        and word in error["message"]
    )


@pytest.fixture(params=["memory", "redis"])
def e2e(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Stack, str, int]]:
    """A router with two tenants, a bound of 3 leases each, and an admin key; its store, and
    how many unknown ids the flood sends (Redis: one store look-up a round trip each)."""
    store, unknown = "memory", 100_000
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
        store, unknown = url.rsplit("/", 1)[0] + "/7", 20_000  # a database of its own
        import redis

        redis.Redis.from_url(store).flushdb()
    router = {
        "tenancy": {"tenants": TENANTS, "admin_api_keys": [ADMIN]},
        "retention": {"max_leases_per_tenant": 3, "lease_check_interval_s": CHECK_S},
        "store": {"backend": store},
    }
    with stack(tmp_path, router=router) as s:
        yield s, store, unknown


@pytest.mark.e2e
def test_leases_only_where_there_is_kv_and_a_bound_per_tenant(
    e2e: tuple[Stack, str, int],
) -> None:
    s, store, unknown = e2e
    # a turn's header starts a lease (the turn makes the handle)
    assert turn(s, "sk-a", "c0", lease="30").status_code == 200
    assert gauge_settles_at(s, 1) == 1

    # a lease for a conversation with no stored KV: 404 in OpenAI's shape, nothing added
    r = lease(s, "sk-a", "ghost")
    assert is_openai_error(r, 404, "No stored KV"), r.text
    assert r.json()["error"]["type"] == "NotFoundError"
    assert is_openai_error(lease(s, "sk-b", "c0"), 404, "No stored KV")  # another tenant's
    started, rss_before = time.monotonic(), rss_mib(s.router.pid)
    for i in range(0, unknown, BATCH):
        r = leases(s, "sk-a", [f"unknown-{j}" for j in range(i, i + BATCH)])
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == BATCH and all(d["error"]["code"] == 404 for d in data)
        assert all("lease_s" not in d for d in data)
    print(
        f"\n{store}: {unknown} lease calls on unknown ids in {time.monotonic() - started:.1f} s,"
        f" router RSS {rss_before:.0f} -> {rss_mib(s.router.pid):.0f} MiB"
    )
    assert gauge_settles_at(s, 1) == 1
    if store != "memory":
        import redis

        client = redis.Redis.from_url(store)
        sets = client.smembers("agentkv:leases:tenants")
        assert sum(client.zcard(k) for k in sets) == 1

    # the bound: 3 leases for team-a (c0 and two lease calls), then 429 in OpenAI's shape
    for conv in ("c1", "c2", "c3"):
        assert turn(s, "sk-a", conv).status_code == 200  # stored KV, no lease
    assert lease(s, "sk-a", "c1").json() == {
        "id": "c1",
        "object": "conversation.lease",
        "lease_s": 30,
    }
    assert lease(s, "sk-a", "c2").status_code == 200
    r = lease(s, "sk-a", "c3")
    assert is_openai_error(r, 429, "max_leases_per_tenant"), r.text
    assert r.json()["error"]["type"] == "RateLimitError"
    r = leases(s, "sk-a", ["c0", "c1", "c2", "c3", "ghost"])
    assert r.status_code == 200
    assert [d.get("lease_s") or d["error"]["code"] for d in r.json()["data"]] == [
        30,
        30,
        30,
        429,
        404,
    ]
    # a turn past the bound is served, without a lease; another tenant has its own bound
    assert turn(s, "sk-a", "c4", lease="30").status_code == 200
    assert turn(s, "sk-b", "b0", lease="30").status_code == 200
    assert lease(s, "sk-b", "b0").status_code == 200
    assert gauge_settles_at(s, 4) == 4

    # closing a conversation drops its lease: room for another
    closed = httpx.delete(
        f"{s.router.url}/v1/conversations/c1", headers={"Authorization": "Bearer sk-a"}
    )
    assert closed.status_code == 200 and closed.json()["released"] is True
    assert lease(s, "sk-a", "c3").status_code == 200
    assert gauge_settles_at(s, 4) == 4
