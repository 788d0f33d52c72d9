"""One engine's KV-event stream as a subscriber sees it: where to subscribe
(:func:`subscriber_endpoint`) and what was received (:class:`SubscriberStats`), for
:class:`~agentkv.router.kv_subscriber.KVEventSubscriber`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentkv.protocol.kv_events import publisher_binds

__all__ = ["SubscriberStats", "subscriber_endpoint"]


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
