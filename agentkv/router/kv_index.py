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

**Events are an accelerator, never a correctness input.** A lost ``BlockStored`` makes L too
small; a lost ``BlockRemoved`` makes it too large until the block is stored again, the cache is
cleared, or the entry ages out (``max_blocks``). Either way the router only mis-estimates what
P computes itself: every read of D's KV is still verified by token ids.
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
    """

    def __init__(
        self,
        block_size: int,
        *,
        max_blocks: int | None = None,
        missing_salt: Literal["never", "unsalted"] = "never",
        max_orphans: int = 1024,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
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
    ) -> int:
        """Leading tokens of ``prompt_ids`` the engine holds (block-aligned, at most
        ``(len - 1) // block_size`` blocks, like vLLM's prefix-cache lookup)."""
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
    ) -> int:
        """:meth:`local_prefix_tokens` from the prompt's :func:`~agentkv.router.verify.chain_hashes`
        (hex) when the router has them already; ``num_tokens`` is the prompt's length."""
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
    last_seq: int | None = None


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


class KVEventSubscriber:
    """Receives one engine's KV events and applies them to ``index``.

    Args:
        endpoint: the engine's ``KVEventsConfig.endpoint`` (not the subscriber's): a wildcard
            one is connected to at ``host``, any other is bound here.
        topic: the engine's ``KVEventsConfig.topic``.
        index: where the events go.
        replay_endpoint: the engine's ``replay_endpoint`` (connected at ``host``); when set,
            sequence gaps are filled from it, and with ``bootstrap`` the index starts from the
            engine's buffered history.
        host: the engine's address, for wildcard endpoints.
        on_gap: an unrecoverable gap ``keep``\\ s the index as it is (default), or ``clear``\\ s
            it (L then only understates).
        replay_timeout_s: how long to wait for a replay.
        hwm: the SUB socket's receive high-water mark.
        bind: override bind-or-connect. Needed for a config read back from
            ``GET /kv_event_sources`` of an engine started with ``tcp://*:0``: vLLM reports the
            address it bound (no wildcard left), so pass ``bind=False``.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        index: PrefixIndex,
        *,
        replay_endpoint: str | None = None,
        host: str = "127.0.0.1",
        on_gap: Literal["keep", "clear"] = "keep",
        bootstrap: bool = True,
        replay_timeout_s: float = 1.0,
        hwm: int = 100_000,
        bind: bool | None = None,
    ) -> None:
        self.endpoint, self.replay_endpoint, self.host = endpoint, replay_endpoint, host
        self.topic, self.index, self.bind = topic, index, bind
        self.on_gap = on_gap
        self.bootstrap = bootstrap
        self.replay_timeout_s = replay_timeout_s
        self.hwm = hwm
        self.stats = SubscriberStats()
        self._topic = topic.encode()
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._subscriber_task: asyncio.Task[None] | None = None
        self._live_last: int | None = None
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

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the SUB socket (bind or connect) and start receiving in the background."""
        if self._task is not None:
            return
        address, bind = subscriber_endpoint(self.endpoint, self.host)
        if self.bind is not None:
            bind = self.bind
        # A bound SUB socket was seen never to send its subscription to a PUB that connects
        # to it (libzmq 4.3.5, pyzmq 27.3, TCP and IPC alike), so a bound subscriber is an XSUB
        # that sends the subscription itself to every publisher that connects.
        sub = self._ctx.socket(zmq.XSUB if bind else zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://["):
            sub.setsockopt(zmq.IPV6, 1)
        try:
            if bind:
                self._monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                sub.bind(address)
            else:
                sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                sub.connect(address)
        except zmq.ZMQError:  # e.g. the address is in use: leave nothing open behind
            if self._monitor is not None:
                sub.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            sub.close(linger=0)
            raise
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.endpoint}")
        if self._monitor is not None:
            self._subscriber_task = asyncio.create_task(self._subscribe_peers())

    async def _subscribe_peers(self) -> None:
        """Send the subscription to each publisher that connects to the bound XSUB socket."""
        assert self._monitor is not None and self._sub is not None
        while True:
            await self._monitor.recv_multipart()
            await self._sub.send(b"\x01" + self._topic)

    async def aclose(self) -> None:
        """Stop receiving and close the sockets."""
        await cancel_and_wait((self._task, self._subscriber_task))
        self._task = self._subscriber_task = None
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

    # -- receiving ---------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._sub is not None
        if self.replay_endpoint is not None and self.bootstrap:
            await self._replay(0)
        while True:
            try:
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

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != self._topic or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        live_last, self._live_last = self._live_last, seq
        applied = self.stats.last_seq
        if live_last is not None and seq == live_last:
            self.stats.duplicates += 1
            return
        if live_last is not None and seq < live_last:
            # The live stream only goes forward: a new engine (its cache starts empty).
            self.stats.restarts += 1
            self.index.clear()
            self.stats.last_seq = applied = None
            if seq > 0 and self.replay_endpoint is not None:
                await self._replay(0)
                applied = self.stats.last_seq
        if applied is not None and seq <= applied:
            self.stats.duplicates += 1  # already applied from a replay
            return
        if applied is not None and seq > applied + 1:
            self.stats.gaps += 1
            self.stats.missed_batches += seq - applied - 1
            if self.replay_endpoint is not None:
                await self._replay(applied + 1)
            now = self.stats.last_seq
            if now is not None and seq <= now:
                return  # the replay brought it
            if now is not None and seq > now + 1:
                self.stats.unrecovered_gaps += 1
                if self.on_gap == "clear":
                    self.index.clear()
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        self.stats.last_seq = seq
        self.stats.batches += 1
        for event in self._decode(payload):
            self.stats.events += 1
            self.index.apply(event)

    def _decode(self, payload: bytes) -> list[Event]:
        try:
            return list(self._decoder.decode(payload).events)
        except msgspec.DecodeError:
            pass
        # Not 0.33's exact shape (a newer vLLM?): take the events we know, skip the rest.
        raw = self._event_decoder.decode(payload)
        if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
            self.stats.decode_errors += 1
            return []
        out: list[Event] = []
        for item in raw[1]:
            try:
                out.append(msgspec.convert(item, _ANY_EVENT))
            except msgspec.ValidationError:
                self.stats.decode_errors += 1
        return out

    async def _replay(self, start_seq: int) -> None:
        """Ask the replay socket for batches from ``start_seq`` on and apply the new ones."""
        assert self.replay_endpoint is not None
        address, _ = subscriber_endpoint(self.replay_endpoint, self.host)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
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
                    return
                seq = int.from_bytes(seq_bytes, "big")
                applied = self.stats.last_seq
                if topic != self._topic or (applied is not None and seq <= applied):
                    continue
                if applied is not None and seq > applied + 1:
                    self.stats.unrecovered_gaps += 1  # older batches left the buffer
                    if self.on_gap == "clear":
                        self.index.clear()
                self.stats.replayed_batches += 1
                self._apply(seq, payload)
        except zmq.ZMQError:
            _log.exception("kv events %s: replay failed", self.endpoint)
        finally:
            sock.close(linger=0)
