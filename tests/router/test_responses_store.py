"""The memory store of responses (``previous_response_id``): per tenant, bounded by count and
bytes (least recently used out first), expiring after its TTL."""

from __future__ import annotations

import asyncio
from typing import Any

from agentkv.router.responses_store import MemoryResponses, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(text: str = "x", conversation: str | None = "c") -> StoredResponse:
    return StoredResponse([{"role": "user", "content": text}], conversation, {"id": text})


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_tenants_never_see_each_others_responses() -> None:
    store = MemoryResponses(ttl_s=60, max_per_tenant=10, max_bytes_per_tenant=1 << 20)
    run(store.put("a", "resp_1", stored("mine")))
    assert run(store.get("b", "resp_1")) is None
    assert run(store.delete("b", "resp_1")) is False
    got = run(store.get("a", "resp_1"))
    assert got == stored("mine")
    assert run(store.delete("a", "resp_1")) is True and run(store.get("a", "resp_1")) is None


def test_least_recently_used_go_first_per_tenant() -> None:
    store = MemoryResponses(ttl_s=60, max_per_tenant=2, max_bytes_per_tenant=1 << 20)
    run(store.put("a", "r1", stored("1")))
    run(store.put("a", "r2", stored("2")))
    run(store.put("b", "r1", stored("b1")))
    assert run(store.get("a", "r1")) is not None  # r1 used: r2 is now the oldest
    run(store.put("a", "r3", stored("3")))
    assert run(store.get("a", "r2")) is None
    assert run(store.get("a", "r1")) is not None and run(store.get("a", "r3")) is not None
    assert run(store.get("b", "r1")) is not None  # another tenant's bound is its own
    assert len(store) == 3


def test_byte_budget_and_ttl() -> None:
    clock = Clock()
    one = len(stored("1").to_json())
    store = MemoryResponses(
        ttl_s=10, max_per_tenant=100, max_bytes_per_tenant=2 * one + 1, clock=clock
    )
    for i in range(3):
        run(store.put("a", f"r{i}", stored(str(i))))
    assert run(store.get("a", "r0")) is None and run(store.get("a", "r2")) is not None
    run(store.put("a", "big", stored("y" * (3 * one))))  # beyond the whole budget: not kept
    assert run(store.get("a", "big")) is None and run(store.get("a", "r2")) is not None
    clock.now = 10.5
    assert run(store.get("a", "r2")) is None
    run(store.put("a", "r9", stored("9")))
    assert len(store) == 1  # the expired ones were swept
