"""Router-driven release of D's blocks: when a lease lapses, and when a D runs short of KV.

With leases, D can run with a long ``decoder_kv_blocks_ttl`` (1800–3600 s): the router, not D's
timer, decides when retained blocks go. Two background loops:

- **Leases**: every ``lease_check_interval_s`` the conversations whose lease lapsed lose their
  handles, released at once (notify-only).
- **Pressure**: every ``health_interval_s`` the router reads each D's KV-cache usage
  (``vllm:kv_cache_usage_perc`` on its ``/metrics``); above ``kv_pressure_watermark`` it releases
  that D's oldest stored handles, a tenth of them per check (at least one), so retention never
  starves running requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from agentkv.protocol import Metric
from agentkv.router.config import RouterConfig
from agentkv.router.guard import GuardedStore
from agentkv.router.http import TransportError
from agentkv.router.leases import Leases
from agentkv.router.metrics import RouterMetrics
from agentkv.router.store import StoredHandle, StoreKey
from agentkv.router.tasks import cancel_and_wait
from agentkv.router.upstream import Upstream

__all__ = ["Retention", "kv_usage"]

log = logging.getLogger("agentkv.router")

Release = Callable[[StoredHandle, str], Awaitable[None]]


def kv_usage(metrics_text: str) -> float | None:
    """The largest ``vllm:kv_cache_usage_perc`` sample in a Prometheus text page (0-1)."""
    name = Metric.KV_CACHE_USAGE_PERC
    best: float | None = None
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            best = value if best is None else max(best, value)
    return best


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
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._leases_forever())]
        if self.config.kv_pressure_watermark is not None:
            self._tasks += [asyncio.create_task(self._pressure_forever(e)) for e in self.decode]

    async def aclose(self) -> None:
        await cancel_and_wait(self._tasks)

    async def renew(self, key: StoreKey, seconds: float) -> float:
        """Start or renew a lease (capped at the router's TTL); the seconds granted."""
        granted = min(seconds, self.config.router_ttl_s)
        try:
            await self.leases.renew(key, granted)
        except Exception as exc:  # a lease is a hint: a failure costs early release, no more
            log.warning("lease renewal failed: %s", exc)
        return granted

    async def drop(self, key: StoreKey) -> None:
        with contextlib.suppress(Exception):
            await self.leases.drop(key)

    async def reap_leases(self) -> int:
        """Release the handles of every conversation whose lease lapsed; how many handles."""
        try:
            keys = await self.leases.lapsed()
        except Exception as exc:
            log.warning("reading leases failed: %s", exc)
            return 0
        released = 0
        for key in keys:
            for handle in await self.store.delete(key):
                await self.release(handle, "lease")
                released += 1
        if released:
            log.info("released %d handles of %d lapsed leases", released, len(keys))
        return released

    async def relieve(self, engine: Upstream) -> int:
        """One pressure check of one D; how many handles were released."""
        try:
            r = await engine.health.get("/metrics", timeout=5)
        except TransportError:
            return 0
        usage = kv_usage(r.text) if r.status_code == 200 else None
        watermark = self.config.kv_pressure_watermark
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
            await asyncio.sleep(self.config.lease_check_interval_s)
            await self.reap_leases()

    async def _pressure_forever(self, engine: Upstream) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            with contextlib.suppress(Exception):
                await self.relieve(engine)
