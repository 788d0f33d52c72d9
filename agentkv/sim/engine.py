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
NIXL. Steps 1–4 are :mod:`agentkv.sim.prefill` (reads: :mod:`agentkv.sim.kv_reads`), what an
instance holds for readers is :mod:`agentkv.sim.engine_state`, step 5 is here.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from agentkv.protocol import kv_transfer as kvt
from agentkv.protocol.errors import APIError
from agentkv.sim.blocks import block_hashes
from agentkv.sim.engine_state import Retained
from agentkv.sim.prefill import Prefill
from agentkv.sim.requests import Finished, GenRequest, Running, Scheduled

__all__ = ["Engine"]


class Engine(Prefill):
    """The engine core of one instance (no HTTP here)."""

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
        state = Running()
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

    def _finish(
        self, req: GenRequest, state: Running, scheduled: Scheduled, out: list[int], finish: str
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
                self.retained[req.request_id] = Retained(
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
