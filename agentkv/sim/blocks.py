"""A paged KV block pool with prefix caching, shaped like vLLM v1's ``BlockPool``.

* Block 0 is the null block (never handed out), as in vLLM: real block ids start at 1.
* Full blocks are cached under a chained hash: ``hash(parent_hash, block_tokens)``; the root
  hash carries the request's ``cache_salt``.
* Freed blocks go to the back of an LRU free queue (a request's blocks in reverse order, so its
  tail is evicted first); allocation takes from the front and evicts the block's cache entry.
* With ``kv_events`` the pool queues vLLM's KV cache events as its ``BlockPool`` does
  (``kv_event_queue``, :meth:`BlockPool.take_events`): ``BlockStored`` when full blocks enter
  the prefix cache, ``BlockRemoved`` when a cached block is evicted, ``AllBlocksCleared`` on
  :meth:`BlockPool.reset_prefix_cache`.
* Every block also remembers **what its KV was computed for** (:class:`KVContent`: the tokens,
  their start position and the hash of everything before them). That is the simulator's ground
  truth: a request whose blocks hold KV for other tokens or positions ran on wrong KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from agentkv.protocol.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_block_hash,
)

__all__ = [
    "Block",
    "BlockPool",
    "KVContent",
    "NoFreeBlocksError",
    "block_hashes",
    "count_wrong_tokens",
    "leading_run",
    "root_hash",
]

V = TypeVar("V")


def root_hash(cache_salt: str | None = None) -> bytes:
    """The parent hash of a sequence's first block."""
    return hashlib.sha256(b"agentkv-root\0" + (cache_salt or "").encode()).digest()


