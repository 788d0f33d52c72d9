"""The router's handle store: the same rules for MemoryStore and RedisStore (a real redis-server),
then what is particular to each."""

from __future__ import annotations

import asyncio
import logging
import math
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import pytest

from agentkv.router.memory_store import MemoryStore
from agentkv.router.redis_store import RedisStore
from agentkv.router.store import (
    HandleStore,
    StoredHandle,
    StoreKey,
    make_store,
)
from tests._support.clock import FakeClock

pytestmark = pytest.mark.anyio

TTL = 60.0
SHORT_TTL = 0.2
PAST_SHORT_TTL = 0.3


def handle(n: int = 0, *, decode: str = "http://10.0.0.2:8200", epoch: int = 0) -> StoredHandle:
    """A D handle shaped like vLLM 0.33's (NixlConnector) response kv_transfer_params."""
    return StoredHandle(
        params={
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[10 + n, 11 + n, 12 + n]],
            "remote_engine_id": f"engine-{n}",
            "remote_request_id": f"req-{n}",
            "remote_host": "10.0.0.2",
            "remote_port": 5600,
            "remote_num_tokens": 40 + n,
            "remote_blocks_expiry_time": 1234.5,
            "tp_size": 1,
        },
        block_hashes=bytes([n % 256]) * 16 + bytes([(n + 1) % 256]) * 16,
        tail_tokens=[7, 8, n],
        num_tokens=40 + n,
        block_size=16,
        epoch=epoch,
        decode_url=decode,
    )


@dataclass
class Harness:
    kind: str
    store: HandleStore
    advance: Callable[[float], Awaitable[None]]
    """Let this much time pass for the store (a fake clock in memory, a real sleep in Redis)."""


@pytest.fixture(params=["memory", "redis"])
async def h(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Harness]:
    """One handle per conversation (the rules of one branch); :func:`hk` keeps three."""
    async for harness in _harness(request, per_conversation=1):
        yield harness


@pytest.fixture(params=["memory", "redis"])
async def hk(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Harness]:
    async for harness in _harness(request, per_conversation=3):
        yield harness


async def _harness(request: pytest.FixtureRequest, per_conversation: int) -> AsyncIterator[Harness]:
    store: HandleStore
    if request.param == "memory":
        clock = FakeClock()
        store = MemoryStore(max_entries=1000, clock=clock, per_conversation=per_conversation)

        async def advance(s: float) -> None:
            clock.now += s

    else:
        url: str = request.getfixturevalue("redis_url")
        store = RedisStore(
            url, prefix=f"test-{uuid.uuid4().hex}:", per_conversation=per_conversation
        )

        async def advance(s: float) -> None:
            await asyncio.sleep(s)

    try:
        yield Harness(request.param, store, advance)
    finally:
        await store.aclose()


@pytest.fixture
async def redis_pair(redis_url: str, anyio_backend: str) -> AsyncIterator[tuple[RedisStore, ...]]:
    """Two router replicas: two RedisStores with their own connections, one server, one prefix."""
    prefix = f"test-{uuid.uuid4().hex}:"
    a = RedisStore(redis_url, prefix=prefix, per_conversation=1)
    b = RedisStore(redis_url, prefix=prefix, per_conversation=1)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


K: StoreKey = ("tenant-a", "conv-1")


# --- rules both stores keep ------------------------------------------------------------------


async def test_put_then_take_is_single_use(h: Harness) -> None:
    assert await h.store.put(K, handle(1), TTL) == []
    taken = await h.store.take(K)
    assert taken is not None
    assert taken.handle == handle(1)
    assert await h.store.take(K) is None


async def test_take_absent_is_none(h: Harness) -> None:
    assert await h.store.take(K) is None
    assert await h.store.take(("", "")) is None


async def test_take_after_ttl_is_none(h: Harness) -> None:
    await h.store.put(K, handle(1), SHORT_TTL)
    await h.advance(PAST_SHORT_TTL)
    assert await h.store.take(K) is None


async def test_take_just_before_ttl_succeeds(h: Harness) -> None:
    await h.store.put(K, handle(1), TTL)
    await h.advance(0.05)
    assert await h.store.take(K) is not None


