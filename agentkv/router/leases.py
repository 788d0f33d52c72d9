"""Retention leases: hold a conversation's KV while its agent lives, free it when it is gone.

A turn carrying ``X-AgentKV-Lease: <seconds>`` (or ``POST /v1/conversations/{id}/lease``)
starts or renews the conversation's lease. While it lives the router keeps the conversation's
handles (up to D's TTL, as always); when it lapses — the agent died, or stopped renewing — the
router releases D's blocks at once (notify-only) instead of letting them sit until D's TTL.
Conversations that never sent a lease keep today's behaviour.

Two implementations: :class:`MemoryLeases` (one router) and :class:`RedisLeases` (replicas
sharing the handle store's Redis: one sorted set scored by expiry on Redis's clock; of several
replicas reaping at once, the one whose ``ZREM`` removes a key releases it).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import orjson

from agentkv.router.store import StoreKey

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["Leases", "MemoryLeases", "RedisLeases"]


class Leases(Protocol):
    async def renew(self, key: StoreKey, seconds: float) -> None: ...

    async def lapsed(self, limit: int = 1000) -> list[StoreKey]:
        """Remove and return leases that have run out (each returned once)."""
        ...

    async def drop(self, key: StoreKey) -> None: ...

    async def size(self) -> int: ...


class MemoryLeases:
    """Leases of one router process, on ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._expiry: dict[StoreKey, float] = {}
        self._heap: list[tuple[float, StoreKey]] = []

    async def renew(self, key: StoreKey, seconds: float) -> None:
        at = self._clock() + seconds
        self._expiry[key] = at
        heapq.heappush(self._heap, (at, key))
        if len(self._heap) > 2 * len(self._expiry) + 1024:
            self._heap = [(t, k) for k, t in self._expiry.items()]
            heapq.heapify(self._heap)

    async def lapsed(self, limit: int = 1000) -> list[StoreKey]:
        now = self._clock()
        out: list[StoreKey] = []
        while self._heap and self._heap[0][0] <= now and len(out) < limit:
            at, key = heapq.heappop(self._heap)
            if self._expiry.get(key) == at:
                del self._expiry[key]
                out.append(key)
        return out

    async def drop(self, key: StoreKey) -> None:
        self._expiry.pop(key, None)

    async def size(self) -> int:
        return len(self._expiry)


# KEYS: the lease set. ARGV: member, seconds. Score: expiry in ms on Redis's clock.
_RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + math.floor(tonumber(ARGV[2]) * 1000), ARGV[1])
return now
"""

# KEYS: the lease set. ARGV: limit. Returns the members that lapsed, removed.
_LAPSED_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, m in ipairs(due) do redis.call('ZREM', KEYS[1], m) end
return due
"""


def _member(key: StoreKey) -> bytes:
    return orjson.dumps(list(key))


def _key(member: bytes | str) -> StoreKey:
    tenant, conversation = orjson.loads(member)
    return str(tenant), str(conversation)


class RedisLeases:
    """Leases shared by router replicas in one Redis sorted set (``{prefix}leases``)."""

    def __init__(self, client: redis.asyncio.Redis, *, prefix: str = "agentkv:") -> None:
        self._client = client
        self._set = f"{prefix}leases"
        self._renew = client.register_script(_RENEW_LUA)
        self._lapsed = client.register_script(_LAPSED_LUA)

    async def renew(self, key: StoreKey, seconds: float) -> None:
        await self._renew(keys=[self._set], args=[_member(key), seconds])

    async def lapsed(self, limit: int = 1000) -> list[StoreKey]:
        due = await self._lapsed(keys=[self._set], args=[limit])
        return [_key(m) for m in due or []]

    async def drop(self, key: StoreKey) -> None:
        await self._client.zrem(self._set, _member(key))

    async def size(self) -> int:
        return int(await self._client.zcard(self._set))
