"""The handle store on Redis (>= 6.2), shared by several router replicas.

Layout (``%`` and ``:`` in the tenant and conversation id escaped as ``%25`` and ``%3A``):

- one key per handle, ``f"{prefix}h:{tenant}:{conversation_id}:{handle_id}"``, value
  ``b"<ttl_ms> " + StoredHandle.to_bytes()`` (a binary record: its block digests raw, its format
  versioned by a magic prefix, so a replica of another version reads it as absent), expiry
  ``PX`` (the stored ttl and the key's ``PTTL`` give a handle's age on Redis's clock, which all
  replicas share);
- one index per conversation, ``f"{prefix}i:{tenant}:{conversation_id}"``, a sorted set of handle
  ids scored by when they were stored (Redis's ``TIME``), expiring with its newest handle;
- with a per-tenant bound (``max_entries_per_tenant``), one set per tenant,
  ``f"{prefix}t:{tenant}"``, of its handle keys scored by when they expire (µs on Redis's clock):
  ``put`` adds to it, drops what has expired, and while the tenant holds more than its bound
  takes its oldest handles out (returned with the displaced ones), so one tenant's
  conversations never evict another's.

Every operation that changes a conversation is one Lua script, atomic on the server: ``put``
(store, index, drop the oldest beyond K and return them), ``take`` (GET, PTTL, DEL of one handle:
of any number of replicas racing on one handle exactly one gets it). Scripts touch the handle keys
of the conversation they are given, so this layout is for a single Redis (or a primary with
replicas), not Redis Cluster. No LRU over the whole: bound memory with Redis's ``maxmemory`` and a
``volatile-*`` eviction policy (every key here has a TTL), with room for every tenant's bound so
that Redis's own eviction, which knows no tenants, never runs; an evicted handle's blocks are
freed by D's own TTL.

Connection errors and timeouts are retried on a fresh connection (redis-py's ``Retry``), so a
restarted Redis costs no turn; the router's :class:`~agentkv.router.guard.GuardedStore` turns
what still fails into a miss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from agentkv.router.store import (
    DEFAULT_PER_CONVERSATION,
    OnEvict,
    StoredHandle,
    StoreKey,
    Taken,
    check_per_conversation,
    check_per_tenant,
    check_ttl,
    issued_by,
)

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["RedisStore"]

log = logging.getLogger("agentkv.router")

_REDIS_EXTRA_HINT = 'RedisStore needs the redis client library: pip install "vllm-agentkv[redis]"'

# KEYS: handle key, index key, tenant key. ARGV: handle id, value, px, K, handle key prefix of the
# conversation, the tenant's bound (0: none). Returns {the values of the handles dropped beyond K
# (oldest first), the values of the tenant's handles evicted past its bound}.
_PUT_LUA = """
local px = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[2], 'PX', px)
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZADD', KEYS[2], now_us, ARGV[1])
if redis.call('PTTL', KEYS[2]) < px then
  redis.call('PEXPIRE', KEYS[2], px)
end
local out = {}
local ids = redis.call('ZRANGE', KEYS[2], 0, -1)
local live = {}
for _, id in ipairs(ids) do
  if redis.call('EXISTS', ARGV[5] .. id) == 1 then
    table.insert(live, id)
  else
    redis.call('ZREM', KEYS[2], id)
  end
end
local k = tonumber(ARGV[4])
local i = 1
while #live - i + 1 > k do
  local hk = ARGV[5] .. live[i]
  local v = redis.call('GET', hk)
  if v then table.insert(out, v) end
  redis.call('DEL', hk)
  redis.call('ZREM', KEYS[2], live[i])
  redis.call('ZREM', KEYS[3], hk)
  i = i + 1
end
local evicted = {}
local bound = tonumber(ARGV[6])
if bound > 0 then
  redis.call('ZADD', KEYS[3], now_us + px * 1000, KEYS[1])
  if redis.call('PTTL', KEYS[3]) < px then
    redis.call('PEXPIRE', KEYS[3], px)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_us)
  while redis.call('ZCARD', KEYS[3]) > bound do
    local hk = redis.call('ZPOPMIN', KEYS[3])[1]
    local v = redis.call('GET', hk)
    if v then
      table.insert(evicted, v)
      redis.call('DEL', hk)
    end
  end
