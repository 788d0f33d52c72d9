"""Know what an engine holds, from vLLM's KV events: each P's prefix cache (L), each D's CPU tier.

vLLM 0.33 publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` over ZMQ when
started with ``--kv-events-config`` (wire format: :mod:`agentkv.protocol.kv_events`,
``docs/simulator.md`` §"KV cache events"). :class:`KVEventSubscriber` receives one engine's
stream and feeds a :class:`PrefixIndex`; :meth:`PrefixIndex.local_prefix_tokens` answers "how
many leading tokens of this prompt would P find in its prefix cache", block-aligned and capped
like vLLM's own lookup (at most ``(n - 1) // block_size`` blocks: the last prompt token is
always computed).

The index never keeps vLLM's block hashes as its lookup key. Each stored block is re-keyed by
the router's own chained hash (:func:`agentkv.router.verify.chain_hashes`: blake2b over int64
blocks), computed from the event's token ids and its parent's router hash, so a lookup is one
hash and one dict probe per block and stops at the first miss. vLLM's hash maps to the router
hash only to apply removals and to chain children.

**Salts.** vLLM puts ``cache_salt`` into the first block's hash only; 0.33's ``BlockStored``
reports it untagged in ``extra_keys[0]`` (after the LoRA name, if any). The index files every
block under a *namespace*: the root block's salt (and LoRA name), inherited by its descendants
through the parent chain. A block counts for a prompt only under the prompt's own namespace, so
a block stored under one salt never counts as L for another. Roots whose salt cannot be known
(an event without ``extra_keys``, as older vLLMs send) never count unless the index is told that
the deployment uses no salts (``missing_salt="unsalted"``). Blocks whose hash depends on more
than tokens and salt (multimodal inputs, prompt embeddings, lookahead tokens) never count.

**In sync, or no answer.** A receipt that claims L must not rest on a partial view, so the
index answers only while it is *in sync*: it has applied every batch the engine published since
a point where the engine's cache was known (its first batch, sequence 0; an
``AllBlocksCleared``; or an empty replay buffer, which means the engine has published nothing
since it started), with no gap it could not fill, and without losing the connection to that
engine since. Otherwise :meth:`PrefixIndex.local_prefix_tokens` returns None (L unknown: the
receipt says estimated). :class:`KVEventSubscriber` keeps that state; see its docstring for the
transitions and for who may publish.

Within sync, events are still asynchronous: an event P has not sent yet misstates L for a
moment, never a read (every read of D's KV is verified by token ids).

**D's CPU tier** (``medium="CPU"``). The same mechanism indexes one medium per index: a P's GPU
prefix cache (``medium="GPU"``, the default) or a D's CPU tier. vLLM 0.33's OffloadingConnector
publishes its stores and evictions as ``BlockStored`` / ``BlockRemoved`` with ``medium: "CPU"``
and the engine's own block hashes (``distributed/kv_transfer/kv_connector/v1/offloading/
events.py`` lines 384–467). They carry token ids, parent hash and block size only with
``kv_connector_extra_config.self_describing_kv_events: true`` (default false: a placeholder with
no tokens and ``block_size`` 0, lines 352–382, which never counts), and no ``extra_keys``
("Deferred", lines 95 and 346): a CPU root block's salt is taken from the GPU ``BlockStored``
of the same engine hash (the block was computed on the GPU before it was offloaded), so a CPU
index also notes the namespace of the GPU roots it sees. ``AllBlocksCleared`` (a prefix-cache
reset, GPU only: ``v1/core/block_pool.py`` line 908) leaves a CPU index as it is. What a CPU
index says is used to send a turn to that D, never to read anything: D's engine looks its CPU
tier up by its own hashes, and the receipt states what D reported loading.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentkv.protocol.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventsConfig,
)

__all__ = ["Event", "IndexStats", "KVEventsConfig", "PrefixIndex", "chained"]

_DIGEST_SIZE = 12  # agentkv.router.verify.chain_hashes
_HASH = hashlib.blake2b(digest_size=_DIGEST_SIZE)
"""The blank state every chained block hash is copied from (never updated itself): a copy
costs less than a state made from its parameters."""


def chained(parent: bytes, block: bytes | memoryview) -> bytes:
    """The chained hash of a block (int64 ids) after the block whose hash is ``parent``."""
    h = _HASH.copy()
    h.update(parent)
    h.update(block)
    return h.digest()


_UNKNOWN_SALT = "\x00unknown-salt"
Event = BlockStored | BlockRemoved | AllBlocksCleared


def _namespace(cache_salt: str | None, lora_name: str | None) -> str:
    """What a root block's hash depends on besides tokens (vLLM: ``cache_salt`` if truthy)."""
    salt = cache_salt or ""
    return salt if lora_name is None else f"{salt}\x00lora\x00{lora_name}"


