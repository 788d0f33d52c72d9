"""Retention leases: hold a conversation's KV while its agent lives, free it when it is gone.

A turn carrying ``X-AgentKV-Lease: <seconds>`` (or ``POST /v1/conversations/{id}/lease`` for a
conversation with a stored handle) starts or renews the conversation's lease. While it lives the
router keeps the conversation's handles (up to D's TTL, as always); when it lapses — the agent
died, or stopped renewing — the router releases D's blocks at once (notify-only) instead of
letting them sit until D's TTL. Conversations that never sent a lease keep today's behaviour.

Leases are a bounded resource: a tenant holds at most ``limit`` of them (lapsed ones not yet
released count), a renewal of a lease the tenant holds always succeeds, and :meth:`lapsed`
hands out lapsed leases round-robin across tenants, so one tenant's flood of lapsing leases
never delays another tenant's release.

Two implementations: :class:`MemoryLeases` (one router) and :class:`RedisLeases` (replicas
sharing the handle store's Redis: one sorted set per tenant scored by expiry on Redis's clock,
and a set of those sets; of several replicas reaping at once, the one whose script removes a
lease releases it).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import orjson

from agentkv.router.store import StoreKey

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["Leases", "MemoryLeases", "RedisLeases"]


class Leases(Protocol):
    async def renew(
        self, tenant: str, conversations: Sequence[str], seconds: float, *, limit: int
    ) -> list[bool]:
        """Start or renew ``tenant``'s leases of ``conversations`` for ``seconds`` (atomically);
        per conversation, False when it held no lease and the tenant already holds ``limit``."""
        ...

    async def lapsed(self, limit: int = 1000) -> list[StoreKey]:
        """Remove and return up to ``limit`` leases that have run out (each returned once),
        round-robin across tenants."""
        ...

    async def drop(self, key: StoreKey) -> None: ...

    async def size(self) -> int:
        """Leases held, lapsed ones not yet returned by :meth:`lapsed` included."""
        ...


class _Tenant:
    """One tenant's leases: conversation -> expiry, and a heap of (expiry, conversation) with
    stale items (an item is stale once its conversation has another expiry or none)."""

    def __init__(self) -> None:
        self.expiry: dict[str, float] = {}
        self.heap: list[tuple[float, str]] = []

    def put(self, conversation: str, at: float) -> None:
        self.expiry[conversation] = at
        heapq.heappush(self.heap, (at, conversation))
        if len(self.heap) > 2 * len(self.expiry) + 1024:
            self.heap = [(t, c) for c, t in self.expiry.items()]
            heapq.heapify(self.heap)

    def pop_lapsed(self, now: float) -> str | None:
        while self.heap and self.heap[0][0] <= now:
            at, conversation = heapq.heappop(self.heap)
            if self.expiry.get(conversation) == at:
                del self.expiry[conversation]
                return conversation
        return None


class MemoryLeases:
    """Leases of one router process, on ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._start = 0
        """Which tenant a round of :meth:`lapsed` starts with (rotates)."""

    async def renew(
        self, tenant: str, conversations: Sequence[str], seconds: float, *, limit: int
    ) -> list[bool]:
        at = self._clock() + seconds
        leases = self._tenants.get(tenant) or _Tenant()
        out: list[bool] = []
        for conversation in conversations:
            ok = conversation in leases.expiry or len(leases.expiry) < limit
            if ok:
                leases.put(conversation, at)
            out.append(ok)
        if leases.expiry:
            self._tenants[tenant] = leases
        return out

    async def lapsed(self, limit: int = 1000) -> list[StoreKey]:
        now = self._clock()
        names = list(self._tenants)
        if names:
            self._start = (self._start + 1) % len(names)
            names = names[self._start :] + names[: self._start]
        out: list[StoreKey] = []
        active = names
        while active and len(out) < limit:
            still: list[str] = []
            for name in active:
                if len(out) >= limit:
                    break
                conversation = self._tenants[name].pop_lapsed(now)
                if conversation is not None:
                    out.append((name, conversation))
                    still.append(name)
            active = still
        for name in names:
            if not self._tenants[name].expiry:
                del self._tenants[name]
        return out

    async def drop(self, key: StoreKey) -> None:
        leases = self._tenants.get(key[0])
        if leases is not None:
            leases.expiry.pop(key[1], None)
            if not leases.expiry:
                del self._tenants[key[0]]

    async def size(self) -> int:
        return sum(len(t.expiry) for t in self._tenants.values())

    async def held(self, tenant: str) -> int:
        """``tenant``'s leases (lapsed ones not yet returned by :meth:`lapsed` included)."""
        leases = self._tenants.get(tenant)
        return len(leases.expiry) if leases is not None else 0


