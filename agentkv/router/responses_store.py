"""Stored responses of the Responses API, for ``previous_response_id``.

A stored response is what its successor continues from: the chain's items so far (every earlier
input and output item, then this request's input and this response's output), the conversation
id its turns used (so the chain's later turns find their KV), and the response object itself
(``GET /v1/responses/{id}``). Keys are (tenant, response id): a tenant never reads another
tenant's responses, whatever id it sends. A request with ``store: false`` stores nothing.

Two backends, as the handle store's:

- :class:`MemoryResponses`: per tenant, least recently used first out beyond
  ``max_per_tenant`` responses or ``max_bytes_per_tenant`` bytes, each expiring after ``ttl_s``.
- :class:`RedisResponses`: the handle store's Redis client, one key per response
  ``f"{prefix}r:{tenant}:{response_id}"`` (``%`` and ``:`` escaped), expiring after ``ttl_s``;
  bound Redis's memory with ``maxmemory`` and a ``volatile-*`` policy, as for handles.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["MemoryResponses", "RedisResponses", "ResponseStore", "StoredResponse"]

_FORMAT = 1


@dataclass(frozen=True)
class StoredResponse:
    """One stored response."""

    items: list[dict[str, Any]]
    """The chain's items through this response's output (its successor's history)."""
    conversation_id: str | None
    """The conversation id this response's turn used (the chain's KV is stored under it)."""
    response: dict[str, Any]

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "v": _FORMAT,
                "items": self.items,
                "conversation_id": self.conversation_id,
                "response": self.response,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> StoredResponse | None:
        """None for a value of another format (as absent)."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict) or data.get("v") != _FORMAT:
            return None
        return cls(data["items"], data.get("conversation_id"), data["response"])


class ResponseStore(Protocol):
    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None: ...

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...


class MemoryResponses:
    """One router process's stored responses (methods never await: each is atomic)."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_per_tenant: int,
        max_bytes_per_tenant: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.max_per_tenant = ttl_s, max_per_tenant
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._clock = clock
        # tenant -> response id -> (expires at, the stored JSON), least recently used first
        self._tenants: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        raw = stored.to_json()
        entries = self._tenants.setdefault(tenant, OrderedDict())
        self._drop(tenant, response_id)
        if len(raw) > self.max_bytes_per_tenant:
            return  # larger than the whole budget: not kept (its successor gets a 404)
        entries[response_id] = (self._clock() + self.ttl_s, raw)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + len(raw)
        now = self._clock()
        for rid in [r for r, (expires, _) in entries.items() if expires <= now]:
            self._drop(tenant, rid)
        while len(entries) > self.max_per_tenant or self._bytes[tenant] > self.max_bytes_per_tenant:
            self._drop(tenant, next(iter(entries)))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        entries = self._tenants.get(tenant)
        entry = entries.get(response_id) if entries is not None else None
        if entries is None or entry is None:
            return None
        if entry[0] <= self._clock():
            self._drop(tenant, response_id)
            return None
        entries.move_to_end(response_id)
        return StoredResponse.from_json(entry[1])

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self._drop(tenant, response_id)

    def _drop(self, tenant: str, response_id: str) -> bool:
        entries = self._tenants.get(tenant)
        entry = entries.pop(response_id, None) if entries is not None else None
        if entry is None:
            return False
        self._bytes[tenant] -= len(entry[1])
        return True

    def __len__(self) -> int:
        return sum(len(e) for e in self._tenants.values())


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace(":", "%3A")


class RedisResponses:
    """Stored responses in the handle store's Redis (shared by router replicas)."""

    def __init__(self, client: redis.asyncio.Redis, *, prefix: str, ttl_s: float) -> None:
        self.client, self.prefix, self.ttl_ms = client, prefix, max(1, int(ttl_s * 1000))

    def key(self, tenant: str, response_id: str) -> str:
        return f"{self.prefix}r:{_escape(tenant)}:{_escape(response_id)}"

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        await self.client.set(self.key(tenant, response_id), stored.to_json(), px=self.ttl_ms)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self.client.get(self.key(tenant, response_id))
        if raw is None:
            return None
        return StoredResponse.from_json(raw if isinstance(raw, bytes) else str(raw).encode())

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self.client.delete(self.key(tenant, response_id)))
