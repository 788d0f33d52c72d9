"""One simulated vLLM engine: prefix cache, NixlConnector P/D protocol, generation timing.

A request goes through the same steps as in vLLM 0.33 (``reference/vllm-protocol.md`` §2.6):

1. **Local prefix hit** ``L``: the longest run of cached full blocks, capped below the prompt
   length (vLLM always computes at least the last prompt token).
2. **Connector** (``get_num_new_matched_tokens``), driven by the request's
   ``kv_transfer_params``:
   * P's handle (D reading P's prompt KV): pull ``N − L`` tokens;
   * D's complete handle (P reading D's retained KV, bidirectional):
     ``M = max(0, min(C, N) − L)``; ``0 < M < kv_recompute_threshold`` → recompute.
     Whatever the count, a bidirectional P then reads or only notifies, so the owner frees the
     handle's blocks (single use).
3. **Allocate** the missing blocks; **read** the remote blocks into the first new ones, the
   remote list end-trimmed to their count (``base_worker._apply_prefix_caching``). The read is
   declined when the handle is near its expiry (``now + 5 s ≥ expiry − clock offset``).
   A failed or declined read follows ``kv_load_failure_policy``: ``fail`` → HTTP 500,
   ``recompute`` → compute everything locally.
4. **Compute** the rest, cache full blocks under the prompt's hashes (so a wrong read poisons
   the prefix cache exactly as it does in vLLM), and count prompt positions whose block holds
   KV computed for other tokens or positions (``agentkv_sim_wrong_kv_tokens``).
5. **Generate** token by token; at the end (``request_finished``) a P request keeps its blocks
   for the reader under ``kv_lease_duration`` and returns its handle; a D request with
   ``bidirectional_kv_xfer`` keeps its blocks for ``decoder_kv_blocks_ttl`` and returns a handle
   with ``remote_num_tokens`` = prompt + output − 1 and an expiry on its private clock.

Transfers between simulator processes go over HTTP (:mod:`agentkv.sim.transfer`) in place of
NIXL.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.protocol import kv_transfer as kvt
from agentkv.protocol.errors import APIError
from agentkv.sim.blocks import (
    Block,
    BlockPool,
    KVContent,
    NoFreeBlocksError,
    block_hashes,
    contents_for,
    count_wrong_tokens,
)
from agentkv.sim.clock import Clock
from agentkv.sim.config import SimConfig
from agentkv.sim.costmodel import CostModel
from agentkv.sim.cpu_tier import CpuTier
from agentkv.sim.kv_events import ZmqEventPublisher, int_block_hashes
from agentkv.sim.metrics import SimMetrics
from agentkv.sim.transfer import TransferClient, TransferError

__all__ = [
    "EXPIRY_SAFETY_MARGIN_S",
    "Engine",
    "Finished",
    "GenRequest",
    "Scheduled",
]

EXPIRY_SAFETY_MARGIN_S = 5.0
"""vLLM's ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` (``nixl/pull_worker.py``)."""


@dataclass
class GenRequest:
    """What the engine needs to run one request (the HTTP layer builds it)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    """The tokens this request will emit if nothing stops it earlier (decided by the caller)."""
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end generation with ``stop`` (the end-of-turn token)."""
    max_tokens: int | None = None
    kv_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    streaming: bool = False


@dataclass
class Scheduled:
    """What the prefill step decided; known before the first token is sent."""

    num_prompt_tokens: int
    local_hit_tokens: int
    external_tokens: int
    computed_tokens: int
    wrong_kv_tokens: int
    model_ttft_s: float
    decision: str
    """``none`` | ``pull`` | ``notify`` | ``threshold`` | ``expired`` | ``failed``."""
    cpu_tokens: int = 0
    """Loaded from this instance's CPU tier (after the GPU hit)."""

    @property
    def cached_tokens(self) -> int:
        """vLLM's ``num_cached_tokens``: local hit + external (a connector's: NIXL or the CPU
        tier)."""
        return self.local_hit_tokens + self.external_tokens + self.cpu_tokens


@dataclass
class Finished:
    """The end of a request."""

    finish_reason: str
    output_ids: list[int]
    kv_transfer_params: dict[str, Any] | None


@dataclass
class _Retained:
    """Blocks a finished request keeps for a remote reader."""

    blocks: list[Block]
    since: float
    expires_at: float
    for_next_turn: bool


@dataclass
class _Running:
    blocks: list[Block] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)