def leading_run(table: Mapping[bytes, V], hashes: Iterable[bytes]) -> list[V]:
    """What ``table`` holds for the longest run of ``hashes`` from the first (a prefix match: the
    run stops at the first hash it does not hold)."""
    run: list[V] = []
    for h in hashes:
        value = table.get(h)
        if value is None:
            break
        run.append(value)
    return run


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, cache_salt: str | None = None
) -> list[bytes]:
    """Chained hashes of every *full* block of ``token_ids``."""
    hashes: list[bytes] = []
    parent = root_hash(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class KVContent:
    """What a block's KV was computed for: ``tokens`` at ``start``, after context ``parent``."""

    parent: bytes
    start: int
    tokens: tuple[int, ...]

    def to_wire(self) -> dict[str, object]:
        return {"parent": self.parent.hex(), "start": self.start, "tokens": list(self.tokens)}

    @classmethod
    def from_wire(cls, data: dict[str, object]) -> KVContent:
        tokens = data["tokens"]
        start = data["start"]
        parent = data["parent"]
        if not isinstance(tokens, list) or not isinstance(start, int):
            raise ValueError("malformed block content")
        if not isinstance(parent, str):
            raise ValueError("malformed block content")
        return cls(bytes.fromhex(parent), start, tuple(int(t) for t in tokens))


def contents_for(
    token_ids: Sequence[int], block_size: int, first_block: int, num_blocks: int, salt: str | None
) -> list[KVContent]:
    """The true content of blocks ``first_block .. first_block+num_blocks`` of a sequence."""
    parent = root_hash(salt)
    out: list[KVContent] = []
    for index in range(first_block + num_blocks):
        start = index * block_size
        chunk = tuple(token_ids[start : start + block_size])
        if index >= first_block:
            out.append(KVContent(parent, start, chunk))
        parent = _chain(parent, chunk)
    return out


def count_wrong_tokens(
    token_ids: Sequence[int],
    contents: Sequence[KVContent | None],
    block_size: int,
    upto: int,
    salt: str | None,
) -> int:
    """How many of the first ``upto`` positions of ``token_ids`` the blocks hold wrong KV for.

    ``contents[i]`` is what block ``i`` of the request holds. A position is right when its
    block's KV was computed for the same context, the same start position and the same tokens
    up to that position; everything after the first difference in a block is wrong.
    """
    wrong = 0
    parent = root_hash(salt)
    for index, held in enumerate(contents):
        start = index * block_size
        if start >= upto:
            break
        want = token_ids[start : min(start + block_size, upto)]
        good = 0
        if held is not None and held.parent == parent and held.start == start:
            for a, b in zip(held.tokens, want, strict=False):
                if a != b:
                    break
                good += 1
        wrong += len(want) - good
        parent = _chain(parent, token_ids[start : start + block_size])
    return wrong


class NoFreeBlocksError(Exception):
    """The pool cannot satisfy an allocation right now."""


@dataclass(eq=False)
class Block:
    """One KV block."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    content: KVContent | None = None


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens (block 0 is the null block)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = True,
        kv_events: bool = False,
        int_block_hashes: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, Block] = {}
        self.kv_events = kv_events
        self.int_block_hashes = int_block_hashes
        """Hashes in events as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` says."""
        self.kv_event_queue: list[KVCacheEvent] = []

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by a request (``vllm:kv_cache_usage_perc``)."""
        return self.num_used / self.num_usable

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def get(self, block_id: int) -> Block:
        if not 0 < block_id < len(self.blocks):
            raise KeyError(block_id)
        return self.blocks[block_id]

    def longest_cached_prefix(self, hashes: Sequence[bytes]) -> list[Block]:
        """The cached blocks for the longest run of ``hashes`` from the start."""
        if not self.prefix_caching:
            return []
        return leading_run(self._cached, hashes)

    # -- mutations ---------------------------------------------------------------------------
    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache (removes them from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.pop(block.block_id, None)
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """``n`` fresh blocks from the front of the free queue, evicting their cache entries."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out: list[Block] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None and self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.kv_events:
                    self.kv_event_queue.append(
                        BlockRemoved(
                            block_hashes=[self._ext(block.block_hash)],
                            medium=MEDIUM_GPU,
                            group_idx=0,
                        )
                    )
            block.block_hash = None
            block.content = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def cache(self, block: Block, block_hash: bytes) -> bool:
        """Register a full block under ``block_hash`` (no-op without prefix caching).

        Returns True when the block became the cache entry for ``block_hash``."""
        if not self.prefix_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        return self._cached.setdefault(block_hash, block) is block

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
    ) -> None:
        """Cache a sequence's full blocks (``blocks[i]`` under ``hashes[i]``, holding tokens
        ``token_ids[i*bs:(i+1)*bs]``), and queue one ``BlockStored`` per run of newly cached
        blocks, shaped like vLLM's ``BlockPool.cache_full_blocks`` event."""
        run: list[int] = []
        for index, (block, h) in enumerate(zip(blocks, hashes, strict=False)):
            if self.cache(block, h) and self.kv_events:
                if run and run[-1] != index - 1:
                    self._stored(run, hashes, token_ids, cache_salt)
                    run = []
                run.append(index)
        if run:
            self._stored(run, hashes, token_ids, cache_salt)

    def _stored(
        self,
        run: list[int],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        bs, first = self.block_size, run[0]
        extra: list[tuple[object, ...] | None] = [
            (cache_salt,) if i == 0 and cache_salt else None for i in run
        ]
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=[self._ext(hashes[i]) for i in run],
                parent_block_hash=self._ext(hashes[first - 1]) if first else None,
                token_ids=list(token_ids[first * bs : (run[-1] + 1) * bs]),
                block_size=bs,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=extra,
                group_idx=0,
            )
        )

    def offloaded(
        self,
        stored: Sequence[int],
        evicted: Sequence[bytes],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
    ) -> None:
        """Queue the CPU tier's evictions and stores as vLLM 0.33's OffloadingConnector
        publishes them with ``self_describing_kv_events`` (``offloading/events.py``): one
        ``BlockRemoved`` for the evicted blocks, one ``BlockStored`` per stored block (one
        block per chunk) with its parent's hash, its tokens and no ``extra_keys``, all with
        ``medium: "CPU"``. ``stored``: positions in ``hashes`` (blocks of ``token_ids``)."""
        if not self.kv_events:
            return
        bs = self.block_size
        if evicted:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[self._ext(h) for h in evicted], medium=MEDIUM_CPU, group_idx=0
                )
            )
        for i in stored:
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=[self._ext(hashes[i])],
                    parent_block_hash=self._ext(hashes[i - 1]) if i else None,
                    token_ids=list(token_ids[i * bs : (i + 1) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_CPU,
                    lora_name=None,
                    group_idx=0,
                )
            )

    def _ext(self, block_hash: bytes) -> int | bytes:
        return external_block_hash(block_hash, as_int=self.int_block_hashes)

    def take_events(self) -> list[KVCacheEvent]:
        """The queued KV cache events, oldest first (the queue is emptied)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block; unreferenced blocks join the free queue tail-first."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                # The KV stays in place (``content``) until the block is allocated again.
                self._free[block.block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks keep their references)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.kv_events:
            self.kv_event_queue.append(AllBlocksCleared())
