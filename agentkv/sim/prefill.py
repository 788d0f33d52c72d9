"""The prefill step: local prefix hit, the connector's decision (pull from P, read back from
D, recompute under the threshold, notify), the CPU tier, the reads, the local compute and its
accounting (metrics, the prefill queue, the slowdown prefills cause running decodes)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from agentkv.protocol import kv_transfer as kvt
from agentkv.sim.blocks import (
    Block,
    KVContent,
    block_hashes,
    contents_for,
    count_wrong_tokens,
)
from agentkv.sim.kv_reads import KVReads
from agentkv.sim.requests import GenRequest, Running, Scheduled

__all__ = ["Prefill"]


class Prefill(KVReads):
    """What happens before a request's first token."""

    async def _prefill(self, req: GenRequest, state: Running) -> Scheduled:
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