end
return {out, evicted}
"""

# KEYS: index key. ARGV: handle key prefix. Returns {id, value, pttl, ...} newest first.
_LIST_LUA = """
local ids = redis.call('ZREVRANGE', KEYS[1], 0, -1)
local out = {}
for _, id in ipairs(ids) do
  local v = redis.call('GET', ARGV[1] .. id)
  if v then
    table.insert(out, id)
    table.insert(out, v)
    table.insert(out, redis.call('PTTL', ARGV[1] .. id))
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
"""

# KEYS: handle key, index key, tenant key. ARGV: handle id. Atomic get-and-delete with the
# remaining TTL (ms).
_TAKE_LUA = """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], KEYS[1])
local v = redis.call('GET', KEYS[1])
if not v then return false end
local ttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
return {v, ttl}
"""

# Compare-and-delete, per key: delete KEYS[i] only if it still holds ARGV[i] (drop_decode must not
# drop a handle that another replica has just stored under the same key); KEYS[#ARGV + i] is the
# set of KEYS[i]'s tenant.
_DROP_IF_UNCHANGED_LUA = """
local n = 0
for i, v in ipairs(ARGV) do
  if redis.call('GET', KEYS[i]) == v then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[#ARGV + i], KEYS[i])
    n = n + 1
  end
end
return n
"""

_SCAN_COUNT = 1000


def _escape_part(part: str) -> str:
    """Make a tenant or conversation id safe between ':' separators (injective)."""
    return part.replace("%", "%25").replace(":", "%3A")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _pack(handle: StoredHandle, ttl_ms: int) -> bytes:
    return b"%d " % ttl_ms + handle.to_bytes()


def _unpack(raw: bytes | str) -> tuple[int, StoredHandle] | None:
    """``(ttl_ms, handle)``, or ``None`` (logged) for a value this router cannot read."""
    data = _as_bytes(raw)
    head, sep, body = data.partition(b" ")
    try:
        if not sep or not head.isdigit():
            raise ValueError("stored value lacks its '<ttl_ms> ' header")
        return int(head), StoredHandle.from_bytes(body)
    except ValueError as e:
        log.warning("ignoring an unreadable handle in Redis: %s", e)
        return None


def _taken(raw: bytes | str, pttl_ms: int) -> Taken | None:
    unpacked = _unpack(raw)
    if unpacked is None:
        return None
    ttl_ms, handle = unpacked
    # PTTL is -1 for a key without expiry (never written so by this store): age unknown, 0.
    age_ms = ttl_ms - pttl_ms if pttl_ms >= 0 else 0
    return Taken(handle, age_s=max(0, age_ms) / 1000)


class RedisStore:
    """Several router replicas' shared store (see the module docstring for the layout).

    ``client``: an existing ``redis.asyncio.Redis`` (then ``url`` is not used and ``aclose`` leaves
    the client open); otherwise one is made from ``url``, with retries of connection errors on a
    fresh connection, and closed by ``aclose``.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "agentkv:",
        per_conversation: int = DEFAULT_PER_CONVERSATION,
        max_entries_per_tenant: int | None = None,
        on_evict: OnEvict | None = None,
        client: redis.asyncio.Redis | None = None,
        socket_timeout_s: float = 2.0,
    ) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import ExponentialBackoff
            from redis.exceptions import ConnectionError, TimeoutError
        except ImportError as e:
            raise ImportError(_REDIS_EXTRA_HINT) from e
        check_per_conversation(per_conversation)
        check_per_tenant(max_entries_per_tenant)
        self._prefix = prefix
        self._per_conversation = per_conversation
        self._per_tenant = max_entries_per_tenant or 0
        self._on_evict = on_evict
        self._owns_client = client is None
        self._client: redis.asyncio.Redis = (
            aioredis.Redis.from_url(
                url,
                retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
                retry_on_error=[ConnectionError, TimeoutError],
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                health_check_interval=10,
            )
            if client is None
            else client
        )
        self._put_script = self._client.register_script(_PUT_LUA)
        self._list_script = self._client.register_script(_LIST_LUA)
        self._take_script = self._client.register_script(_TAKE_LUA)
        self._drop_script = self._client.register_script(_DROP_IF_UNCHANGED_LUA)

    @property
    def client(self) -> redis.asyncio.Redis:
        return self._client

    @property
    def prefix(self) -> str:
        return self._prefix

    def _conv(self, key: StoreKey) -> str:
        tenant, conversation_id = key
        return f"{_escape_part(tenant)}:{_escape_part(conversation_id)}"

    def key(self, key: StoreKey, handle_id: str) -> str:
        """The Redis key under which one of ``key``'s handles lives."""
        return f"{self._prefix}h:{self._conv(key)}:{handle_id}"

    def index_key(self, key: StoreKey) -> str:
        """The Redis sorted set of ``key``'s handle ids."""
        return f"{self._prefix}i:{self._conv(key)}"

    def tenant_key(self, tenant: str) -> str:
        """The Redis sorted set of ``tenant``'s handle keys (kept with a per-tenant bound)."""
        return f"{self._prefix}t:{_escape_part(tenant)}"

    def _tenant_key_of(self, handle_key: bytes) -> bytes:
        """The tenant set of a handle key (``{prefix}h:{tenant}:…``; the tenant has no ':')."""
        tenant = handle_key[len(self._prefix) + 2 :].split(b":", 1)[0]
        return self._prefix.encode() + b"t:" + tenant

    async def put(
        self, key: StoreKey, handle: StoredHandle, ttl_s: float, *, age_s: float = 0.0
    ) -> list[StoredHandle]:
        check_ttl(ttl_s)
        ttl_ms = max(1, round(ttl_s * 1000))
        px = ttl_ms - round(max(0.0, age_s) * 1000)
        if px <= 0:
            return []
        dropped, evicted = await self._put_script(
            keys=[self.key(key, handle.id), self.index_key(key), self.tenant_key(key[0])],
            args=[
                handle.id,
                _pack(handle, ttl_ms),
                px,
                self._per_conversation,
                self.key(key, ""),
                self._per_tenant,
            ],
        )
        out: list[StoredHandle] = []
        for raw in [*(dropped or []), *(evicted or [])]:
            unpacked = _unpack(raw)
            if unpacked is not None:
                out.append(unpacked[1])
        if self._on_evict is not None:
            for _ in evicted or []:
                self._on_evict(key[0], "tenant")
        return out

    async def candidates(self, key: StoreKey) -> list[Taken]:
        flat = await self._list_script(keys=[self.index_key(key)], args=[self.key(key, "")])
        out: list[Taken] = []
        for i in range(0, len(flat or []), 3):
            taken = _taken(flat[i + 1], int(flat[i + 2]))
            if taken is not None:
                out.append(taken)
        return out

    async def take(self, key: StoreKey, handle_id: str | None = None) -> Taken | None:
        if handle_id is None:
            live = await self.candidates(key)
            if not live:
                return None
            handle_id = live[0].handle.id
        got = await self._take_script(
            keys=[self.key(key, handle_id), self.index_key(key), self.tenant_key(key[0])],
            args=[handle_id],
        )
        if not got:
            return None
        raw, pttl_ms = got
        return _taken(raw, int(pttl_ms))

    async def delete(self, key: StoreKey) -> list[StoredHandle]:
        out: list[StoredHandle] = []
        for candidate in await self.candidates(key):
            taken = await self.take(key, candidate.handle.id)
            if taken is not None:
                out.append(taken.handle)
        return out

    async def drop_decode(self, decode_url: str, *, except_engine_id: str | None = None) -> int:
        dropped = 0
        async for keys in self._scan():
            values = await self._client.mget(keys)
            doomed_keys: list[bytes] = []
            doomed_values: list[bytes] = []
            for k, raw in zip(keys, values, strict=True):
                if raw is None:
                    continue
                unpacked = _unpack(raw)
                if (
                    unpacked is not None
                    and unpacked[1].decode_url == decode_url
                    and not issued_by(unpacked[1], except_engine_id)
                ):
                    doomed_keys.append(k)
                    doomed_values.append(_as_bytes(raw))
            if doomed_keys:
                tenants = [self._tenant_key_of(k) for k in doomed_keys]
                dropped += int(
                    await self._drop_script(keys=[*doomed_keys, *tenants], args=doomed_values)
                )
        return dropped

    async def take_oldest(self, decode_url: str, fraction: float) -> list[StoredHandle]:
        held: list[tuple[float, bytes]] = []
        async for keys in self._scan():
            values = await self._client.mget(keys)
            pttls = await asyncio.gather(*(self._client.pttl(k) for k in keys))
            for k, raw, pttl in zip(keys, values, pttls, strict=True):
                if raw is None:
                    continue
                taken = _taken(raw, int(pttl))
                if taken is not None and taken.handle.decode_url == decode_url:
                    held.append((taken.age_s, k))
        held.sort(reverse=True)
        out: list[StoredHandle] = []
        for _, k in held[: max(1, int(len(held) * fraction))] if held else []:
            # the same atomic take as a turn's: a handle a turn took first is skipped
            prefix, _, handle_id = k.decode().rpartition(":")
            index = self._prefix + "i:" + prefix[len(self._prefix) + 2 :]
            got = await self._take_script(keys=[k, index, self._tenant_key_of(k)], args=[handle_id])
            if got:
                taken = _taken(got[0], int(got[1]))
                if taken is not None:
                    out.append(taken.handle)
        return out

    async def size(self) -> int:
        seen: set[bytes] = set()
        async for keys in self._scan():
            seen.update(keys)
        return len(seen)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _scan(self) -> AsyncIterator[list[bytes]]:
        """Batches of this store's handle keys (SCAN may repeat a key; callers cope)."""
        pattern = _glob_escape(self._prefix) + "h:*"
        cursor = 0
        while True:
            cursor, keys = await self._client.scan(cursor, match=pattern, count=_SCAN_COUNT)
            if keys:
                yield [_as_bytes(k) for k in keys]
            if cursor == 0:
                return
