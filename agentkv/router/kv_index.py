"""Know L: what each prefill instance holds in its own prefix cache, from vLLM's KV events.

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
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from agentkv.protocol.kv_events import (
    END_SEQ,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    KVEventsConfig,
    publisher_binds,
)
from agentkv.router.tasks import cancel_and_wait

__all__ = [
    "IndexStats",
    "KVEventSubscriber",
    "KVEventsConfig",
    "PrefixIndex",
    "SubscriberStats",
    "subscriber_endpoint",
]

_log = logging.getLogger(__name__)

_DIGEST_SIZE = 12  # agentkv.router.verify.chain_hashes
_UNKNOWN_SALT = "\x00unknown-salt"
_ANY_EVENT = BlockStored | BlockRemoved | AllBlocksCleared
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
            a :class:`KVEventSubscriber` starts out of sync: the subscriber decides).
    """

    def __init__(
        self,
        block_size: int,
        *,
        max_blocks: int | None = None,
        missing_salt: Literal["never", "unsalted"] = "never",
        max_orphans: int = 1024,
        in_sync: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
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
            raw = array("q", prompt_ids[first * bs : last * bs]).tobytes()
            for offset in range(0, (last - first) * width, width):
                parent = hashlib.blake2b(
                    parent + raw[offset : offset + width], digest_size=_DIGEST_SIZE
                ).digest()
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
        elif isinstance(event, AllBlocksCleared):
            self.clear()
            self.stats.clears += 1

    def clear(self) -> None:
        """Forget everything (the engine's cache was reset, or the engine restarted)."""
        self._engine.clear()
        self._blocks.clear()
        self._orphans.clear()

    def _ours(self, medium: str | None, group_idx: int | None) -> bool:
        return medium in (None, MEDIUM_GPU) and group_idx in (None, 0)

    def _store(self, ev: BlockStored) -> None:
        bs = self.block_size
        n = len(ev.block_hashes)
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
                digest = hashlib.blake2b(
                    parent_digest + raw[i * width : (i + 1) * width], digest_size=_DIGEST_SIZE
                ).digest()
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


# -- the subscriber --------------------------------------------------------------------------


@dataclass
class SubscriberStats:
    """What one :class:`KVEventSubscriber` has received."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    """Times the sequence number jumped (batches lost: ZMQ high-water mark, slow join)."""
    missed_batches: int = 0
    """Batches the jumps skipped over."""
    replayed_batches: int = 0
    unrecovered_gaps: int = 0
    """Gaps the replay socket could not fill (none configured, timed out, or too old)."""
    duplicates: int = 0
    restarts: int = 0
    """The engine's sequence started again (a new engine: the index was cleared)."""
    decode_errors: int = 0
    foreign_batches: int = 0
    """Batches of another data-parallel rank (another engine's stream): never applied."""
    unattributed_batches: int = 0
    """Live batches received while more or fewer than one publisher was connected to a bound
    subscriber (whose they were cannot be known): never applied."""
    connects: int = 0
    disconnects: int = 0
    syncs: int = 0
    """Times the index became in sync."""
    desyncs: int = 0
    """Times it stopped being in sync."""
    last_seq: int | None = None
    sync_state: str = "not started"
    """Why the index is, or is not, in sync (for logs and tests)."""


_ENDPOINT = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/]*):(?P<port>\d+)$")


def subscriber_endpoint(endpoint: str, host: str) -> tuple[str, bool]:
    """(address, bind) for a subscriber of an engine configured with ``endpoint``.

    vLLM binds wildcard, ``ipc://`` and ``inproc://`` endpoints and *connects* to any other, so
    a subscriber connects to the former (``*`` or ``::`` replaced by the engine's ``host``) and
    binds the latter (then each engine needs its own endpoint)."""
    if not publisher_binds(endpoint):
        return endpoint, True
    m = _ENDPOINT.match(endpoint)
    if m is None:
        return endpoint, False  # ipc:// or inproc://: the same address
    address = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{address}:{m.group('port')}", False


_REPLAY_INTERVAL_S = 0.05
_CONNECT_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_BIND_EVENTS = (
    zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
)


