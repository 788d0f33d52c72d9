"""Router-driven release of D's blocks: when a lease lapses, and when a D runs short of KV.

With leases, D can run with a long ``decoder_kv_blocks_ttl`` (1800–3600 s): the router, not D's
timer, decides when retained blocks go. Two background loops:

- **Leases**: every ``retention.lease_check_interval_s`` the conversations whose lease lapsed
  lose their handles, released at once (notify-only): batch after batch, round-robin across
  tenants, until none is left or the check has run for ``retention.lease_check_interval_s``
  (the next check goes on).
- **Pressure**: every ``upstream.health_interval_s`` the router reads each D's KV-cache usage
  (``vllm:kv_cache_usage_perc`` on its ``/metrics``); above ``retention.kv_pressure_watermark``
  it releases that D's oldest stored handles, a tenth of them per check (at least one), so
  retention never starves running requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from agentkv.protocol import Metric
from agentkv.protocol.promtext import samples
from agentkv.router.config import RouterConfig
from agentkv.router.guard import GuardedStore
from agentkv.router.http import TransportError
from agentkv.router.leases import Leases
from agentkv.router.metrics import RouterMetrics
from agentkv.router.store import StoredHandle, StoreKey
from agentkv.router.tasks import TaskSet
from agentkv.router.upstream import Upstream

__all__ = ["LeasesUnavailable", "Refused", "Retention", "kv_usage"]

log = logging.getLogger("agentkv.router")

Release = Callable[[StoredHandle, str], Awaitable[None]]

REAP_BATCH = 1000
"""Lapsed leases taken from the lease store at a time."""
HELD_CHECKS = 64
"""Store look-ups a lease call makes at once."""


@dataclass(frozen=True)
class Refused:
    """Why a lease call did not renew a conversation's lease: an HTTP status and a message."""

    status: int
    message: str


class LeasesUnavailable(Exception):
    """The handle store or the lease store failed: nothing can be said about the leases."""


def kv_usage(metrics_text: str) -> float | None:
    """The largest ``vllm:kv_cache_usage_perc`` sample in a Prometheus text page (0-1); None
    when there is none or its lines are not Prometheus text. Only that gauge's lines are
    parsed: the whole of a vLLM page would hold the event loop some 15 ms."""
    name = Metric.KV_CACHE_USAGE_PERC
    lines = [line for line in metrics_text.splitlines() if line.startswith(name)]
    try:
        values = [s.value for s in samples("\n".join(lines) + "\n") if s.name == name]
    except ValueError:
        return None
    return max(values, default=None)


