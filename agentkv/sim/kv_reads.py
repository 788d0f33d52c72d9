"""The reader's side of the NixlConnector: read a remote handle's blocks into new local ones
(end-trimmed), or only notify; decline a read near the handle's expiry (on the owner's clock,
learnt at handshake); a failed read follows ``kv_load_failure_policy``."""

from __future__ import annotations

import math
from typing import Any

from agentkv.protocol import kv_transfer as kvt
from agentkv.protocol.errors import APIError
from agentkv.sim.blocks import Block, KVContent
from agentkv.sim.engine_state import EngineState
from agentkv.sim.requests import Running
from agentkv.sim.transfer import TransferError

__all__ = ["EXPIRY_SAFETY_MARGIN_S", "KVReads"]

EXPIRY_SAFETY_MARGIN_S = 5.0
"""vLLM's ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` (``nixl/pull_worker.py``)."""


class KVReads(EngineState):
    """Reads of remote KV (the connector's worker side)."""

    async def _read_remote(
        self,
        params: dict[str, Any],
        new_blocks: list[Block],
        local: int,
        want: int,
        *,
        from_decode: bool,
        state: Running,
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
        self, state: Running, decision: str = "failed"
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


def _truncate(held: KVContent | None, taken: int) -> KVContent | None:
    if held is None:
        return None
    return KVContent(held.parent, held.start, held.tokens[:taken])
