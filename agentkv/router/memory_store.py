"""One router process's handle store: :class:`MemoryStore`, the in-memory
:class:`~agentkv.router.store.HandleStore` (bounded per tenant and in all, TTL'd on an injectable
monotonic clock); :func:`agentkv.router.store.make_store` builds it from the configuration."""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agentkv.router.store import (
    DEFAULT_PER_CONVERSATION,
    Bound,
    OnEvict,
    StoredHandle,
    StoreKey,
    Taken,
    check_per_conversation,
    check_per_tenant,
    check_ttl,
    issued_by,
)

__all__ = ["MemoryStore"]


@dataclass
class _Entry:
    handle: StoredHandle
    stored_at: float
    expires_at: float
    seq: int


_Slot = tuple[StoreKey, str]
"""(conversation key, handle id)."""


class MemoryStore:
    """One router process's store: LRU-bounded and TTL'd on ``clock``.

    Bounds: ``max_entries`` handles in all, ``max_entries_per_tenant`` per tenant (default: no
    more than the whole), ``per_conversation`` per conversation. A tenant past its bound loses
    the oldest handle of its least recently *stored* conversation; a full store takes it from
    the tenant holding the most handles (fair share: a tenant holding no more than
    ``max_entries`` / the number of tenants in the store is never the one). Expired entries are
    purged on ``put`` and ``size`` (through a heap of expiry times, so a purge costs only what it
    removes) and ignored wherever they are met. The methods never await, so each is atomic
    within one event loop.
    """

    def __init__(
        self,
        *,
        max_entries: int = 100_000,
        max_entries_per_tenant: int | None = None,
        per_conversation: int = DEFAULT_PER_CONVERSATION,
        clock: Callable[[], float] = time.monotonic,
        on_evict: OnEvict | None = None,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        check_per_tenant(max_entries_per_tenant)
        check_per_conversation(per_conversation)
        self._max_entries = max_entries
        self._per_tenant = max_entries_per_tenant or max_entries
        self._per_conversation = per_conversation
        self.clock = clock
        """The store's monotonic clock (token identity ages on it too)."""
        self._on_evict = on_evict
        # conversation -> its handles, oldest first; per tenant, its conversations in LRU order
        self._convs: dict[StoreKey, OrderedDict[str, _Entry]] = {}
        self._tenants: dict[str, OrderedDict[StoreKey, None]] = {}
        self._tenant_count: dict[str, int] = {}
        self._count = 0
        self._by_decode: dict[str, set[_Slot]] = {}
        # (expires_at, seq, key, id); an item is stale once its slot holds another seq or nothing.
        self._expiry: list[tuple[float, int, StoreKey, str]] = []
        self._seq = 0

    @property
    def max_entries(self) -> int:
        return self._max_entries

    async def put(
        self, key: StoreKey, handle: StoredHandle, ttl_s: float, *, age_s: float = 0.0
    ) -> list[StoredHandle]:
        check_ttl(ttl_s)
        now = self.clock()
        self._purge(now)
        stored_at = now - max(0.0, age_s)
        if stored_at + ttl_s <= now:
            return []
        self._remove(key, handle.id)
        self._seq += 1
        entry = _Entry(handle, stored_at, stored_at + ttl_s, self._seq)
        conv = self._convs.get(key)
        if conv is None:
            conv = self._convs[key] = OrderedDict()
        conv[handle.id] = entry
        tenant = self._tenants.setdefault(key[0], OrderedDict())
        tenant[key] = None
        tenant.move_to_end(key)
        self._count += 1
        self._tenant_count[key[0]] = self._tenant_count.get(key[0], 0) + 1
        self._by_decode.setdefault(handle.decode_url, set()).add((key, handle.id))
        heapq.heappush(self._expiry, (entry.expires_at, entry.seq, key, handle.id))
        displaced: list[StoredHandle] = []
        while len(conv) > self._per_conversation:
            displaced.append(self._pop_oldest(key))
        while self._tenant_count[key[0]] > self._per_tenant:
            displaced.append(self._evict(key[0], "tenant"))
        while self._count > self._max_entries:
            largest = max(self._tenant_count, key=self._tenant_count.__getitem__)
            displaced.append(self._evict(largest, "store"))
        self._compact()
        return displaced

    async def candidates(self, key: StoreKey) -> list[Taken]:
        now = self.clock()
        conv = self._convs.get(key)
        if not conv:
            return []
        return [
            Taken(e.handle, age_s=max(0.0, now - e.stored_at))
            for e in reversed(conv.values())
            if now < e.expires_at
        ]

    async def take(self, key: StoreKey, handle_id: str | None = None) -> Taken | None:
        now = self.clock()
        conv = self._convs.get(key)
        if not conv:
            return None
        if handle_id is None:
            live = [i for i, e in conv.items() if now < e.expires_at]
            if not live:
                return None
            handle_id = live[-1]
        entry = self._remove(key, handle_id)
        if entry is None or now >= entry.expires_at:
            return None
        return Taken(entry.handle, age_s=max(0.0, now - entry.stored_at))

    async def delete(self, key: StoreKey) -> list[StoredHandle]:
        now = self.clock()
        conv = self._convs.get(key)
        out: list[StoredHandle] = []
        for handle_id in list(conv or ()):
            entry = self._remove(key, handle_id)
            if entry is not None and now < entry.expires_at:
                out.append(entry.handle)
        return out

    async def drop_decode(self, decode_url: str, *, except_engine_id: str | None = None) -> int:
        now = self.clock()
        dropped = 0
        for key, handle_id in list(self._by_decode.get(decode_url, ())):
            conv = self._convs.get(key)
            kept = conv.get(handle_id) if conv is not None else None
            if kept is not None and issued_by(kept.handle, except_engine_id):
                continue
            entry = self._remove(key, handle_id)
            if entry is not None and now < entry.expires_at:
                dropped += 1
        return dropped

    async def take_oldest(self, decode_url: str, fraction: float) -> list[StoredHandle]:
        now = self.clock()
        self._purge(now)
        slots = sorted(
            self._by_decode.get(decode_url, ()),
            key=lambda slot: self._convs[slot[0]][slot[1]].stored_at,
        )
        out: list[StoredHandle] = []
        for key, handle_id in slots[: max(1, int(len(slots) * fraction))] if slots else []:
            entry = self._remove(key, handle_id)
            if entry is not None:
                out.append(entry.handle)
        return out

    async def size(self) -> int:
        self._purge(self.clock())
        return self._count

    async def aclose(self) -> None:
        self._convs.clear()
        self._tenants.clear()
        self._tenant_count.clear()
        self._by_decode.clear()
        self._expiry.clear()
        self._count = 0

    def _evict(self, tenant: str, bound: Bound) -> StoredHandle:
        """Drop the oldest handle of ``tenant``'s least recently stored conversation."""
        evicted = self._pop_oldest(next(iter(self._tenants[tenant])))
        if self._on_evict is not None:
            self._on_evict(tenant, bound)
        return evicted

    def _pop_oldest(self, key: StoreKey) -> StoredHandle:
        handle_id = next(iter(self._convs[key]))
        entry = self._remove(key, handle_id)
        assert entry is not None
        return entry.handle

    def _remove(self, key: StoreKey, handle_id: str) -> _Entry | None:
        conv = self._convs.get(key)
        entry = conv.pop(handle_id, None) if conv is not None else None
        if entry is None:
            return None
        self._count -= 1
        tenant = key[0]
        self._tenant_count[tenant] -= 1
        if not self._tenant_count[tenant]:
            del self._tenant_count[tenant]
        if not conv:
            del self._convs[key]
            keys = self._tenants.get(tenant)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._tenants[tenant]
        slots = self._by_decode.get(entry.handle.decode_url)
        if slots is not None:
            slots.discard((key, handle_id))
            if not slots:
                del self._by_decode[entry.handle.decode_url]
        return entry

    def _purge(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, key, handle_id = heapq.heappop(self._expiry)
            conv = self._convs.get(key)
            entry = conv.get(handle_id) if conv is not None else None
            if entry is not None and entry.seq == seq:
                self._remove(key, handle_id)

    def _compact(self) -> None:
        """Keep the expiry heap proportional to the live entries (taken and overwritten entries
        leave stale items behind until their expiry time)."""
        if len(self._expiry) > 2 * self._count + 1024:
            self._expiry = [
                (e.expires_at, e.seq, k, i)
                for k, conv in self._convs.items()
                for i, e in conv.items()
            ]
            heapq.heapify(self._expiry)