class Retention:
    """The two loops of one router (see the module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        store: GuardedStore,
        leases: Leases,
        decode: list[Upstream],
        release: Release,
        metrics: RouterMetrics,
    ) -> None:
        self.config, self.store, self.leases = config, store, leases
        self.decode, self.release, self.metrics = decode, release, metrics
        self._tasks = TaskSet()

    def start(self) -> None:
        self._tasks.spawn(self._leases_forever())
        if self.config.retention.kv_pressure_watermark is not None:
            for engine in self.decode:
                self._tasks.spawn(self._pressure_forever(engine))

    async def aclose(self) -> None:
        await self._tasks.cancel()

    async def renew(self, key: StoreKey, seconds: float) -> float:
        """A turn's ``X-AgentKV-Lease``: start or renew the conversation's lease (the turn makes
        its handle), capped at the router's TTL; the seconds granted (0 when the tenant is at
        ``retention.max_leases_per_tenant``: the turn is served, its KV keeps D's TTL)."""
        granted = min(seconds, self.config.router_ttl_s)
        try:
            [ok] = await self.leases.renew(
                key[0], [key[1]], granted, limit=self.config.retention.max_leases_per_tenant
            )
        except Exception as exc:  # a lease is a hint: a failure costs early release, no more
            log.warning("lease renewal failed: %s", exc)
            return granted
        return granted if ok else 0.0

    async def renew_held(
        self, tenant: str, conversations: Sequence[str], seconds: float
    ) -> tuple[float, list[Refused | None]]:
        """A lease call: renew the leases of those of ``conversations`` that have a stored
        handle; the seconds granted and, per conversation, None (renewed) or why not: 404 (no
        stored handle: nothing to hold; a lease it holds is not extended and lapses on its own)
        or 429 (a new lease past ``retention.max_leases_per_tenant``).

        Raises :class:`LeasesUnavailable` when the handle store or the lease store fails."""
        granted = min(seconds, self.config.router_ttl_s)
        held: list[bool] = []
        for i in range(0, len(conversations), HELD_CHECKS):
            chunk = conversations[i : i + HELD_CHECKS]
            found = await asyncio.gather(*(self.store.candidates((tenant, c)) for c in chunk))
            held += [bool(f) for f in found]
        if not self.store.healthy:
            raise LeasesUnavailable("The handle store is unavailable: leases cannot be renewed.")
        keep = [c for c, h in zip(conversations, held, strict=True) if h]
        limit = self.config.retention.max_leases_per_tenant
        try:
            renewed = iter(await self.leases.renew(tenant, keep, granted, limit=limit))
        except Exception as exc:
            log.warning("lease renewal failed: %s", exc)
            raise LeasesUnavailable("The lease store is unavailable.") from exc
        out: list[Refused | None] = []
        for conversation, h in zip(conversations, held, strict=True):
            if not h:
                out.append(
                    Refused(
                        404,
                        f"No stored KV for conversation {conversation!r}: "
                        "nothing to hold (a turn with X-AgentKV-Lease starts a lease).",
                    )
                )
            elif not next(renewed):
                out.append(
                    Refused(
                        429,
                        f"This tenant holds {limit} leases "
                        "(retention.max_leases_per_tenant): close conversations or let leases "
                        "lapse before leasing more.",
                    )
                )
            else:
                out.append(None)
        return granted, out

    async def drop(self, key: StoreKey) -> None:
        with contextlib.suppress(Exception):
            await self.leases.drop(key)

    async def reap_leases(self, budget_s: float | None = None) -> int:
        """Release the handles of the conversations whose lease lapsed, batch after batch
        (round-robin across tenants, yielding between batches) until none is left or
        ``budget_s`` (default ``retention.lease_check_interval_s``) has passed; how many handles."""
        budget = self.config.retention.lease_check_interval_s if budget_s is None else budget_s
        deadline = time.monotonic() + budget
        released = lapsed = 0
        while True:
            try:
                keys = await self.leases.lapsed(REAP_BATCH)
            except Exception as exc:
                log.warning("reading leases failed: %s", exc)
                break
            lapsed += len(keys)
            for key in keys:
                for handle in await self.store.delete(key):
                    await self.release(handle, "lease")
                    released += 1
            if len(keys) < REAP_BATCH or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0)
        if released:
            log.info("released %d handles of %d lapsed leases", released, lapsed)
        with contextlib.suppress(Exception):
            self.metrics.leases.set(await self.leases.size())
        return released

    async def relieve(self, engine: Upstream) -> int:
        """One pressure check of one D; how many handles were released."""
        try:
            r = await engine.health.get("/metrics", timeout=5)
        except TransportError:
            return 0
        usage = kv_usage(r.body.decode("utf-8", "replace")) if r.status == 200 else None
        watermark = self.config.retention.kv_pressure_watermark
        if usage is None or watermark is None or usage < watermark:
            return 0
        doomed = await self.store.take_oldest(engine.url, 0.1)
        for handle in doomed:
            await self.release(handle, "pressure")
        if doomed:
            log.info(
                "decode %s at %.0f%% KV: released its %d oldest handles",
                engine.url,
                usage * 100,
                len(doomed),
            )
        return len(doomed)

    async def _leases_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.retention.lease_check_interval_s)
            try:
                await self.reap_leases()
            except Exception:  # a bug (store failures are misses): logged, the loop goes on
                log.exception("releasing the handles of lapsed leases failed")

    async def _pressure_forever(self, engine: Upstream) -> None:
        while True:
            await asyncio.sleep(self.config.upstream.health_interval_s)
            with contextlib.suppress(Exception):
                await self.relieve(engine)