class KVEventSubscriber:
    """Receives one engine's KV events, applies them to ``index`` and keeps ``index.in_sync``.

    **When the index is in sync.** It starts out of sync: a router that starts (or restarts)
    next to a running engine does not know what the engine already holds. It becomes in sync
    when it sees the engine's cache state known, with every batch since applied:

    * the engine's first batch (sequence 0, from the live stream or a replay): the engine's
      cache was empty before it (the index is cleared and the batch applied);
    * an ``AllBlocksCleared`` (vLLM sends it only after a successful prefix-cache reset);
    * an empty answer to a replay from sequence 0: vLLM's buffer is only ever appended to, so
      an engine whose buffer is empty has published nothing since it started.

    It stays in sync while batches come one sequence number after the other (a gap is first
    filled from the replay socket). It is cleared and goes out of sync on a gap nothing fills,
    on a sequence number that goes back (a new engine), on losing the connection to the engine
    (ZMQ heartbeats find a silent peer within ``heartbeat_s`` × 5), and, for a bound
    subscriber, on any publisher connecting or disconnecting. After each connection change and
    at start (``bootstrap``) it asks the replay socket, when there is one, for everything from
    sequence 0: an engine whose buffer still starts at 0 is in sync again once that replay has
    ended (while it is arriving, and after one cut short, the index says unknown). Without a
    replay endpoint a router started next to an engine that already published stays out of
    sync until the engine restarts or its prefix cache is reset (receipts say estimated).

    **Who may publish.** When the engine binds (wildcard, ``ipc://``: vLLM's default
    ``tcp://*:5557``) the subscriber connects to the engine's address, and what arrives on that
    connection (and on the replay socket, which the engine always binds) comes from the
    engine. When the engine connects (a plain ``tcp://HOST:PORT``) the subscriber binds, and
    any process that can reach the port can connect and publish. A bound subscriber therefore
    counts the publishers connected to it and applies a live batch only while exactly one is;
    otherwise it fetches the batches from the engine's replay socket instead, or, without one,
    goes out of sync. What is left: a process that connects while the engine's own publisher
    is not connected (the engine down, or the router just started and the engine not yet
    reconnected) is taken for the engine until the engine connects. Prefer engines that bind
    (a bound subscriber says so in its log at start). Batches of another data-parallel rank are
    never applied.

    Args:
        endpoint: the engine's ``KVEventsConfig.endpoint`` (not the subscriber's): a wildcard
            one is connected to at ``host``, any other is bound here.
        topic: the engine's ``KVEventsConfig.topic``.
        index: where the events go.
        replay_endpoint: the engine's ``replay_endpoint`` (connected at ``host``); when set,
            sequence gaps are filled from it, and the index is rebuilt from the engine's buffer
            at start (``bootstrap``) and after each connection change.
        host: the engine's address, for wildcard endpoints.
        replay_timeout_s: how long to wait for a replay.
        hwm: the SUB socket's receive high-water mark.
        bind: override bind-or-connect. Needed for a config read back from
            ``GET /kv_event_sources`` of an engine started with ``tcp://*:0``: vLLM reports the
            address it bound (no wildcard left), so pass ``bind=False``.
        data_parallel_rank: the engine's rank (vLLM stamps it on each batch).
        heartbeat_s: ZMTP heartbeat interval (a peer silent for 5 intervals is disconnected).
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        index: PrefixIndex,
        *,
        replay_endpoint: str | None = None,
        host: str = "127.0.0.1",
        bootstrap: bool = True,
        replay_timeout_s: float = 1.0,
        hwm: int = 100_000,
        bind: bool | None = None,
        data_parallel_rank: int = 0,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.endpoint, self.replay_endpoint, self.host = endpoint, replay_endpoint, host
        self.topic, self.index, self.bind = topic, index, bind
        self.bootstrap = bootstrap
        self.replay_timeout_s = replay_timeout_s
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self.heartbeat_s = heartbeat_s
        self.stats = SubscriberStats()
        self._topic = topic.encode()
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._bound = False
        self._peers: set[int] = set()
        """Bound: the descriptors of the publishers connected now."""
        self._next: int | None = None
        """The sequence number that continues what was applied of the current stream."""
        self._live_last: int | None = None
        self._last_replay = float("-inf")
        self._replay_sync: str | None = None
        """During a replay: why the index will be in sync once the replay has ended (a replay
        that applied the engine's first batch is a history only when it reaches the end)."""
        self._replaying = False
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._event_decoder = msgspec.msgpack.Decoder()

    @classmethod
    def from_config(
        cls, config: KVEventsConfig, index: PrefixIndex, *, host: str = "127.0.0.1", **kw: Any
    ) -> KVEventSubscriber:
        """A subscriber for an engine started with ``--kv-events-config`` ``config`` (or as its
        ``GET /kv_event_sources`` reports it)."""
        return cls(
            config.endpoint, config.topic, index, replay_endpoint=config.replay_endpoint,
            host=host, **kw,
        )  # fmt: skip

    @property
    def in_sync(self) -> bool:
        return self.index.in_sync

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the SUB socket (bind or connect) and start receiving in the background."""
        if self._task is not None:
            return
        address, bind = subscriber_endpoint(self.endpoint, self.host)
        if self.bind is not None:
            bind = self.bind
        self._desync("started: what the engine holds already is unknown", new_stream=True)
        # A bound SUB socket was seen never to send its subscription to a PUB that connects
        # to it (libzmq 4.3.5, pyzmq 27.3, TCP and IPC alike), so a bound subscriber is an XSUB
        # that sends the subscription itself to every publisher that connects.
        sub = self._ctx.socket(zmq.XSUB if bind else zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.LINGER, 0)
        ivl = max(1, int(self.heartbeat_s * 1000))
        sub.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * ivl)
        if address.startswith("tcp://["):
            sub.setsockopt(zmq.IPV6, 1)
        monitor = sub.get_monitor_socket(_BIND_EVENTS if bind else _CONNECT_EVENTS)
        try:
            if bind:
                sub.bind(address)
            else:
                sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                sub.connect(address)
        except zmq.ZMQError:  # e.g. the address is in use: leave nothing open behind
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            raise
        if bind:
            _log.info(
                "kv events %s: the engine connects and the router binds %s, so any process "
                "that reaches it can publish; events are applied only while one publisher is "
                "connected (prefer an engine endpoint that binds: tcp://*:PORT or ipc://)",
                self.endpoint,
                address,
            )
        self._sub, self._monitor, self._bound = sub, monitor, bind
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def aclose(self) -> None:
        """Stop receiving and close the sockets."""
        await cancel_and_wait((self._task,))
        self._task = None
        if self._sub is not None:
            if self._monitor is not None:
                self._sub.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sub.close(linger=0)
            self._sub = None

    async def __aenter__(self) -> KVEventSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the sync state ----------------------------------------------------------------------
    def _desync(self, reason: str, *, new_stream: bool) -> None:
        """Out of sync, and empty: what the engine holds is unknown from here."""
        if self.index.in_sync:
            self.stats.desyncs += 1
            _log.warning("kv events %s: index out of sync (%s)", self.endpoint, reason)
        self.index.in_sync = False
        self.index.clear()
        self.stats.sync_state = f"out of sync: {reason}"
        if new_stream:
            self._next = self._live_last = None

    def _synced(self, reason: str) -> None:
        if self._replaying and not self.index.in_sync:
            # Mid-replay the index holds only the batches read so far: a turn routed now would
            # be told a shorter L than the engine holds. In sync when the replay has ended.
            self._replay_sync = reason
            return
        if not self.index.in_sync:
            self.stats.syncs += 1
            _log.info("kv events %s: index in sync (%s)", self.endpoint, reason)
        self.index.in_sync = True
        self.stats.sync_state = f"in sync: {reason}"

    def _accept(self, seq: int, events: Sequence[Event]) -> None:
        """Apply batch ``seq`` of the current stream (after any gap before it was tried)."""
        if seq == 0:
            self.index.clear()  # the engine's first batch: its cache was empty before it
            self._synced("the engine's first batch")
        elif self.index.in_sync and seq != self._next:
            self._desync(f"batches before {seq} lost", new_stream=False)
        self._next = seq + 1
        self.stats.last_seq = seq
        self.stats.batches += 1
        for event in events:
            self.stats.events += 1
            self.index.apply(event)
            if isinstance(event, AllBlocksCleared):
                self._synced("the engine cleared its prefix cache")

    async def _resync(self) -> None:
        """Rebuild from the engine's replay buffer, when there is one and it is needed."""
        if self.replay_endpoint is not None and not self.index.in_sync:
            await self._replay(0)

    # -- receiving ---------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._sub is not None and self._monitor is not None
        if self.bootstrap:
            await self._resync()
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            try:
                await poller.poll()
                # Connection events first: a publisher's connection is reported before any
                # of its batches can be read, so each batch is judged by who was connected.
                await self._on_monitor()
                if not await self._sub.poll(0):
                    continue
                frames = await self._sub.recv_multipart()
            except zmq.ZMQError:
                _log.exception("kv events %s: receive failed", self.endpoint)
                await asyncio.sleep(0.1)
                continue
            try:
                await self._on_live(frames)
            except Exception:  # never let one bad message stop the subscriber
                self.stats.decode_errors += 1
                _log.exception("kv events %s: bad message", self.endpoint)

    async def _on_monitor(self) -> None:
        """Apply the pending connection events (and resync after a change)."""
        assert self._monitor is not None and self._sub is not None
        changed = False
        while await self._monitor.poll(0):
            frames = await self._monitor.recv_multipart()
            if len(frames) < 2 or len(frames[0]) != 6:
                continue
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:], "little")
            if self._bound:
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    await self._sub.send(b"\x01" + self._topic)
                elif event == zmq.EVENT_ACCEPTED:
                    self._peers.add(value)
                    self.stats.connects += 1
                    self._desync("a publisher connected", new_stream=True)
                    changed = True
                elif value in self._peers:  # disconnected or closed
                    self._peers.discard(value)
                    self.stats.disconnects += 1
                    self._desync("a publisher disconnected", new_stream=True)
                    changed = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stats.connects += 1
                changed = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                self._desync("the connection to the engine was lost", new_stream=True)
        if changed:
            await self._resync()

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != self._topic or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        events = self._decode(frames[2])
        if events is None:
            return
        if self._bound and len(self._peers) != 1:
            # Whose batch this is cannot be known: never apply it. In sync, take the engine's
            # own batches from its replay socket instead (at most one replay per
            # _REPLAY_INTERVAL_S, so a flood of such batches cannot flood the engine).
            self.stats.unattributed_batches += 1
            if not self.index.in_sync or (self._next is not None and seq < self._next):
                return
            if self.replay_endpoint is None:
                self._desync("several publishers are connected", new_stream=True)
                return
            loop = asyncio.get_running_loop()
            wait = self._last_replay + _REPLAY_INTERVAL_S - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._replay(0 if self._next is None else self._next)
            return
        live_last, self._live_last = self._live_last, seq
        if live_last is not None and seq == live_last:
            self.stats.duplicates += 1
            return
        if live_last is not None and seq < live_last:
            # The live stream only goes forward: a new engine (its cache starts empty).
            self.stats.restarts += 1
            self._desync("the engine's sequence started again", new_stream=True)
            self._live_last = seq
        nxt = self._next
        if nxt is not None and seq < nxt:
            self.stats.duplicates += 1  # already applied from a replay
            return
        expected = 0 if nxt is None else nxt
        if seq > expected:
            if nxt is not None:
                self.stats.gaps += 1
                self.stats.missed_batches += seq - nxt
            if self.replay_endpoint is not None:
                await self._replay(expected)
                if self._next is not None and seq < self._next:
                    return  # the replay brought it
            if self._next is not None and seq > self._next:
                self.stats.unrecovered_gaps += 1
        self._accept(seq, events)

    def _decode(self, payload: bytes) -> list[Event] | None:
        """The batch's events, or None when it is not this engine's (another DP rank) or not a
        batch at all."""
        try:
            batch = self._decoder.decode(payload)
            events, rank = list(batch.events), batch.data_parallel_rank
        except msgspec.DecodeError:
            try:
                events, rank = self._decode_loosely(payload)
            except msgspec.DecodeError:
                self.stats.decode_errors += 1
                return None
        if rank is not None and rank != self.data_parallel_rank:
            self.stats.foreign_batches += 1
            return None
        return events

    def _decode_loosely(self, payload: bytes) -> tuple[list[Event], int | None]:
        """Not 0.33's exact shape (a newer vLLM?): take the events we know, skip the rest."""
        raw = self._event_decoder.decode(payload)
        if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
            self.stats.decode_errors += 1
            return [], None
        rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
        out: list[Event] = []
        for item in raw[1]:
            try:
                out.append(msgspec.convert(item, _ANY_EVENT))
            except msgspec.ValidationError:
                self.stats.decode_errors += 1
        return out, rank

    async def _replay(self, start_seq: int) -> None:
        """Ask the replay socket for batches from ``start_seq`` on and apply the new ones."""
        assert self.replay_endpoint is not None
        address, _ = subscriber_endpoint(self.replay_endpoint, self.host)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        buffered = 0
        self._last_replay = asyncio.get_running_loop().time()
        self._replaying, self._replay_sync = True, None
        ended = False
        try:
            sock.connect(address)
            await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.replay_timeout_s
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await sock.poll(left * 1000):
                    _log.warning("kv events %s: replay timed out", self.endpoint)
                    return
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    self.stats.decode_errors += 1
                    continue
                _, topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    ended = True
                    break
                if topic != self._topic:
                    continue
                buffered += 1
                seq = int.from_bytes(seq_bytes, "big")
                if self._next is not None and seq < self._next:
                    continue
                events = self._decode(payload)
                if events is None:
                    continue
                if self._next is not None and seq > self._next:
                    self.stats.unrecovered_gaps += 1  # older batches left the buffer
                    self._replay_sync = None  # a hole: what came before it is not a history
                self.stats.replayed_batches += 1
                self._accept(seq, events)
        except zmq.ZMQError:
            _log.exception("kv events %s: replay failed", self.endpoint)
            return
        finally:
            sock.close(linger=0)
            self._replaying = False
            pending, self._replay_sync = self._replay_sync, None
            if not ended and pending is not None:
                # Cut short: what was applied is a start of the history, not all of it.
                self._desync("the replay did not reach its end", new_stream=True)
        if pending is not None and not self.index.in_sync:
            self._synced(pending)
        if start_seq == 0 and buffered == 0:
            # vLLM's buffer is only appended to: an empty one means nothing was published since
            # the engine started, so its cache is empty (batches applied before came from an
            # earlier engine).
            if self._next is not None:
                self._desync("the engine's buffer is empty: a new engine", new_stream=True)
            self.index.clear()
            self._next = 0
            self._synced("the engine has published nothing yet")
