"""vLLM 0.33's KV cache events on the wire: the config, the msgspec structs, the ZMQ frames.

Copied field for field from vLLM 0.33.0 (``vllm/distributed/kv_events.py``,
``vllm/config/kv_events.py``) so that ``msgspec.msgpack.Encoder().encode(batch)`` gives the same
bytes vLLM's publisher sends, and vLLM's own decoder reads ours. Shared by the simulator (which
publishes) and the router (which subscribes); needs ``msgspec`` (the ``serve`` extra), so
``agentkv.protocol`` does not import it.

* A batch is ``KVEventBatch(ts, events, data_parallel_rank)``, encoded **as an array**
  (``array_like=True``): ``[ts, [event, ...], dp_rank]``.
* Each event is a **map** tagged with its class name (``tag=True``):
  ``{"type": "BlockStored", "block_hashes": [...], ...}``; fields equal to their default are
  left out (``omit_defaults=True``), fields without a default (``lora_id``, ``medium``,
  ``lora_name``) are always there, ``null`` or not.
* Block hashes are 64-bit unsigned ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``:
  the low 64 bits of the big-endian block hash), raw hash bytes otherwise.
* ZMQ: PUB frames ``[topic, seq (8 bytes, big-endian), payload]``; the replay ROUTER socket
  answers ``[start_seq (8 bytes)]`` (after the empty delimiter) with ``[b"", topic, seq,
  payload]`` per buffered batch from ``start_seq`` on, then ``[b"", b"", END_SEQ, b""]``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, model_validator

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventsConfig",
    "external_block_hash",
    "publisher_binds",
]

ExternalBlockHash = bytes | int
"""``vllm.v1.core.kv_cache_utils.ExternalBlockHash``."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
"""Blocks in an OffloadingConnector's CPU tier (``offloading/events.py``, vLLM 0.33)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay sequence number (``ZmqEventPublisher.END_SEQ``)."""


class KVEventsConfig(BaseModel):
    """vLLM's ``--kv-events-config`` (``vllm.config.kv_events.KVEventsConfig``), same names,
    defaults and meaning; unknown keys are errors, as in vLLM."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    """Publish BlockStored / BlockRemoved / AllBlocksCleared."""
    publisher: Literal["null", "zmq"] | None = None
    """``zmq`` or ``null``; unset: ``zmq`` when events are enabled, else ``null``."""
    endpoint: str = "tcp://*:5557"
    """PUB socket. A wildcard (``*``, ``::``), ``ipc://`` or ``inproc://`` endpoint makes the
    engine **bind**; any other (``tcp://127.0.0.1:5557``) makes it **connect**, so the
    subscriber binds. ``tcp://*:0`` binds an OS-chosen port on the node's IP."""
    replay_endpoint: str | None = None
    """ROUTER socket for replay requests (the engine always binds it)."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """PUB send high-water mark (ZMQ drops messages beyond it)."""
    max_queue_size: int = 100_000
    """Batches queued for the publisher thread."""
    topic: str = ""
    """First frame of every message; subscribers filter on it."""

    @model_validator(mode="after")
    def _default_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        return self

    @property
    def active(self) -> bool:
        """True when an engine with this config publishes over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds ``endpoint`` (``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def external_block_hash(block_hash: bytes, *, as_int: bool = True) -> ExternalBlockHash:
    """``kv_cache_utils.maybe_convert_block_hash``: the low 64 bits as an int, or the bytes."""
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


# -- the structs (vllm/distributed/kv_events.py, 0.33.0) -----------------------------------------


class EventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    """One entry per block: the LoRA name (if any), ``(mm_identifier, offset)`` pairs, the
    ``cache_salt`` (first block only) and prompt-embeds digests, untagged."""
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