_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: the tenant's lease set, the set of lease sets. ARGV: ms, the tenant's bound, members.
# Score: expiry in ms on Redis's clock. Returns 1 (held) or 0 (refused: at the bound) a member.
# The tenant's set expires a minute after its last lease would (every key here has a TTL).
_RENEW_LUA = (
    _NOW_MS
    + """
local ms = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local count = redis.call('ZCARD', KEYS[1])
local out = {}
for i = 3, #ARGV do
  local m = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], m) or count < limit then
    if redis.call('ZADD', KEYS[1], now + ms, m) == 1 then count = count + 1 end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if count > 0 then
  redis.call('SADD', KEYS[2], KEYS[1])
  if redis.call('PTTL', KEYS[1]) < ms + 60000 then redis.call('PEXPIRE', KEYS[1], ms + 60000) end
end
return out
"""
)

# KEYS: the set of lease sets. ARGV: limit, where the round starts. Removes and returns up to
# limit lapsed members, round-robin: each round every tenant with lapsed leases gives an equal
# share of what is left (at least one); a tenant's emptied set leaves the set of sets.
_LAPSED_LUA = (
    _NOW_MS
    + """
local limit = tonumber(ARGV[1])
local names = redis.call('SMEMBERS', KEYS[1])
local active = {}
local n = #names
for i = 1, n do active[i] = names[(i + tonumber(ARGV[2])) % n + 1] end
local out = {}
while #active > 0 and #out < limit do
  local share = math.max(1, math.floor((limit - #out) / #active))
  local still = {}
  for _, key in ipairs(active) do
    local room = limit - #out
    if room <= 0 then break end
    local take = math.min(share, room)
    local due = redis.call('ZRANGEBYSCORE', key, '-inf', now, 'LIMIT', 0, take)
    for _, m in ipairs(due) do
      redis.call('ZREM', key, m)
      out[#out + 1] = m
    end
    if #due == take then
      still[#still + 1] = key
    elseif redis.call('ZCARD', key) == 0 then
      redis.call('SREM', KEYS[1], key)
    end
  end
  active = still
end
return out
"""
)

# KEYS: the set of lease sets. Returns the number of leases in all of them.
_SIZE_LUA = """
local n = 0
for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do n = n + redis.call('ZCARD', key) end
return n
"""


def _member(key: StoreKey) -> bytes:
    return orjson.dumps(list(key))


def _key(member: bytes | str) -> StoreKey:
    tenant, conversation = orjson.loads(member)
    return str(tenant), str(conversation)


class RedisLeases:
    """Leases shared by router replicas: one Redis sorted set per tenant
    (``{prefix}leases:t:{tenant}``, ``%`` and ``:`` escaped) and the set of them
    (``{prefix}leases:tenants``). Every change is one Lua script, atomic on the server."""

    def __init__(self, client: redis.asyncio.Redis, *, prefix: str = "agentkv:") -> None:
        self._client = client
        self._prefix = prefix
        self._tenants = f"{prefix}leases:tenants"
        self._renew = client.register_script(_RENEW_LUA)
        self._lapsed = client.register_script(_LAPSED_LUA)
        self._size = client.register_script(_SIZE_LUA)
        self._start = 0

    def tenant_key(self, tenant: str) -> str:
        """The sorted set of ``tenant``'s leases."""
        escaped = tenant.replace("%", "%25").replace(":", "%3A")
        return f"{self._prefix}leases:t:{escaped}"

    async def renew(
        self, tenant: str, conversations: Sequence[str], seconds: float, *, limit: int
    ) -> list[bool]:
        if not conversations:
            return []
        members = [_member((tenant, c)) for c in conversations]
        ms = max(1, round(seconds * 1000))
        flags = await self._renew(
            keys=[self.tenant_key(tenant), self._tenants], args=[ms, limit, *members]
        )
        return [bool(int(f)) for f in flags]

    async def lapsed(self, limit: int = 1000) -> list[StoreKey]:
        self._start += 1
        due = await self._lapsed(keys=[self._tenants], args=[limit, self._start])
        return [_key(m) for m in due or []]

    async def drop(self, key: StoreKey) -> None:
        await self._client.zrem(self.tenant_key(key[0]), _member(key))

    async def size(self) -> int:
        return int(await self._size(keys=[self._tenants]))

    async def held(self, tenant: str) -> int:
        """``tenant``'s leases (lapsed ones not yet returned by :meth:`lapsed` included)."""
        return int(await self._client.zcard(self.tenant_key(tenant)))