async def test_overwrite_returns_the_old_handle(h: Harness) -> None:
    assert await h.store.put(K, handle(1), TTL) == []
    assert await h.store.put(K, handle(2), TTL) == [handle(1)]
    taken = await h.store.take(K)
    assert taken is not None
    assert taken.handle == handle(2)


async def test_overwriting_an_expired_handle_returns_nothing(h: Harness) -> None:
    await h.store.put(K, handle(1), SHORT_TTL)
    await h.advance(PAST_SHORT_TTL)
    assert await h.store.put(K, handle(2), TTL) == []


async def test_age_is_time_since_put(h: Harness) -> None:
    await h.store.put(K, handle(1), TTL)
    await h.advance(0.1)
    taken = await h.store.take(K)
    assert taken is not None
    if h.kind == "memory":
        assert taken.age_s == pytest.approx(0.1)
    else:  # Redis's clock, millisecond PTTL
        assert 0.09 <= taken.age_s < 2.0


async def test_fresh_handle_has_near_zero_age(h: Harness) -> None:
    await h.store.put(K, handle(1), TTL)
    taken = await h.store.take(K)
    assert taken is not None
    assert 0.0 <= taken.age_s < 0.5


async def test_tenants_are_isolated(h: Harness) -> None:
    await h.store.put(("tenant-a", "same"), handle(1), TTL)
    await h.store.put(("tenant-b", "same"), handle(2), TTL)
    a = await h.store.take(("tenant-a", "same"))
    assert a is not None
    assert a.handle == handle(1)
    assert await h.store.take(("tenant-a", "same")) is None
    b = await h.store.take(("tenant-b", "same"))
    assert b is not None
    assert b.handle == handle(2)


# Pairs of keys that a naive f"{tenant}:{conversation}" would confuse, and unicode.
AWKWARD = [
    (("a:b", "c"), ("a", "b:c")),
    (("a", "b%3Ac"), ("a", "b:c")),
    (("a%", "3A"), ("a", "%3A")),
    (("", "x"), ("x", "")),
    (("租户", "会话/🙂"), ("租户", "会话/🙁")),
    (("t*", "c?"), ("t[", "]c\\")),
]


@pytest.mark.parametrize(("k1", "k2"), AWKWARD)
async def test_awkward_ids_are_distinct_keys(h: Harness, k1: StoreKey, k2: StoreKey) -> None:
    await h.store.put(k1, handle(1), TTL)
    await h.store.put(k2, handle(2), TTL)
    assert await h.store.size() == 2
    t1, t2 = await h.store.take(k1), await h.store.take(k2)
    assert t1 is not None
    assert t2 is not None
    assert (t1.handle, t2.handle) == (handle(1), handle(2))


async def test_delete(h: Harness) -> None:
    await h.store.put(K, handle(1), TTL)
    assert await h.store.delete(K) == [handle(1)]
    assert await h.store.delete(K) == []
    assert await h.store.take(K) is None
    await h.store.put(K, handle(2), SHORT_TTL)
    await h.advance(PAST_SHORT_TTL)
    assert await h.store.delete(K) == []


async def test_drop_decode(h: Harness) -> None:
    dead, alive = "http://10.0.0.2:8200", "http://10.0.0.3:8200"
    for i in range(5):
        await h.store.put(("t", f"dead-{i}"), handle(i, decode=dead), TTL)
    for i in range(3):
        await h.store.put(("t", f"alive-{i}"), handle(i, decode=alive), TTL)
    # Moved: stored on the dead D first, then overwritten by a handle on the live one.
    await h.store.put(("t", "moved"), handle(9, decode=dead), TTL)
    await h.store.put(("t", "moved"), handle(9, decode=alive), TTL)

    assert await h.store.drop_decode(dead) == 5
    assert await h.store.drop_decode(dead) == 0
    assert await h.store.drop_decode("http://never-seen") == 0
    assert await h.store.size() == 4
    assert await h.store.take(("t", "dead-0")) is None
    moved = await h.store.take(("t", "moved"))
    assert moved is not None
    assert moved.handle.decode_url == alive


async def test_drop_decode_does_not_count_expired(h: Harness) -> None:
    dead = "http://10.0.0.2:8200"
    await h.store.put(("t", "old"), handle(1, decode=dead), SHORT_TTL)
    await h.advance(PAST_SHORT_TTL)
    await h.store.put(("t", "new"), handle(2, decode=dead), TTL)
    assert await h.store.drop_decode(dead) == 1