class _Namespaces(set[str]):
    """Several namespaces under one router hash (the same tokens under several salts)."""


@dataclass
class IndexStats:
    """What one :class:`PrefixIndex` has applied."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    skipped_events: int = 0
    """Events for another block size, KV cache group or medium, or malformed ones."""
    root_hints: int = 0
    """A CPU index: GPU root blocks whose namespace it noted (for the CPU copies of them)."""
    uncountable_blocks: int = 0
    """Blocks whose hash depends on more than tokens and salt (they never count)."""
    orphans_dropped: int = 0
    """Stored blocks dropped because their parent never arrived."""
    evicted_blocks: int = 0
    """Entries aged out by ``max_blocks``."""


class PrefixIndex:
    """One engine's prefix cache as seen through its KV events.

    Args:
        block_size: the engine's ``--block-size``; events for other sizes are skipped.
        max_blocks: keep at most this many blocks (oldest stored first out); set it to the
            engine's number of KV blocks to bound the damage of lost ``BlockRemoved`` events.
        missing_salt: roots without ``extra_keys``: ``never`` count (default) or count as
            unsalted (only where no request carries a ``cache_salt``).
        max_orphans: stored events kept while waiting for their parent (late or reordered).
        in_sync: whether the index starts knowing everything the engine holds (an index fed by
            a :class:`~agentkv.router.kv_subscriber.KVEventSubscriber` starts out of sync: the
            subscriber decides).
        medium: what the index holds: ``GPU`` (the prefix cache; events without a medium count
            as GPU) or ``CPU`` (an OffloadingConnector's CPU tier).
        max_root_hints: a CPU index keeps the namespaces of at most this many GPU root blocks.
    """

    def __init__(
        self,
        block_size: int,
        *,
        max_blocks: int | None = None,
        missing_salt: Literal["never", "unsalted"] = "never",
        max_orphans: int = 1024,
        in_sync: bool = False,
        medium: Literal["GPU", "CPU"] = "GPU",
        max_root_hints: int = 65536,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.medium = medium
        self.max_root_hints = max_root_hints
        self.in_sync = in_sync
        """True while the index holds everything the engine does (up to events in flight);
        while False every lookup answers None (unknown)."""
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.missing_salt = missing_salt
        self.max_orphans = max_orphans
        self.stats = IndexStats()
        # engine hash -> (router digest or None when the block never counts, namespace)
        self._engine: OrderedDict[ExternalBlockHash, tuple[bytes | None, str]] = OrderedDict()
        # router digest -> namespace(s) holding it
        self._blocks: dict[bytes, str | _Namespaces] = {}
        # parent engine hash -> stored events waiting for it
        self._orphans: OrderedDict[ExternalBlockHash, list[BlockStored]] = OrderedDict()
        # a CPU index: GPU root engine hash -> its namespace (None: it never counts)
        self._roots: OrderedDict[ExternalBlockHash, str | None] = OrderedDict()

    def __len__(self) -> int:
        """Blocks that can count for some prompt."""
        return sum(1 if isinstance(v, str) else len(v) for v in self._blocks.values())

    # -- queries -----------------------------------------------------------------------------
    def local_prefix_tokens(
        self,
        prompt_ids: Sequence[int],
        cache_salt: str | None = None,
        *,
        lora_name: str | None = None,
    ) -> int | None:
        """Leading tokens of ``prompt_ids`` the engine holds (block-aligned, at most
        ``(len - 1) // block_size`` blocks, like vLLM's prefix-cache lookup); None while the
        index is not in sync (unknown)."""
        if not self.in_sync:
            return None
        bs = self.block_size
        cap = (len(prompt_ids) - 1) // bs
        if cap <= 0 or not self._blocks:
            return 0
        ns = _namespace(cache_salt, lora_name)
        blocks = self._blocks
        width = 8 * bs
        hit = 0
        parent = b""
        first, chunk = 0, 8  # blocks converted to int64 at a time, doubling: a miss stops early
        while first < cap:
            last = min(cap, first + chunk)
            raw = memoryview(array("q", prompt_ids[first * bs : last * bs]).tobytes())
            for offset in range(0, (last - first) * width, width):
                parent = chained(parent, raw[offset : offset + width])
                held = blocks.get(parent)
                if held is None or (held != ns and not (type(held) is _Namespaces and ns in held)):
                    return hit * bs
                hit += 1
            first, chunk = last, min(chunk * 2, 1024)
        return hit * bs

    def local_prefix_tokens_from_hashes(
        self,
        hashes: Sequence[str],
        num_tokens: int,
        cache_salt: str | None = None,
        *,
        lora_name: str | None = None,
    ) -> int | None:
        """:meth:`local_prefix_tokens` from the prompt's :func:`~agentkv.router.verify.chain_hashes`
        (hex) when the router has them already; ``num_tokens`` is the prompt's length."""
        if not self.in_sync:
            return None
        cap = min(len(hashes), (num_tokens - 1) // self.block_size)
        ns = _namespace(cache_salt, lora_name)
        hit = 0
        for h in hashes[:cap]:
            held = self._blocks.get(bytes.fromhex(h))
            if held is None or (held != ns and not (type(held) is _Namespaces and ns in held)):
                break
            hit += 1
        return hit * self.block_size

    # -- events ------------------------------------------------------------------------------
    def apply(self, event: Event) -> None:
        """Apply one event (idempotent for stores and removals)."""
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event)
        elif isinstance(event, AllBlocksCleared) and self.medium == MEDIUM_GPU:
            self.clear()
            self.stats.clears += 1

    def clear(self) -> None:
        """Forget everything (the engine's cache was reset, or the engine restarted)."""
        self._engine.clear()
        self._blocks.clear()
        self._orphans.clear()
        self._roots.clear()

    def _ours(self, medium: str | None, group_idx: int | None) -> bool:
        mine = medium == MEDIUM_CPU if self.medium == MEDIUM_CPU else medium in (None, MEDIUM_GPU)
        return mine and group_idx in (None, 0)

    def _note_root(self, ev: BlockStored) -> None:
        """A CPU index: the namespace of a GPU root block, for its CPU copy (no extra keys)."""
        if ev.parent_block_hash is not None or not ev.block_hashes or ev.extra_keys is None:
            return
        self._roots[ev.block_hashes[0]] = self._root_namespace(ev, ev.extra_keys[0])
        self._roots.move_to_end(ev.block_hashes[0])
        self.stats.root_hints += 1
        while len(self._roots) > self.max_root_hints:
            self._roots.popitem(last=False)

    def _store(self, ev: BlockStored) -> None:
        bs = self.block_size
        n = len(ev.block_hashes)
        if self.medium == MEDIUM_CPU and ev.medium in (None, MEDIUM_GPU):
            self._note_root(ev)
        if (
            not self._ours(ev.medium, ev.group_idx)
            or ev.block_size != bs
            or len(ev.token_ids) != n * bs
            or (ev.extra_keys is not None and len(ev.extra_keys) != n)
        ):
            self.stats.skipped_events += 1
            return
        if ev.parent_block_hash is None:
            parent_digest: bytes | None = b""
            ns = ""
        else:
            known = self._engine.get(ev.parent_block_hash)
            if known is None:
                self._park(ev)
                return
            parent_digest, ns = known
        countable = ev.lookahead_token_ids is None
        raw = array("q", ev.token_ids).tobytes()
        width = 8 * bs
        for i, engine_hash in enumerate(ev.block_hashes):
            keys = None if ev.extra_keys is None else ev.extra_keys[i]
            root = i == 0 and ev.parent_block_hash is None
            if root:
                root_ns = self._root_namespace(ev, keys)
                countable = countable and root_ns is not None
                ns = root_ns or ""
            elif keys is not None and _without_lora(keys, ev.lora_name):
                countable = False  # multimodal / prompt-embeds keys: tokens do not decide
            digest: bytes | None = None
            if countable and parent_digest is not None:
                digest = chained(parent_digest, raw[i * width : (i + 1) * width])
            else:
                self.stats.uncountable_blocks += 1
            self._put(engine_hash, digest, ns)
            parent_digest = digest
            waiting = self._orphans.pop(engine_hash, None)
            if waiting:
                for child in waiting:
                    self._store(child)

    def _root_namespace(self, ev: BlockStored, keys: tuple[Any, ...] | None) -> str | None:
        """The root block's namespace, or None when it can never count."""
        if ev.extra_keys is None and ev.medium == MEDIUM_CPU and ev.block_hashes[0] in self._roots:
            return self._roots[ev.block_hashes[0]]
        if ev.extra_keys is None:
            if self.missing_salt == "unsalted" and ev.lora_name is None:
                return ""
            return _UNKNOWN_SALT
        rest = _without_lora(keys or (), ev.lora_name)
        if not rest:
            return _namespace(None, ev.lora_name)
        if len(rest) == 1 and isinstance(rest[0], str):
            return _namespace(rest[0], ev.lora_name)
        return None

    def _put(self, engine_hash: ExternalBlockHash, digest: bytes | None, ns: str) -> None:
        old = self._engine.pop(engine_hash, None)
        if old is not None and old != (digest, ns):
            self._unlink(*old)
        self._engine[engine_hash] = (digest, ns)
        if old != (digest, ns):
            self.stats.stored_blocks += 1
            if digest is not None:
                held = self._blocks.get(digest)
                if held is None:
                    self._blocks[digest] = ns
                elif isinstance(held, _Namespaces):
                    held.add(ns)
                elif held != ns:
                    self._blocks[digest] = _Namespaces((held, ns))
        if self.max_blocks is not None:
            while len(self._engine) > self.max_blocks:
                _, (d, n) = self._engine.popitem(last=False)
                self._unlink(d, n)
                self.stats.evicted_blocks += 1

    def _unlink(self, digest: bytes | None, ns: str) -> None:
        if digest is None:
            return
        held = self._blocks.get(digest)
        if held is None:
            return
        if isinstance(held, _Namespaces):
            held.discard(ns)
            if len(held) == 1:
                self._blocks[digest] = next(iter(held))
            elif not held:
                del self._blocks[digest]
        elif held == ns:
            del self._blocks[digest]

    def _park(self, ev: BlockStored) -> None:
        assert ev.parent_block_hash is not None
        self._orphans.setdefault(ev.parent_block_hash, []).append(ev)
        self._orphans.move_to_end(ev.parent_block_hash)
        while len(self._orphans) > self.max_orphans:
            _, dropped = self._orphans.popitem(last=False)
            self.stats.orphans_dropped += sum(len(e.block_hashes) for e in dropped)

    def _remove(self, ev: BlockRemoved) -> None:
        if not self._ours(ev.medium, ev.group_idx):
            self.stats.skipped_events += 1
            return
        for engine_hash in ev.block_hashes:
            old = self._engine.pop(engine_hash, None)
            self._orphans.pop(engine_hash, None)
            if old is not None:
                self._unlink(*old)
                self.stats.removed_blocks += 1


def _without_lora(keys: Sequence[Any], lora_name: str | None) -> tuple[Any, ...]:
    """A block's extra keys without the leading LoRA name (vLLM lists it first)."""
    rest = tuple(keys)
    if lora_name is not None and rest and rest[0] == lora_name:
        rest = rest[1:]
    return rest
