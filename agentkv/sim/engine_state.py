"""An engine's blocks and what it holds: the block pool, the blocks finished requests retain
for remote readers (the owner's side of the NIXL protocol: handshake, reads, notifications, the
TTL and lease reaper), waiting for free blocks, and the gauges. :class:`EngineState` holds every
field of the engine; :class:`agentkv.sim.engine.Engine` builds on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.protocol.errors import APIError
from agentkv.sim.blocks import Block, BlockPool, NoFreeBlocksError
from agentkv.sim.clock import Clock
from agentkv.sim.config import SimConfig
from agentkv.sim.costmodel import CostModel
from agentkv.sim.cpu_tier import CpuTier
from agentkv.sim.kv_events import ZmqEventPublisher, int_block_hashes
from agentkv.sim.metrics import SimMetrics
from agentkv.sim.requests import Running
from agentkv.sim.transfer import TransferClient

__all__ = ["EngineState", "Retained"]


@dataclass
class Retained:
    """Blocks a finished request keeps for a remote reader."""

    blocks: list[Block]
    since: float
    expires_at: float
    for_next_turn: bool


class EngineState:
    """The state of one instance's engine core, its lifecycle and the owner's side of reads."""

    def __init__(
        self,
        config: SimConfig,
        *,
        cost: CostModel,
        metrics: SimMetrics,
        clock: Clock,
        transfer: TransferClient,
        vocab_size: int,
    ) -> None:
        self.config = config
        self.cost = cost
        self.metrics = metrics
        self.clock = clock
        self.transfer = transfer
        self.vocab_size = vocab_size
        events = config.kv_events_config
        self.kv_events: ZmqEventPublisher | None = None
        if events is not None and events.active:
            self.kv_events = ZmqEventPublisher(events, host=config.host)
        self.pool = BlockPool(
            config.num_blocks,
            config.block_size,
            prefix_caching=config.prefix_caching,
            kv_events=self.kv_events is not None,
            int_block_hashes=int_block_hashes(),
        )
        self.retained: dict[str, Retained] = {}
        self.cpu: CpuTier | None = None
        if config.cpu_offload_blocks:
            self.cpu = CpuTier(
                config.cpu_offload_blocks,
                failure_rate=config.cpu_save_failure_rate,
                seed=config.seed,
            )
        self._prefill_in_flight = 0
        self._prefill_free_at = 0.0
        """When (this clock) the prefills computing or queued here are done."""
        self._prefill_started = 0
        """Prompt tokens of every prefill started so far (a step also pays for a prefill that
        started and ended within the step before it: vLLM would have scheduled it in this one)."""
        self._clock_offsets: dict[str, float] = {}
        self._blocks_freed = asyncio.Condition()
        self._shutdown = asyncio.Event()
        self._running = 0
        self._waiting = 0
        self.metrics.blocks_total.set(self.pool.num_usable)
        self._update_gauges()

    # -- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release requests parked forever (hung reads) so the server can stop."""
        self._shutdown.set()

    def close(self) -> None:
        """Stop the KV event publisher (after :meth:`shutdown`)."""
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def publish_events(self) -> None:
        """Publish the pool's queued KV cache events as one batch (vLLM: once per scheduler
        step); a no-op without ``kv_events_config``."""
        if self.kv_events is not None:
            self.kv_events.publish(self.pool.take_events())

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache``: forget every cached hash (``AllBlocksCleared``)."""
        self.pool.reset_prefix_cache()
        self.publish_events()

    async def reap_forever(self, interval_s: float = 0.25) -> None:
        """Free retained blocks whose TTL or lease has passed (vLLM's
        ``_reap_expired_send_leases``)."""
        while not self._shutdown.is_set():
            await self.reap()
            await asyncio.sleep(interval_s)

    async def reap(self) -> int:
        now = self.clock.now()
        expired = [rid for rid, r in self.retained.items() if r.expires_at <= now]
        for rid in expired:
            self.metrics.nixl_expired.inc()
            self._release(rid, now)
        if expired:
            await self._notify_blocks_freed()
        return len(expired)

    # -- remote side (the owner of retained blocks) ------------------------------------------
    def handshake(self) -> dict[str, Any]:
        """What a reader learns at handshake: our engine id and our clock (for the offset)."""
        return {"engine_id": self.config.engine_id, "now": self.clock.now()}

    def serve_read(self, request_id: str, block_ids: Sequence[int]) -> list[dict[str, Any] | None]:
        """A reader pulls ``block_ids`` of ``request_id``; the read notifies and frees them.

        Raises ``KeyError`` when the request holds no blocks any more (already read, released
        or expired) — unless ``compat == "0.32"``, where the read goes through on whatever the
        blocks hold now (measured on vLLM 0.32: D only logs an error).
        """
        known = request_id in self.retained
        if not known:
            self.metrics.nixl_notif_after_expiry.inc()
            if self.config.compat != "0.32":
                raise KeyError(request_id)
        out: list[dict[str, Any] | None] = []
        for block_id in block_ids:
            content = self.pool.get(block_id).content
            out.append(None if content is None else content.to_wire())
        if known:
            self._release(request_id, self.clock.now())
        return out

    def serve_notify(self, request_id: str) -> bool:
        """A reader says it is done (or needs nothing): free the blocks now."""
        if request_id not in self.retained:
            self.metrics.nixl_notif_after_expiry.inc()
            return False
        self._release(request_id, self.clock.now())
        return True

    def _release(self, request_id: str, now: float) -> None:
        held = self.retained.pop(request_id)
        if held.for_next_turn:
            self.metrics.retained_block_seconds.inc(len(held.blocks) * max(0.0, now - held.since))
        self.pool.free(held.blocks)
        self._update_gauges()

    async def _notify_blocks_freed(self) -> None:
        async with self._blocks_freed:
            self._blocks_freed.notify_all()

    async def _allocate(self, n: int) -> list[Block]:
        while True:
            try:
                return self.pool.allocate(n)
            except NoFreeBlocksError:
                if self._shutdown.is_set():
                    raise APIError(503, "The engine is shutting down.") from None
                async with self._blocks_freed:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._blocks_freed.wait(), timeout=0.25)
                await self.reap()

    async def _hang(self, state: Running) -> None:
        """Park the request forever, its blocks leaked (until the server stops)."""
        self.pool.touch(state.blocks)  # an extra reference nobody drops: a leak
        await self._shutdown.wait()
        raise APIError(503, "The engine is shutting down.")

    def _update_gauges(self) -> None:
        self.metrics.kv_usage.set(self.pool.usage)
        self.metrics.blocks_used.set(self.pool.num_used)
        self.metrics.running.set(self._running)
        self.metrics.waiting.set(self._waiting)
        next_turn = [r for r in self.retained.values() if r.for_next_turn]
        self.metrics.retained_requests.set(len(next_turn))
        self.metrics.retained_blocks.set(sum(len(r.blocks) for r in next_turn))
