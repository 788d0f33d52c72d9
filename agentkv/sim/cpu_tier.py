"""D's CPU tier: the KV that vLLM's ``OffloadingConnector`` copies to host memory.

Shaped like vLLM 0.33's ``CPUOffloadingManager`` (``v1/kv_offload/cpu/manager.py``) with its
default ``lru`` policy, one block per chunk:

* blocks are keyed by the same chained hash as the GPU prefix cache, so a lookup is a prefix
  match that continues where the GPU hit stops;
* a save offers a sequence's full blocks; a block already held is only touched (moved to the
  most-recent end); a new one evicts the least recently used when the tier is full;
* a save is best effort: in vLLM ``prepare_store`` returns ``None`` and the scheduler skips the
  store when it cannot evict; here each new block's save fails with ``failure_rate`` (seeded),
  and a failed block is simply not in the tier;
* a load touches the blocks it reads;
* what it stores and evicts is reported (:class:`SaveResult`) for the KV events vLLM publishes
  with ``medium: "CPU"`` (:meth:`agentkv.sim.blocks.BlockPool.offloaded`);
* a touch runs from a sequence's last block to its first (vLLM's ``LRUOffloadingManager.touch``
  walks ``reversed(block_hashes)``), so the first blocks are the most recently used and
  eviction eats a sequence's tail: what stays is still a usable prefix.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentkv.sim.blocks import KVContent, leading_run

__all__ = ["CpuTier", "SaveResult", "check_tier"]


def check_tier(capacity: int, failure_rate: float) -> None:
    """Refuse a tier of no block or a save failure rate that is not a probability (this tier and
    the retention plan's model of it, :class:`agentkv.bench.cpu_tier.RunLru`)."""
    if capacity < 1:
        raise ValueError("a CPU tier holds at least one block")
    if not 0.0 <= failure_rate <= 1.0:
        raise ValueError("the save failure rate must be within [0, 1]")


@dataclass(frozen=True)
class SaveResult:
    saved: int
    """Blocks newly stored."""
    failed: int
    """Blocks whose save failed (not stored)."""
    evicted: int
    """Blocks evicted to make room."""
    stored: tuple[int, ...] = field(default=(), repr=False)
    """The offered positions (``hashes[i]``) newly stored, in order."""
    evicted_hashes: tuple[bytes, ...] = field(default=(), repr=False)
    """The blocks evicted, oldest first."""


class CpuTier:
    """``capacity`` blocks of offloaded KV, least recently used evicted first."""

    def __init__(self, capacity: int, *, failure_rate: float = 0.0, seed: int = 0) -> None:
        check_tier(capacity, failure_rate)
        self.capacity = capacity
        self.failure_rate = failure_rate
        self._rng = random.Random(seed)
        self._blocks: OrderedDict[bytes, KVContent] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def lookup(self, hashes: Sequence[bytes]) -> list[KVContent]:
        """The contents of the longest run of ``hashes`` (from the first) the tier holds; the
        blocks found become the most recently used."""
        found = leading_run(self._blocks, hashes)
        self._touch(hashes[: len(found)])
        return found

    def _touch(self, hashes: Sequence[bytes]) -> None:
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def save(self, hashes: Sequence[bytes], contents: Sequence[KVContent | None]) -> SaveResult:
        """Offer full blocks ``hashes[i]`` holding ``contents[i]`` (a block without content, or
        whose content is not full, is skipped)."""
        saved = failed = evicted = 0
        stored: list[int] = []
        gone: list[bytes] = []
        for i, (h, content) in enumerate(zip(hashes, contents, strict=False)):
            if content is None:
                continue
            if h in self._blocks:
                continue
            if self.failure_rate and self._rng.random() < self.failure_rate:
                failed += 1
                continue
            if len(self._blocks) >= self.capacity:
                gone.append(self._blocks.popitem(last=False)[0])
                evicted += 1
            self._blocks[h] = content
            stored.append(i)
            saved += 1
        self._touch(hashes)
        return SaveResult(saved, failed, evicted, tuple(stored), tuple(gone))

    def clear(self) -> None:
        self._blocks.clear()