class Engine:
    """The engine core of one instance (no HTTP here)."""

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
        self.retained: dict[str, _Retained] = {}
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

    # -- requests ----------------------------------------------------------------------------
    def validate(self, req: GenRequest) -> None:
        """The checks vLLM makes before scheduling (HTTP 400 on failure)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise APIError(400, "The prompt must contain at least one token.", param="prompt")
        for t in req.prompt_ids:
            if not 0 <= t < self.vocab_size:
                raise APIError(400, f"Token id {t} is out of vocabulary", param="prompt")
        limit = self.config.max_model_len
        if n > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {n} input tokens, which exceeds this limit even without any output "
                "tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        if req.max_tokens is not None and n + req.max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{req.max_tokens} output tokens and your prompt contains {n} input tokens, for "
                f"a total of {n + req.max_tokens} tokens. Please reduce the length of the input "
                "prompt or the number of requested output tokens.",
                param="max_tokens",
            )
        if math.ceil(n / self.config.block_size) > self.pool.num_usable:
            raise APIError(400, "The prompt does not fit in the KV cache.", param="prompt")

    async def run(self, req: GenRequest) -> AsyncIterator[Scheduled | int | Finished]:
        """Run ``req``: yields one :class:`Scheduled`, then each output token id as it is
        sampled, then one :class:`Finished`. Raises :class:`APIError` before the first
        yield on failure. Closing the iterator early aborts the request and frees its blocks."""
        self.validate(req)
        self._waiting += 1
        self._update_gauges()
        state = _Running()
        try:
            scheduled = await self._prefill(req, state)
        except BaseException:
            self._waiting -= 1
            self.pool.free(state.blocks)
            self._update_gauges()
            await self._notify_blocks_freed()
            raise
        self._waiting -= 1
        self._running += 1
        self._update_gauges()
        finished: Finished | None = None
        n = len(req.prompt_ids)
        bs = self.config.block_size
        limit = req.max_tokens if req.max_tokens is not None else self.config.max_model_len - n
        out: list[int] = []
        seen = self._prefill_started
        try:
            yield scheduled
            finish = "length"
            for token in req.output_ids:
                if len(out) >= limit:
                    break
                if out:
                    extra = self._slowdown(self._prefill_started - seen)
                    seen = self._prefill_started
                    step = self.cost.decode_s(1, n + len(out)) + extra
                    self.metrics.inter_token.observe(step)
                    await self.clock.sleep(step)
                # This step computes the previous token's KV: it may need a new block.
                if n + len(out) > len(state.blocks) * bs:
                    state.blocks.extend(await self._allocate(1))
                    self.publish_events()  # the allocation may have evicted a cached block
                out.append(token)
                self.metrics.generation_tokens.inc()
                yield token
                if token in req.stop_ids:
                    finish = "stop"
                    break
            else:
                finish = "stop" if len(out) < limit else "length"
            finished = self._finish(req, state, scheduled, out, finish)
            yield finished
        finally:
            self._running -= 1
            if finished is None:
                self.metrics.success["abort"].inc()
                self.pool.free(state.blocks)
                state.blocks = []
            self._update_gauges()
            await self._notify_blocks_freed()

    # -- prefill -----------------------------------------------------------------------------
    async def _prefill(self, req: GenRequest, state: _Running) -> Scheduled:
        cfg, bs = self.config, self.config.block_size
        prompt = req.prompt_ids
        n = len(prompt)
        hashes = block_hashes(prompt, bs, cache_salt=req.cache_salt)
        params = req.kv_params

        hit = self.pool.longest_cached_prefix(hashes[: (n - 1) // bs])
        self.pool.touch(hit)
        state.blocks.extend(hit)
        local = len(hit) * bs
        self.metrics.prefix_cache_queries.inc(n)
        self.metrics.prefix_cache_hits.inc(local)

        # Connector: how many tokens to pull, from whom, or whom to notify.
        want = 0
        pull_from_prefill = bool(params and kvt.is_prefill_handle(params))
        pull_from_decode = (
            not pull_from_prefill and params is not None and kvt.can_read_from_decode(params)
        )
        decision = "none"
        if params is not None:
            self.metrics.external_queries.inc(n)
        if pull_from_prefill:
            assert params is not None
            want = n - local
            decision = "pull" if want > 0 else "notify"
            kvt.mark_read(params)  # only one transfer per request
        elif pull_from_decode:
            assert params is not None
            count = min(kvt.num_tokens(params), n) - local
            threshold = cfg.kv_recompute_threshold
            if count > 0 and not (threshold > 0 and count < threshold):
                want = count
                decision = "pull"
            else:
                decision = "threshold" if count > 0 else "notify"
            if not cfg.bidirectional_kv_xfer:
                # vLLM 0.33 reports the external tokens but never schedules the read
                # (pull_scheduler.update_state_after_alloc): the request waits forever.
                # Without a read to wait for, nothing happens: no notification either.
                if want > 0:
                    await self._hang(state)
                pull_from_decode = False
                decision = "none"
            kvt.mark_processed(params)

        # D's CPU tier (vLLM's OffloadingConnector): the blocks after the GPU hit, when no
        # NIXL read is asked for.
        from_cpu: list[KVContent] = []
        if self.cpu is not None and not (pull_from_prefill or pull_from_decode):
            from_cpu = self.cpu.lookup(hashes[len(hit) : (n - 1) // bs])

        # Allocate the rest of the prompt's blocks (waiting for blocks like vLLM's queue).
        need = math.ceil(n / bs) - len(hit)
        new_blocks = await self._allocate(need)
        state.blocks.extend(new_blocks)
        for block, content in zip(new_blocks, from_cpu, strict=False):
            block.content = content
        cpu_tokens = len(from_cpu) * bs

        external = 0
        # A P/D turn pays the fixed overhead once, on P (the cost model's ``ttft_s``).
        model_s = 0.0 if pull_from_prefill else self.cost.overhead_s
        if pull_from_prefill or pull_from_decode:
            assert params is not None
            external, transfer_s, decision = await self._read_remote(
                params, new_blocks, local, want, from_decode=pull_from_decode, state=state
            )
            model_s += transfer_s
            if external:
                self.metrics.external_hits.inc(external)

        # Compute the rest locally and fill in what every block holds.
        cached = local + external + cpu_tokens
        self._fill_local(prompt, state.blocks, cached, req.cache_salt)
        self.pool.cache_full_blocks(state.blocks, hashes, prompt, req.cache_salt)
        self.publish_events()
        self._save_to_cpu(hashes, state.blocks, prompt)
        computed = n - cached
        model_s += self.cost.cpu_load_s(cpu_tokens)
        compute_s = self.cost.prefill_s(computed, cached)
        if pull_from_prefill:
            # D recomputes the last prompt token (``_update_waiting_for_remote_kv``).
            compute_s += self.cost.decode_s(1, n)

        wrong = count_wrong_tokens(prompt, [b.content for b in state.blocks], bs, n, req.cache_salt)
        if wrong:
            self.metrics.wrong_kv_tokens.inc(wrong)
            self.metrics.wrong_kv_requests.inc()

        self.metrics.prompt_tokens.inc(n)
        self.metrics.by_source["local_cache_hit"].inc(local)
        self.metrics.by_source["external_kv_transfer"].inc(external + cpu_tokens)
        self.metrics.by_source["local_compute"].inc(computed)
        self.metrics.prompt_tokens_cached.inc(cached)
        self.metrics.cached_device.inc(local)
        self.metrics.cached_p2p.inc(external)
        self.metrics.cached_host.inc(cpu_tokens)
        if cpu_tokens:
            self.metrics.external_hits.inc(cpu_tokens)
            self.metrics.cpu_loaded_tokens.inc(cpu_tokens)
        self.metrics.prefill_kv_computed.observe(computed)
        self._update_gauges()
        await self.clock.sleep(model_s)  # overhead, reads, CPU loads
        waited = self._queue(compute_s)
        model_s += waited
        self.metrics.ttft.observe((model_s + compute_s) * self.clock.scale)
        await self.clock.sleep(waited)
        # The prefill itself shares D's steps with the running decodes, a chunk of at most
        # ``max_num_batched_tokens`` at a time: each step of theirs is that much longer.
        in_flight = min(computed, self.config.max_num_batched_tokens)
        self._prefill_in_flight += in_flight
        self._prefill_started += in_flight
        self.metrics.prefill_in_flight.set(self._prefill_in_flight)
        try:
            await self.clock.sleep(compute_s)
        finally:
            self._prefill_in_flight -= in_flight
            self.metrics.prefill_in_flight.set(self._prefill_in_flight)
        return Scheduled(
            n, local, external, computed, wrong, model_s + compute_s, decision, cpu_tokens
        )

    def _queue(self, compute_s: float) -> float:
        """Wait for the prefills this instance computes already (one GPU's compute: they run one
        after another, in arrival order); the modelled seconds waited."""
        scale = self.clock.scale
        now = self.clock.now()
        start = max(now, self._prefill_free_at)
        self._prefill_free_at = start + compute_s * scale
        if scale <= 0 or start <= now:
            return 0.0
        waited = (start - now) / scale
        self.metrics.prefill_queue.inc(waited)
        return waited

    @property
    def prefill_tokens_in_flight(self) -> int:
        return self._prefill_in_flight

    def _slowdown(self, started: int) -> float:
        """What one decode step gains from the prefills it shares the engine with: those in
        flight, or the ``started`` tokens of prefills begun since the step before (at most one
        step's budget)."""
        tokens = min(max(self._prefill_in_flight, started), self.config.max_num_batched_tokens)
        extra = self.cost.interference_s(tokens)
        if extra:
            self.metrics.decode_slowdown.inc(extra * self.clock.scale)
            self.metrics.slowed_steps.inc()
        return extra

    def _save_to_cpu(
        self, hashes: Sequence[bytes], blocks: Sequence[Block], tokens: Sequence[int]
    ) -> None:
        """Offer a sequence's full blocks to the CPU tier (best effort), with its KV events."""
        if self.cpu is None:
            return
        result = self.cpu.save(hashes, [b.content for b in blocks[: len(hashes)]])
        self.pool.offloaded(result.stored, result.evicted_hashes, hashes, tokens)
        self.publish_events()
        self.metrics.cpu_saves.inc(result.saved)
        self.metrics.cpu_save_failures.inc(result.failed)
        self.metrics.cpu_evictions.inc(result.evicted)
        self.metrics.cpu_blocks.set(len(self.cpu))

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

    async def _hang(self, state: _Running) -> None:
        """Park the request forever, its blocks leaked (until the server stops)."""
        self.pool.touch(state.blocks)  # an extra reference nobody drops: a leak
        await self._shutdown.wait()
        raise APIError(503, "The engine is shutting down.")

    async def _read_remote(
        self,
        params: dict[str, Any],
        new_blocks: list[Block],
        local: int,
        want: int,
        *,
        from_decode: bool,
        state: _Running,
    ) -> tuple[int, float, str]:
        """Read ``want`` tokens into ``new_blocks`` (or only notify when ``want == 0``).

        Returns (tokens read, modelled transfer seconds, decision)."""
        cfg, bs = self.config, self.config.block_size
        owner = kvt.address(params)
        host, port, remote_id = owner.host, owner.port, owner.request_id
        n_read = math.ceil((local + want) / bs) - local // bs if want > 0 else 0
        remote_blocks = kvt.block_ids(params)
        if n_read == 0:
            try:
                await self.transfer.notify(host, port, remote_id)
            except TransferError:
                self.metrics.nixl_failed_notifications.inc()
            return 0, 0.0, "notify" if from_decode else "none"

        expiry = kvt.expiry_time(params)
        if from_decode and expiry is not None:
            try:
                offset = await self._clock_offset(host, port, owner.engine_id)
            except TransferError:
                return await self._read_failed(state)
            deadline = expiry - offset
            if self.clock.now() + EXPIRY_SAFETY_MARGIN_S >= deadline:
                self.metrics.nixl_expired.inc()
                if cfg.compat == "0.32":
                    await self._hang(state)  # measured on vLLM 0.32: never answers, leaks
                return await self._read_failed(state, "expired")

        # End-trim the remote list to the number of local blocks to fill.
        remote_ids = remote_blocks[-n_read:]
        if len(remote_ids) < n_read:
            self.metrics.nixl_failed_transfers.inc()
            return await self._read_failed(state)
        transfer_s = self.cost.transfer_s(want)
        try:
            contents = await self.transfer.read(host, port, remote_id, remote_ids)
        except TransferError:
            self.metrics.nixl_failed_transfers.inc()
            return await self._read_failed(state)
        self.metrics.nixl_xfer_time.observe(transfer_s * self.clock.scale)
        self.metrics.nixl_post_time.observe(0.0)
        self.metrics.nixl_bytes.observe(n_read * bs * self.cost.kv_bytes_per_token)
        self.metrics.nixl_descriptors.observe(n_read)
        upto = local + want
        for i, (block, wire) in enumerate(zip(new_blocks[:n_read], contents, strict=False)):
            start = local + i * bs
            held = KVContent.from_wire(wire) if wire is not None else None
            taken = min(bs, upto - start)
            block.content = _truncate(held, taken)
        return want, transfer_s, "pull"

    async def _read_failed(
        self, state: _Running, decision: str = "failed"
    ) -> tuple[int, float, str]:
        if self.config.kv_load_failure_policy == "fail":
            raise APIError(500, "Internal server error", param=None)
        return 0, 0.0, decision

    async def _clock_offset(self, host: str, port: int, engine_id: str) -> float:
        if engine_id not in self._clock_offsets:
            info = await self.transfer.handshake(host, port)
            self._clock_offsets[str(info["engine_id"])] = float(info["now"]) - self.clock.now()
            if engine_id not in self._clock_offsets:
                raise TransferError(f"engine {engine_id} is not at {host}:{port}")
        return self._clock_offsets[engine_id]

    def _fill_local(
        self, seq: Sequence[int], blocks: list[Block], computed_from: int, salt: str | None
    ) -> None:
        """Positions from ``computed_from`` on are computed here: their KV is the true one."""
        bs = self.config.block_size
        first = computed_from // bs
        truth = contents_for(seq, bs, first, len(blocks) - first, salt)
        for block, true in zip(blocks[first:], truth, strict=False):
            keep = computed_from - true.start  # positions already filled (by a read) in this block
            held = block.content
            if keep > 0 and held is not None:
                block.content = KVContent(
                    held.parent, held.start, held.tokens[:keep] + true.tokens[keep:]
                )
            else:
                block.content = true

    # -- finish ----------------------------------------------------------------------------
    def _finish(
        self, req: GenRequest, state: _Running, scheduled: Scheduled, out: list[int], finish: str
    ) -> Finished:
        cfg, bs = self.config, self.config.block_size
        params = req.kv_params
        computed = len(req.prompt_ids) + len(out) - 1
        seq = [*req.prompt_ids, *out]
        # Drop a block allocated only for the last sampled token (it has no KV).
        keep = max(1, math.ceil(computed / bs))
        if len(state.blocks) > keep:
            extra = state.blocks[keep:]
            del state.blocks[keep:]
            self.pool.free(extra)
        self._fill_local(seq[:computed], state.blocks, scheduled.num_prompt_tokens, req.cache_salt)
        hashes = block_hashes(seq[:computed], bs, cache_salt=req.cache_salt)
        self.pool.cache_full_blocks(state.blocks, hashes, seq[:computed], req.cache_salt)
        self.publish_events()
        self._save_to_cpu(hashes, state.blocks, seq[:computed])
        self.metrics.success[finish].inc()

        handle: dict[str, Any] | None = None
        if params:  # vLLM: ``if not params: return False, None``
            is_prefill_side = kvt.asks_for_handle(params)
            if is_prefill_side or cfg.bidirectional_kv_xfer:
                now = self.clock.now()
                ttl = cfg.kv_lease_duration if is_prefill_side else cfg.decoder_kv_blocks_ttl
                num_tokens = len(req.prompt_ids) if is_prefill_side else computed
                self.retained[req.request_id] = _Retained(
                    blocks=list(state.blocks),
                    since=now,
                    expires_at=now + ttl,
                    for_next_turn=not is_prefill_side,
                )
                handle = kvt.make_handle(
                    prefill_side=is_prefill_side,
                    block_ids=[b.block_id for b in state.blocks],
                    engine_id=cfg.engine_id,
                    request_id=req.request_id,
                    host=cfg.side_channel_host,
                    port=cfg.advertised_port,
                    num_tokens=num_tokens,
                    expiry_time=None if is_prefill_side else now + ttl,
                    cached_tokens=scheduled.cached_tokens if is_prefill_side else None,
                )
                state.blocks = []  # now owned by ``retained``
        self.pool.free(state.blocks)
        state.blocks = []
        self._update_gauges()
        return Finished(finish, out, handle)

    def _update_gauges(self) -> None:
        self.metrics.kv_usage.set(self.pool.usage)
        self.metrics.blocks_used.set(self.pool.num_used)
        self.metrics.running.set(self._running)
        self.metrics.waiting.set(self._waiting)
        next_turn = [r for r in self.retained.values() if r.for_next_turn]
        self.metrics.retained_requests.set(len(next_turn))
        self.metrics.retained_blocks.set(sum(len(r.blocks) for r in next_turn))


def _truncate(held: KVContent | None, taken: int) -> KVContent | None:
    if held is None:
        return None
    return KVContent(held.parent, held.start, held.tokens[:taken])
