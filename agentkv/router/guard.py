"""A handle store that never fails a turn: its failures become misses, behind a circuit breaker.

The handle store is an accelerator. When it fails (Redis down, restarting, too slow, read-only
after a failover, out of memory: :data:`STORE_FAILURES`), a turn loses its reuse, never its
answer: reads return nothing, writes are dropped (the caller releases what it could not store),
and after ``failures_to_open`` consecutive failures the breaker opens for ``open_s`` seconds,
during which the store is not called at all (a dead Redis is not hammered and turns do not wait
on its timeouts). Then one call is let through to probe it (half-open).

Any other exception is a bug, not an outage: it propagates (the request fails with a 500 and a
logged traceback) instead of passing for a miss, and does not count towards the breaker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agentkv.router.store import HandleStore, StoredHandle, StoreKey, Taken

__all__ = ["STORE_FAILURES", "GuardedStore"]

log = logging.getLogger("agentkv.router")
T = TypeVar("T")


def _store_failures() -> tuple[type[Exception], ...]:
    failures: tuple[type[Exception], ...] = (OSError, asyncio.TimeoutError)
    try:
        from redis.exceptions import (
            ConnectionError,
            OutOfMemoryError,
            ReadOnlyError,
            TimeoutError,
        )
    except ImportError:  # no redis library: no Redis store
        return failures
    return (*failures, ConnectionError, TimeoutError, ReadOnlyError, OutOfMemoryError)


STORE_FAILURES = _store_failures()
"""What a store raises when it fails rather than when the router has a bug: ``OSError`` (sockets;
asyncio's timeouts) and, with the redis library installed, Redis's connection errors (refused,
reset, loading, authentication), timeouts, and the refusals of a server that is up but cannot
write (``READONLY``: a replica after a failover; ``OOM``: ``maxmemory`` with no eviction)."""


class GuardedStore:
    """Wraps a :class:`HandleStore`; see the module docstring."""

    def __init__(
        self,
        inner: HandleStore,
        *,
        failures_to_open: int = 3,
        open_s: float = 2.0,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner, self._on_error, self._clock = inner, on_error, clock
        self._failures_to_open, self._open_s = failures_to_open, open_s
        self._failures = 0
        self._open_until = 0.0

    @property
    def healthy(self) -> bool:
        """False while the breaker is open or the last call failed."""
        return self._failures == 0

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]], fallback: T) -> T:
        if self._failures >= self._failures_to_open and self._clock() < self._open_until:
            if self._on_error is not None:
                self._on_error("open")
            return fallback
        try:
            result = await fn()
        except STORE_FAILURES as exc:
            self._failures += 1
            if self._failures >= self._failures_to_open:
                self._open_until = self._clock() + self._open_s
            if self._on_error is not None:
                self._on_error(op)
            log.warning("handle store %s failed (%s): degrading to recompute", op, exc)
            return fallback
        if self._failures:
            log.info("handle store back after %d failed calls", self._failures)
        self._failures = 0
        return result

    async def put(
        self, key: StoreKey, handle: StoredHandle, ttl_s: float, *, age_s: float = 0.0
    ) -> list[StoredHandle]:
        """As :meth:`HandleStore.put`; the handle itself comes back among the displaced ones
        when the store did not take it (so the router releases it instead of leaking it)."""
        return await self._call(
            "put", lambda: self.inner.put(key, handle, ttl_s, age_s=age_s), [handle]
        )

    async def candidates(self, key: StoreKey) -> list[Taken]:
        return await self._call("candidates", lambda: self.inner.candidates(key), [])

    async def take(self, key: StoreKey, handle_id: str | None = None) -> Taken | None:
        return await self._call("take", lambda: self.inner.take(key, handle_id), None)

    async def delete(self, key: StoreKey) -> list[StoredHandle]:
        return await self._call("delete", lambda: self.inner.delete(key), [])

    async def drop_decode(self, decode_url: str, *, except_engine_id: str | None = None) -> int:
        return await self._call(
            "drop_decode",
            lambda: self.inner.drop_decode(decode_url, except_engine_id=except_engine_id),
            0,
        )

    async def take_oldest(self, decode_url: str, fraction: float) -> list[StoredHandle]:
        return await self._call(
            "take_oldest", lambda: self.inner.take_oldest(decode_url, fraction), []
        )

    async def size(self) -> int | None:
        """Live handles, or ``None`` when the store cannot say."""
        result: int | None = await self._call("size", self.inner.size, None)
        return result

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        except STORE_FAILURES as exc:
            log.warning("closing the handle store failed: %s", exc)