async def test_size_counts_live_handles(h: Harness) -> None:
    assert await h.store.size() == 0
    await h.store.put(("t", "a"), handle(1), TTL)
    await h.store.put(("t", "b"), handle(2), SHORT_TTL)
    await h.store.put(("t", "a"), handle(3), TTL)  # overwrite: still one
    assert await h.store.size() == 2
    await h.advance(PAST_SHORT_TTL)
    assert await h.store.size() == 1
    await h.store.take(("t", "a"))
    assert await h.store.size() == 0


@pytest.mark.parametrize("ttl", [0.0, -1.0, math.nan, math.inf])
async def test_ttl_must_be_positive_and_finite(h: Harness, ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        await h.store.put(K, handle(1), ttl)
    assert await h.store.size() == 0


# --- StoredHandle records --------------------------------------------------------------------


def test_record_round_trip() -> None:
    original = replace(
        handle(3, decode="http://[::1]:8200", epoch=7),
        params={"remote_block_ids": [[1, 2], [3]], "note": "ünïcode 🙂\n", "x": None, "f": 1.5},
        block_hashes=bytes(range(256))[:48],  # raw digests: newlines and all
        prefix_digest=bytes(range(16)),
    )
    data = original.to_bytes()
    assert isinstance(data, bytes)
    assert StoredHandle.from_bytes(data) == original
    assert StoredHandle.from_bytes(data).params.decoded() == original.params


def test_record_keeps_digests_raw() -> None:
    """Issue 23: a 32k-token handle's 2,000 block digests are 16 bytes each in the record, not
    hex strings in JSON."""
    blob = bytes(range(256)) * 125  # 2,000 digests
    record = replace(handle(), block_hashes=blob).to_bytes()
    assert blob in record and len(record) < len(blob) + 600


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"not json", "format 3"),
        (b'{"v": 2, "params": {}}', "format 3"),  # an older replica's record: absent here
        (b"AKH3{}", "truncated"),
        (b"AKH3[]\n{}\n", "not a JSON object"),
        (handle().to_bytes().replace(b'"epoch":0', b'"epoch":true'), "epoch"),
        (handle().to_bytes().replace(b'"epoch":0', b'"epoch":"0"'), "epoch"),
        (handle().to_bytes().replace(b'"tail_tokens":[7,8,0]', b'"tail_tokens":[7,"8"]'), "tail"),
        (handle().to_bytes() + b"x", "block_hashes"),
        (handle().to_bytes().replace(b'"decode_url"', b'"decode"'), "decode_url"),
        (handle().to_bytes().replace(b'\n{"do_remote', b'\n[{"do_remote'), "JSON"),
        (handle().to_bytes().replace(b'"root":"', b'"root":"zz'), "root"),
        (handle().to_bytes().replace(b'"prefix":"', b'"prefix":"00'), "prefix"),
    ],
)
def test_from_bytes_rejects_malformed(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StoredHandle.from_bytes(data)


# --- MemoryStore -----------------------------------------------------------------------------


async def test_memory_lru_evicts_least_recently_used(anyio_backend: str) -> None:
    store = MemoryStore(max_entries=3, clock=FakeClock(), per_conversation=1)
    for i in range(3):
        assert await store.put(("t", str(i)), handle(i), TTL) == []
    # Re-storing "0" makes it the most recent, so "1" is now the least recently used.
    assert await store.put(("t", "0"), handle(10), TTL) == [handle(0)]
    assert await store.put(("t", "3"), handle(3), TTL) == [handle(1)]
    assert await store.size() == 3
    assert await store.take(("t", "1")) is None
    # Taking frees a slot: the next put evicts nothing.
    assert await store.take(("t", "2")) is not None
    assert await store.put(("t", "4"), handle(4), TTL) == []
    assert await store.size() == 3
    # Overwrite plus eviction in one put is impossible (overwrite frees its own slot) ...
    assert await store.put(("t", "4"), handle(5), TTL) == [handle(4)]
    # ... and a put beyond the bound returns the evicted one.
    assert await store.put(("t", "5"), handle(6), TTL) == [handle(10)]


async def test_memory_expired_entries_are_purged_not_returned(anyio_backend: str) -> None:
    clock = FakeClock()
    store = MemoryStore(max_entries=2, clock=clock)
    await store.put(("t", "short"), handle(1), 1.0)
    await store.put(("t", "long"), handle(2), 100.0)
    clock.now += 2.0
    # "short" expired: purged on put, so it is neither evicted nor returned.
    assert await store.put(("t", "new"), handle(3), 100.0) == []
    assert await store.size() == 2
    taken = await store.take(("t", "long"))
    assert taken is not None
    assert taken.age_s == pytest.approx(2.0)


async def test_memory_expiry_is_exact_on_the_clock(anyio_backend: str) -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    await store.put(K, handle(1), 10.0)
    clock.now += 9.999
    assert await store.size() == 1
    clock.now += 0.001
    assert await store.take(K) is None


async def test_memory_stays_bounded_under_churn(anyio_backend: str) -> None:
    clock = FakeClock()
    store = MemoryStore(max_entries=50, clock=clock, per_conversation=1)
    displaced = 0
    for i in range(5000):
        displaced += len(await store.put(("t", str(i % 200)), handle(i), TTL))
        if i % 3 == 0:
            await store.take(("t", str((i * 7) % 200)))
        clock.now += 0.001
    assert await store.size() <= 50
    assert displaced > 0
    clock.now += TTL
    assert await store.size() == 0


def test_memory_max_entries_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        MemoryStore(max_entries=0)


# --- RedisStore ------------------------------------------------------------------------------


async def test_redis_two_replicas_share_handles(redis_pair: tuple[RedisStore, ...]) -> None:
    a, b = redis_pair
    await a.put(K, handle(1), TTL)
    assert await b.size() == 1
    assert await b.put(K, handle(2), TTL) == [handle(1)]
    taken = await a.take(K)
    assert taken is not None
    assert taken.handle == handle(2)
    assert await b.take(K) is None


async def test_redis_racing_replicas_take_exactly_once(redis_pair: tuple[RedisStore, ...]) -> None:
    a, b = redis_pair
    keys = [("t", f"race-{i}") for i in range(50)]
    await asyncio.gather(*(a.put(k, handle(i), TTL) for i, k in enumerate(keys)))
    results = await asyncio.gather(*(s.take(k) for k in keys for s in (a, b, b, a)))
    for i, k in enumerate(keys):
        won = [t for t in results[4 * i : 4 * i + 4] if t is not None]
        assert [t.handle for t in won] == [handle(i)], k
    assert await a.size() == 0


async def test_redis_layout(redis_url: str, anyio_backend: str) -> None:
    """Key, value and expiry as documented (operators read them with redis-cli)."""
    store = RedisStore(redis_url, prefix="layout:")
    try:
        await store.put(("ten:ant", "conv%1"), handle(1), 30.0)
        key = f"layout:h:ten%3Aant:conv%251:{handle(1).id}"
        assert store.key(("ten:ant", "conv%1"), handle(1).id) == key
        assert store.index_key(("ten:ant", "conv%1")) == "layout:i:ten%3Aant:conv%251"
        raw = await store.client.get(key)
        assert raw == b"30000 " + handle(1).to_bytes()
        assert 29_000 < await store.client.pttl(key) <= 30_000
        assert await store.client.zrange("layout:i:ten%3Aant:conv%251", 0, -1) == [
            handle(1).id.encode()
        ]
        await store.delete(("ten:ant", "conv%1"))
        assert await store.client.exists(key) == 0
    finally:
        await store.aclose()


async def test_redis_prefixes_are_separate(redis_url: str, anyio_backend: str) -> None:
    one = RedisStore(redis_url, prefix=f"p[1]*-{uuid.uuid4().hex}:")
    two = RedisStore(redis_url, prefix=f"p[1]x-{uuid.uuid4().hex}:")
    try:
        await one.put(K, handle(1), TTL)
        await two.put(K, handle(2), TTL)
        await two.put(("t", "other"), handle(3), TTL)
        assert (await one.size(), await two.size()) == (1, 2)
        assert await one.drop_decode(handle(1).decode_url) == 1
        assert await two.size() == 2
    finally:
        await one.aclose()
        await two.aclose()


async def test_redis_drop_decode_and_size_walk_many_keys(
    redis_pair: tuple[RedisStore, ...],
) -> None:
    """More keys than one SCAN batch (1000)."""
    a, _ = redis_pair
    pipe = a.client.pipeline(transaction=False)
    for i in range(2500):
        h = handle(i, decode="http://dead:1" if i % 2 else "http://alive:1")
        pipe.set(a.key(("t", str(i)), h.id), b"60000 " + h.to_bytes(), px=60_000)
    await pipe.execute()
    assert await a.size() == 2500
    assert await a.drop_decode("http://dead:1") == 1250
    assert await a.size() == 1250


async def test_redis_unreadable_value_reads_as_absent(
    redis_pair: tuple[RedisStore, ...], caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = redis_pair
    await a.client.set(a.key(K, "bad"), b"garbage", px=60_000)
    await a.client.zadd(a.index_key(K), {"bad": 1})
    with caplog.at_level(logging.WARNING, logger="agentkv.router"):
        assert await a.candidates(K) == []
        assert await a.take(K, "bad") is None
    assert "unreadable handle" in caplog.text
    assert await a.client.exists(a.key(K, "bad")) == 0  # taken all the same: never read twice
    await a.client.set(a.key(K, handle(1).id), b'60000 {"v": 1}', px=60_000)
    assert await a.put(K, handle(1), TTL) == []


async def test_redis_leaves_a_given_client_open(redis_url: str, anyio_backend: str) -> None:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        store = RedisStore("redis://ignored:1", client=client, prefix=f"{uuid.uuid4().hex}:")
        await store.put(K, handle(1), TTL)
        await store.aclose()
        assert await client.ping()
    finally:
        await client.aclose()


# --- make_store ------------------------------------------------------------------------------


async def test_make_store_memory(anyio_backend: str) -> None:
    for url in (None, "memory"):
        store = make_store(url, max_entries=7)
        assert isinstance(store, MemoryStore)
        assert store.max_entries == 7
        await store.aclose()


async def test_make_store_redis(anyio_backend: str) -> None:
    # No server needed: the client connects on first use.
    store = make_store("redis://127.0.0.1:1/0", prefix="x:")
    assert isinstance(store, RedisStore)
    assert store.key(("t", "c"), "id") == "x:h:t:c:id"
    await store.aclose()


def test_make_store_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown handle store"):
        make_store("memcached://x")


def test_missing_redis_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(ImportError, match=r'pip install "vllm-agentkv\[redis\]"'):
        make_store("redis://127.0.0.1:1/0")


def test_store_module_imports_without_redis() -> None:
    code = (
        "import sys; sys.modules['redis'] = None; sys.modules['redis.asyncio'] = None\n"
        "import agentkv.router.store as s; s.make_store('memory')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- K handles per conversation (branches) ----------------------------------------------------


async def test_branches_keep_up_to_k_and_release_the_oldest(hk: Harness) -> None:
    for i in range(3):
        assert await hk.store.put(K, handle(i), TTL) == []
    assert await hk.store.put(K, handle(3), TTL) == [handle(0)]
    live = await hk.store.candidates(K)
    assert [c.handle for c in live] == [handle(3), handle(2), handle(1)]  # newest first
    assert await hk.store.size() == 3


async def test_take_one_branch_leaves_the_others(hk: Harness) -> None:
    for i in range(3):
        await hk.store.put(K, handle(i), TTL)
    taken = await hk.store.take(K, handle(1).id)
    assert taken is not None and taken.handle == handle(1)
    assert await hk.store.take(K, handle(1).id) is None
    assert [c.handle for c in await hk.store.candidates(K)] == [handle(2), handle(0)]


async def test_put_back_keeps_the_age(hk: Harness) -> None:
    await hk.store.put(K, handle(1), TTL)
    await hk.advance(0.2)
    taken = await hk.store.take(K)
    assert taken is not None
    await hk.store.put(K, taken.handle, TTL, age_s=taken.age_s)
    again = await hk.store.take(K)
    assert again is not None and again.age_s >= 0.19


async def test_put_back_past_its_ttl_is_dropped(hk: Harness) -> None:
    assert await hk.store.put(K, handle(1), 1.0, age_s=2.0) == []
    assert await hk.store.candidates(K) == []


async def test_delete_returns_every_branch(hk: Harness) -> None:
    for i in range(2):
        await hk.store.put(K, handle(i), TTL)
    assert sorted(h.id for h in await hk.store.delete(K)) == sorted([handle(0).id, handle(1).id])
    assert await hk.store.size() == 0


async def test_redis_racing_replicas_take_one_branch_once(
    redis_url: str, anyio_backend: str
) -> None:
    prefix = f"test-{uuid.uuid4().hex}:"
    a, b = RedisStore(redis_url, prefix=prefix), RedisStore(redis_url, prefix=prefix)
    try:
        for i in range(3):
            await a.put(K, handle(i), TTL)
        results = await asyncio.gather(*(s.take(K, handle(1).id) for s in (a, b, a, b)))
        assert [t.handle for t in results if t is not None] == [handle(1)]
        assert len(await b.candidates(K)) == 2
    finally:
        await a.aclose()
        await b.aclose()


@dataclass
class Quota:
    store: HandleStore
    evictions: list[tuple[str, str]]
    advance: Callable[[float], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
async def quota(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[Quota]:
    """A store of 100 handles, at most 5 per tenant, one per conversation, its evictions
    recorded."""
    evictions: list[tuple[str, str]] = []

    def on_evict(tenant: str, bound: str) -> None:
        evictions.append((tenant, bound))

    store: HandleStore
    if request.param == "memory":
        clock = FakeClock()
        store = MemoryStore(
            max_entries=100,
            max_entries_per_tenant=5,
            per_conversation=1,
            on_evict=on_evict,
            clock=clock,
        )

        async def advance(s: float) -> None:
            clock.now += s

    else:
        store = RedisStore(
            request.getfixturevalue("redis_url"),
            prefix=f"test-{uuid.uuid4().hex}:",
            per_conversation=1,
            max_entries_per_tenant=5,
            on_evict=on_evict,
        )

        async def advance(s: float) -> None:
            await asyncio.sleep(s)

    try:
        yield Quota(store, evictions, advance)
    finally:
        await store.aclose()


async def test_tenant_quota_evicts_only_that_tenant(quota: Quota) -> None:
    store = quota.store
    await store.put(("victim", "c"), handle(99), TTL)
    evicted = []
    for i in range(25):
        evicted += await store.put(("noisy", f"c{i}"), handle(i), TTL)
    assert [h.params["remote_request_id"] for h in evicted] == [f"req-{i}" for i in range(20)]
    assert quota.evictions == [("noisy", "tenant")] * 20
    assert await store.take(("victim", "c")) is not None
    assert await store.take(("noisy", "c19")) is None
    assert await store.take(("noisy", "c20")) is not None
    assert await store.size() == 4


async def test_taken_and_dropped_handles_leave_the_tenants_count(quota: Quota) -> None:
    store = quota.store
    for i in range(5):
        await store.put(("t", f"c{i}"), handle(i), TTL)
    for i in range(3):
        assert await store.take(("t", f"c{i}")) is not None
    assert await store.drop_decode(handle().decode_url) == 2
    for i in range(5, 10):  # five more fit: nothing taken or dropped still counts
        assert await store.put(("t", f"c{i}"), handle(i), TTL) == []
    assert quota.evictions == []
    assert len(await store.put(("t", "c10"), handle(10), TTL)) == 1


async def test_expired_handles_leave_the_tenants_count(quota: Quota) -> None:
    store = quota.store
    for i in range(5):
        await store.put(("t", f"c{i}"), handle(i), SHORT_TTL)
    await quota.advance(PAST_SHORT_TTL)
    for i in range(5, 10):
        assert await store.put(("t", f"c{i}"), handle(i), TTL) == []
    assert quota.evictions == []


async def test_redis_tenant_set_layout(redis_url: str, anyio_backend: str) -> None:
    store = RedisStore(redis_url, prefix=f"q-{uuid.uuid4().hex}:", max_entries_per_tenant=2)
    try:
        await store.put(("ten:ant", "c"), handle(1), 30.0)
        tenant_key = store.tenant_key("ten:ant")
        assert tenant_key == f"{store.prefix}t:ten%3Aant"
        members = await store.client.zrange(tenant_key, 0, -1)
        assert members == [store.key(("ten:ant", "c"), handle(1).id).encode()]
        assert 0 < await store.client.pttl(tenant_key) <= 30_000
        assert await store.size() == 1  # the tenant set is not a handle
    finally:
        await store.aclose()
