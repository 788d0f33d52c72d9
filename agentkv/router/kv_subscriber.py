"""Receive one engine's KV events over ZMQ and keep a :class:`~agentkv.router.kv_index.PrefixIndex`
in sync with what the engine holds (:class:`KVEventSubscriber`; the index itself, and what "in
sync" means for its answers, is :mod:`agentkv.router.kv_index`'s)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from agentkv.protocol.kv_events import (
    END_SEQ,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
)
from agentkv.router.kv_index import Event, PrefixIndex
from agentkv.router.kv_stream import SubscriberStats, subscriber_endpoint
from agentkv.router.tasks import cancel_and_wait

__all__ = ["KVEventSubscriber", "SubscriberStats", "subscriber_endpoint"]

_log = logging.getLogger(__name__)

_ANY_EVENT = BlockStored | BlockRemoved | AllBlocksCleared
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
            if isinstance(event, AllBlocksCleared) and self.index.medium == MEDIUM_GPU:
                # a prefix-cache reset says nothing of a CPU tier's content
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
