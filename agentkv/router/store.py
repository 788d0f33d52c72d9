"""The router's handle store: D's transfer handle per (tenant, conversation id), single use.

After each turn the router stores the decode instance's ``kv_transfer_params`` (with what it needs
to verify the next prompt against the blocks D holds) and on the next turn *takes* it: the take is
an atomic get-and-delete, so a handle is read at most once, even by several router replicas racing
on one Redis.

Two implementations of :class:`HandleStore`:

- :class:`MemoryStore`: one router process. Bounded (LRU over ``max_entries``) and TTL'd on an
  injectable monotonic clock.
- :class:`RedisStore`: several router replicas sharing one Redis (>= 6.2). Expiry is Redis's own
  (``PX``, the server's clock, so replicas agree on age and expiry); ``take`` is one Lua script.

``put`` returns the handles it displaced (the one it overwrote, and in memory any LRU-evicted ones)
so the router can tell their D to free the blocks now; expired handles are never returned (D has
reaped or will reap them on its own TTL).
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import orjson

if TYPE_CHECKING:
    import redis.asyncio

__all__ = [
    "HandleStore",
    "MemoryStore",
    "RedisStore",
    "StoreKey",
    "StoredHandle",
    "Taken",
    "make_store",
]

log = logging.getLogger("agentkv.router")

StoreKey = tuple[str, str]
"""(tenant, conversation_id)."""

_FORMAT = 1
"""Version of :meth:`StoredHandle.to_json`'s layout (router replicas of different versions may
share one Redis; a handle in a format this router does not know is treated as absent)."""

_REDIS_EXTRA_HINT = 'RedisStore needs the redis client library: pip install "agentkv[redis]"'


@dataclass(frozen=True)
class StoredHandle:
    """What the router keeps from D's final response, to verify and reuse on the next turn."""

    params: dict[str, Any]
    """D's ``kv_transfer_params``, as the router will send it to P."""
    block_hashes: list[str]
    """Hex chained hashes of the full blocks D holds (prompt + output)."""
    tail_tokens: list[int]
    """Token ids D holds after its last full block (fewer than ``block_size``)."""
    num_tokens: int
    """``remote_num_tokens``."""
    block_size: int
    epoch: int
    decode_url: str
    """Which D holds the blocks."""

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "v": _FORMAT,
                "params": self.params,
                "block_hashes": self.block_hashes,
                "tail_tokens": self.tail_tokens,
                "num_tokens": self.num_tokens,
                "block_size": self.block_size,
                "epoch": self.epoch,
                "decode_url": self.decode_url,
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> StoredHandle:
        """Parse :meth:`to_json`'s output; ``ValueError`` on anything else."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"stored handle is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("stored handle is not a JSON object")
        if obj.get("v") != _FORMAT:
            raise ValueError(f"stored handle has format {obj.get('v')!r}, expected {_FORMAT}")
        params = obj.get("params")
        if not isinstance(params, dict):
            raise ValueError("stored handle: params must be an object")
        block_hashes = obj.get("block_hashes")
        if not isinstance(block_hashes, list) or not all(isinstance(h, str) for h in block_hashes):
            raise ValueError("stored handle: block_hashes must be a list of strings")
        tail_tokens = obj.get("tail_tokens")
        if not isinstance(tail_tokens, list) or not all(_is_int(t) for t in tail_tokens):
            raise ValueError("stored handle: tail_tokens must be a list of integers")
        ints: dict[str, int] = {}
        for name in ("num_tokens", "block_size", "epoch"):
            value = obj.get(name)
            if not _is_int(value):
                raise ValueError(f"stored handle: {name} must be an integer")
            ints[name] = value
        decode_url = obj.get("decode_url")
        if not isinstance(decode_url, str):
            raise ValueError("stored handle: decode_url must be a string")
        return cls(
            params=params,
            block_hashes=block_hashes,
            tail_tokens=tail_tokens,
            num_tokens=ints["num_tokens"],
            block_size=ints["block_size"],
            epoch=ints["epoch"],
            decode_url=decode_url,
        )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Taken:
    """A handle taken from the store."""

    handle: StoredHandle
    age_s: float
    """Seconds since it was stored (the store's clock: the router's, or Redis's)."""


class HandleStore(Protocol):
    """Where the router keeps one transfer handle per (tenant, conversation id)."""

    async def put(self, key: StoreKey, handle: StoredHandle, ttl_s: float) -> list[StoredHandle]:
        """Store ``handle`` under ``key`` for ``ttl_s`` seconds, replacing any handle there.

        Returns the live handles this displaced: the overwritten one and any evicted to stay within
        the store's bound, so the router can release their KV on D early. Expired handles are not
        returned (D reaps them itself)."""
        ...

    async def take(self, key: StoreKey) -> Taken | None:
        """Atomically get and delete; ``None`` if absent or expired. A handle is taken once."""
        ...

    async def delete(self, key: StoreKey) -> StoredHandle | None:
        """Remove and return the live handle under ``key``, if any."""
        ...

    async def drop_decode(self, decode_url: str) -> int:
        """Drop every handle held by ``decode_url`` (a D that died); how many were dropped."""
        ...

    async def size(self) -> int:
        """How many live handles the store holds."""
        ...

    async def aclose(self) -> None: ...


def _check_ttl(ttl_s: float) -> None:
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError(f"ttl_s must be a positive finite number of seconds, got {ttl_s!r}")


# --------------------------------------------------------------------------------------------
# In memory


@dataclass
class _Entry:
    handle: StoredHandle
    stored_at: float
    expires_at: float
    seq: int


class MemoryStore:
    """One router process's store: LRU-bounded to ``max_entries`` and TTL'd on ``clock``.

    ``put`` and ``take`` count as uses for the LRU order (``take`` removes the entry, so in practice
    the least recently *stored* handle goes first). Expired entries are purged on ``put`` and
    ``size`` (through a heap of expiry times, so a purge costs only what it removes) and ignored
    wherever they are met. The methods never await, so each is atomic within one event loop.
    """

    def __init__(
        self, *, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[StoreKey, _Entry] = OrderedDict()
        self._by_decode: dict[str, set[StoreKey]] = {}
        # (expires_at, seq, key); an item is stale once its key holds another seq or nothing.
        self._expiry: list[tuple[float, int, StoreKey]] = []
        self._seq = 0

    @property
    def max_entries(self) -> int:
        return self._max_entries

    async def put(self, key: StoreKey, handle: StoredHandle, ttl_s: float) -> list[StoredHandle]:
        _check_ttl(ttl_s)
        now = self._clock()
        self._purge(now)
        displaced: list[StoredHandle] = []
        old = self._remove(key)
        if old is not None:  # live: _purge just removed every expired entry
            displaced.append(old.handle)
        self._seq += 1
        entry = _Entry(handle, stored_at=now, expires_at=now + ttl_s, seq=self._seq)
        self._entries[key] = entry
        self._by_decode.setdefault(handle.decode_url, set()).add(key)
        heapq.heappush(self._expiry, (entry.expires_at, entry.seq, key))
        while len(self._entries) > self._max_entries:
            lru_key = next(iter(self._entries))
            evicted = self._remove(lru_key)
            assert evicted is not None
            displaced.append(evicted.handle)
        self._compact()
        return displaced

    async def take(self, key: StoreKey) -> Taken | None:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._remove(key)
        if now >= entry.expires_at:
            return None
        return Taken(entry.handle, age_s=max(0.0, now - entry.stored_at))

    async def delete(self, key: StoreKey) -> StoredHandle | None:
        now = self._clock()
        entry = self._remove(key)
        if entry is None or now >= entry.expires_at:
            return None
        return entry.handle

    async def drop_decode(self, decode_url: str) -> int:
        now = self._clock()
        dropped = 0
        for key in list(self._by_decode.get(decode_url, ())):
            entry = self._remove(key)
            if entry is not None and now < entry.expires_at:
                dropped += 1
        return dropped

    async def size(self) -> int:
        self._purge(self._clock())
        return len(self._entries)

    async def aclose(self) -> None:
        self._entries.clear()
        self._by_decode.clear()
        self._expiry.clear()

    def _remove(self, key: StoreKey) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            keys = self._by_decode.get(entry.handle.decode_url)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_decode[entry.handle.decode_url]
        return entry

    def _purge(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.seq == seq:
                self._remove(key)

    def _compact(self) -> None:
        """Keep the expiry heap proportional to the live entries (taken and overwritten entries
        leave stale items behind until their expiry time)."""
        if len(self._expiry) > 2 * len(self._entries) + 1024:
            self._expiry = [(e.expires_at, e.seq, k) for k, e in self._entries.items()]
            heapq.heapify(self._expiry)


# --------------------------------------------------------------------------------------------
# Redis

# Atomic get-and-delete that also reports the remaining TTL (ms): the basis of take() and delete().
# GET + PTTL + DEL rather than GETDEL so the TTL is read in the same atomic step. A missing or
# expired key returns nil (Redis expires keys on access, by its own clock).
_TAKE_LUA = """
local v = redis.call('GET', KEYS[1])
if not v then return false end
local ttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
return {v, ttl}
"""

# Compare-and-delete, per key: delete KEYS[i] only if it still holds ARGV[i] (drop_decode must not
# drop a handle that another replica has just stored for another D under the same key).
_DROP_IF_UNCHANGED_LUA = """
local n = 0
for i, k in ipairs(KEYS) do
  if redis.call('GET', k) == ARGV[i] then
    redis.call('DEL', k)
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
    return b"%d " % ttl_ms + handle.to_json()


def _unpack(raw: bytes | str) -> tuple[int, StoredHandle] | None:
    """``(ttl_ms, handle)``, or ``None`` (logged) for a value this router cannot read."""
    data = _as_bytes(raw)
    head, sep, body = data.partition(b" ")
    try:
        if not sep or not head.isdigit():
            raise ValueError("stored value lacks its '<ttl_ms> ' header")
        return int(head), StoredHandle.from_json(body)
    except ValueError as e:
        log.warning("ignoring an unreadable handle in Redis: %s", e)
        return None


class RedisStore:
    """Several router replicas' shared store, on Redis >= 6.2.

    Layout: key ``f"{prefix}h:{tenant}:{conversation_id}"`` (``%`` and ``:`` in the parts escaped
    as ``%25`` and ``%3A``), value ``b"<ttl_ms> " + StoredHandle.to_json()``, expiry ``PX ttl_ms``.
    The stored ttl and the key's ``PTTL`` give a handle's age on Redis's clock, which all replicas
    share.

    - ``put``: ``SET key value PX ttl GET``, one command, returns the handle it overwrote (an
      expired one reads as absent). No LRU: bound memory with Redis's ``maxmemory`` and a
      ``volatile-*`` eviction policy (every key here has a TTL); an evicted handle's blocks are
      freed by D's own TTL.
    - ``take``/``delete``: one Lua script (GET, PTTL, DEL), atomic on the server, so of any number
      of replicas racing on one key exactly one gets the handle.
    - ``drop_decode``: ``SCAN MATCH {prefix}h:* COUNT 1000`` (no index to keep in sync, never blocks
      Redis; a D dying is rare, so the O(keys) walk is fine), then a compare-and-delete script per
      batch so a handle re-stored for another D in the meantime is kept.
    - ``size``: the same SCAN walk, counting.

    ``client``: an existing ``redis.asyncio.Redis`` (then ``url`` is not used and ``aclose`` leaves
    the client open); otherwise one is made from ``url`` and closed by ``aclose``.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "agentkv:",
        client: redis.asyncio.Redis | None = None,
    ) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError as e:
            raise ImportError(_REDIS_EXTRA_HINT) from e
        self._prefix = prefix
        self._owns_client = client is None
        self._client: redis.asyncio.Redis = (
            aioredis.Redis.from_url(url) if client is None else client
        )
        self._take_script = self._client.register_script(_TAKE_LUA)
        self._drop_script = self._client.register_script(_DROP_IF_UNCHANGED_LUA)

    @property
    def client(self) -> redis.asyncio.Redis:
        return self._client

    def key(self, key: StoreKey) -> str:
        """The Redis key under which ``key``'s handle lives."""
        tenant, conversation_id = key
        return f"{self._prefix}h:{_escape_part(tenant)}:{_escape_part(conversation_id)}"

    async def put(self, key: StoreKey, handle: StoredHandle, ttl_s: float) -> list[StoredHandle]:
        _check_ttl(ttl_s)
        ttl_ms = max(1, round(ttl_s * 1000))
        old = await self._client.set(self.key(key), _pack(handle, ttl_ms), px=ttl_ms, get=True)
        if not isinstance(old, (bytes, str)):
            return []
        unpacked = _unpack(old)
        return [] if unpacked is None else [unpacked[1]]

    async def take(self, key: StoreKey) -> Taken | None:
        got = await self._take(key)
        if got is None:
            return None
        raw, pttl_ms = got
        unpacked = _unpack(raw)
        if unpacked is None:
            return None
        ttl_ms, handle = unpacked
        # PTTL is -1 for a key without expiry (never written so by this store): age unknown, 0.
        age_ms = ttl_ms - pttl_ms if pttl_ms >= 0 else 0
        return Taken(handle, age_s=max(0, age_ms) / 1000)

    async def delete(self, key: StoreKey) -> StoredHandle | None:
        got = await self._take(key)
        if got is None:
            return None
        unpacked = _unpack(got[0])
        return None if unpacked is None else unpacked[1]

    async def drop_decode(self, decode_url: str) -> int:
        dropped = 0
        async for keys in self._scan():
            values = await self._client.mget(keys)
            doomed_keys: list[bytes] = []
            doomed_values: list[bytes] = []
            for k, raw in zip(keys, values, strict=True):
                if raw is None:
                    continue
                unpacked = _unpack(raw)
                if unpacked is not None and unpacked[1].decode_url == decode_url:
                    doomed_keys.append(k)
                    doomed_values.append(_as_bytes(raw))
            if doomed_keys:
                dropped += int(await self._drop_script(keys=doomed_keys, args=doomed_values))
        return dropped

    async def size(self) -> int:
        seen: set[bytes] = set()
        async for keys in self._scan():
            seen.update(keys)
        return len(seen)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _take(self, key: StoreKey) -> tuple[bytes | str, int] | None:
        got = await self._take_script(keys=[self.key(key)])
        if got is None:
            return None
        raw, pttl_ms = got
        return raw, int(pttl_ms)

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


def make_store(
    url: str | None = None,
    *,
    max_entries: int = 100_000,
    clock: Callable[[], float] = time.monotonic,
    prefix: str = "agentkv:",
) -> HandleStore:
    """The store a router configuration names: ``None`` or ``"memory"`` for a :class:`MemoryStore`
    (``max_entries``, ``clock``), a ``redis://``, ``rediss://`` or ``unix://`` URL for a
    :class:`RedisStore` (``prefix``; Redis bounds itself, so ``max_entries`` does not apply)."""
    if url is None or url == "memory":
        return MemoryStore(max_entries=max_entries, clock=clock)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, prefix=prefix)
    raise ValueError(f"unknown handle store {url!r}: use 'memory' or a redis:// URL")
