"""KV cache events from the simulator, as vLLM 0.33's ``ZmqEventPublisher`` sends them.

:class:`ZmqEventPublisher` mirrors ``vllm/distributed/kv_events.py``: a PUB socket (bound or
connected as the endpoint says), an optional ROUTER replay socket with the last
``buffer_steps`` batches, and one background thread that encodes each batch with msgspec and
sends ``[topic, seq, payload]``. The engine only appends to a bounded queue: :meth:`publish`
never blocks (a full queue drops the batch and counts it, where vLLM would block the
scheduler), so events cannot slow the simulated engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from agentkv.protocol.kv_events import (
    END_SEQ,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
    KVEventsConfig,
    publisher_binds,
)

__all__ = ["ZmqEventPublisher", "int_block_hashes"]

_log = logging.getLogger(__name__)


def int_block_hashes() -> bool:
    """vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default 1: 64-bit int hashes)."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


class ZmqEventPublisher:
    """PUB/ROUTER publisher with an in-memory replay buffer (vLLM's, without DP offsets: a
    simulated engine is data-parallel rank 0)."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, *, host: str = "127.0.0.1") -> None:
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._host = host
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = config.endpoint
        if publisher_binds(endpoint):
            endpoint = self._bind(self._pub, endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        replay_endpoint = config.replay_endpoint
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            replay_endpoint = self._bind(self._replay, replay_endpoint)
        self.config = config.model_copy(
            update={"endpoint": endpoint, "replay_endpoint": replay_endpoint}
        )
        """The resolved config (``tcp://*:0`` replaced by the bound address), as vLLM's
        ``get_publisher_config`` and ``GET /kv_event_sources`` report it."""
        self.dropped = 0
        """Batches dropped because the queue was full."""
        self.sent = 0
        self._seq = count()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> str:
        """Bind; ``tcp://*:0`` binds an OS-chosen port on the node's IP (``VLLM_HOST_IP``, else
        the server's host) and returns the bound endpoint."""
        if endpoint != "tcp://*:0":
            sock.bind(endpoint)
            return endpoint
        ip = os.environ.get("VLLM_HOST_IP") or self._host
        if ip in ("", "0.0.0.0", "::"):
            ip = "127.0.0.1"
        if ":" in ip:
            sock.setsockopt(zmq.IPV6, 1)
            ip = f"[{ip}]"
        port = sock.bind_to_random_port(f"tcp://{ip}")
        return f"tcp://{ip}:{port}"

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (``ts`` now, rank 0); never blocks."""
        if not events or not self._running:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)  # type: ignore[arg-type]
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def shutdown(self) -> None:
        """Send what is queued (up to a second), stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT_S
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    _log.exception("kv events: replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            try:
                seq = next(self._seq)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.sent += 1
            except zmq.ZMQError:
                _log.exception("kv events: publish failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames: list[Any] = self._replay.recv_multipart()
        if len(frames) != 3:
            _log.warning("kv events: invalid replay request (%d frames)", len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))
