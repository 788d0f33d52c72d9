"""The router's handle store: D's transfer handles per (tenant, conversation id), single use.

After each turn the router stores the decode instance's ``kv_transfer_params`` (with what it needs
to verify a later prompt against the blocks D holds). A conversation keeps up to
``per_conversation`` handles (K): several agents on one thread, sub-agents and retries each leave
their own branch of history, and a later turn takes the one that verifies the longest prefix
(:meth:`HandleStore.candidates`, then :meth:`HandleStore.take` of that one). The take is an atomic
get-and-delete of one handle, so a handle is read at most once, even by several router replicas
racing on one Redis.

Two implementations of :class:`HandleStore`:

- :class:`~agentkv.router.memory_store.MemoryStore`: one router process. Bounded
  (``max_entries`` handles, and per tenant ``max_entries_per_tenant``; a full store evicts from
  the tenant holding the most, so no tenant can evict another's within its share) and TTL'd on
  an injectable monotonic clock.
- :class:`~agentkv.router.redis_store.RedisStore`: several router replicas sharing one Redis
  (>= 6.2). Expiry is Redis's own (the server's clock, so replicas agree on age and expiry);
  the per-tenant bound is kept by its put script.

Both call ``on_evict(tenant, bound)`` for every handle a bound evicts (``"tenant"``: the tenant's
own bound, ``"store"``: the memory store's ``max_entries``), for the router's metric and log.

``put`` returns the handles it displaced (the conversation's oldest beyond K, and in memory any
LRU-evicted ones) so the router can tell their D to free the blocks now; expired handles are never
returned (D has reaped or will reap them on its own TTL).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Protocol, TypeGuard

import orjson

from agentkv.protocol.kv_transfer import BLOCK_IDS, engine_id, handle_key

__all__ = [
    "Bound",
    "HandleStore",
    "StoreKey",
    "StoredHandle",
    "Taken",
    "WireParams",
    "issued_by",
    "make_store",
]

StoreKey = tuple[str, str]
"""(tenant, conversation_id)."""

_FORMAT = 3
"""Version of :meth:`StoredHandle.to_bytes`'s layout (router replicas of different versions may
share one Redis; a handle in a format this router does not know is treated as absent)."""
_MAGIC = b"AKH%d" % _FORMAT
HASH_VERSION = 3
"""Version of the block digests (:func:`agentkv.router.verify.block_digests`: their function
and input encoding); it is in every digest's root and tied to :data:`_FORMAT`."""
DIGEST_SIZE = 16
"""Bytes of one block digest."""

DEFAULT_PER_CONVERSATION = 4

Bound = Literal["tenant", "store"]
"""Which bound evicted a handle: its tenant's, or the whole (memory) store's."""
OnEvict = Callable[[str, Bound], None]
"""Called with (tenant, bound) for every handle a bound evicts."""


class WireParams(Mapping[str, Any]):
    """D's ``kv_transfer_params`` with their block ids kept as JSON (a few bytes per block id,
    where a list of Python ints takes 36), read back only when the block ids are; the other
    fields stay a small dict."""

    __slots__ = ("_small", "raw")

    def __init__(self, params: Mapping[str, Any] | bytes) -> None:
        if isinstance(params, WireParams):
            self.raw: bytes = params.raw
            self._small: dict[str, Any] = params._small
            return
        if isinstance(params, bytes):
            self.raw = params
            decoded = orjson.loads(params)
            if not isinstance(decoded, dict):
                raise ValueError("params must be a JSON object")
            params = decoded
        else:
            # copied: orjson's bytes keep the capacity of its output buffer (~500 KiB)
            self.raw = bytes(memoryview(orjson.dumps(dict(params))))
        self._small = {k: v for k, v in params.items() if k != BLOCK_IDS}

    def decoded(self) -> dict[str, Any]:
        """A fresh dict of the params."""
        value: dict[str, Any] = orjson.loads(self.raw)
        return value

    def __getitem__(self, key: str) -> Any:
        if key == BLOCK_IDS:
            return self.decoded()[key]
        return self._small[key]

    def __contains__(self, key: object) -> bool:
        return key in self._small or (key == BLOCK_IDS and len(self._small) != len(self))

    def __iter__(self) -> Iterator[str]:
        return iter(self.decoded())

    def __len__(self) -> int:
        return len(self._small) + (b'"remote_block_ids":' in self.raw)

    def keys(self) -> KeysView[str]:
        return self.decoded().keys()

    def items(self) -> ItemsView[str, Any]:
        return self.decoded().items()

    def values(self) -> ValuesView[Any]:
        return self.decoded().values()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WireParams):
            return self.raw == other.raw or self.decoded() == other.decoded()
        if isinstance(other, Mapping):
            return self.decoded() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WireParams({self.decoded()!r})"


@dataclass(frozen=True)
class StoredHandle:
    """What the router keeps from D's final response, to verify and reuse on a later turn."""

    params: Mapping[str, Any]
    """D's ``kv_transfer_params``, as the router will send it to P (kept as their JSON:
    :class:`WireParams`)."""
    block_hashes: bytes
    """The digests of the full blocks D holds (prompt + output), ``DIGEST_SIZE`` bytes each,
    concatenated (:func:`agentkv.router.verify.block_digests`)."""
    tail_tokens: list[int]
    """Token ids D holds after its last full block (fewer than ``block_size``)."""
    num_tokens: int
    """The tokens D's blocks hold (the handle's token count)."""
    block_size: int
    epoch: int
    decode_url: str
    """Which D holds the blocks."""
    root: bytes = b""
    """What the digests are salted with: the hash version, the model and the effective cache
    salt (a handle never verifies for a prompt under another salt or model)."""
    prefix_digest: bytes = b""
    """One digest of the bytes of all the full blocks (verifies all of them in one call; empty:
    the blocks are compared one by one)."""

    def __post_init__(self) -> None:
        if not isinstance(self.params, WireParams):
            object.__setattr__(self, "params", WireParams(self.params))
        if isinstance(self.root, str):
            object.__setattr__(self, "root", bytes.fromhex(self.root))

    @cached_property
    def id(self) -> str:
        """Stable id of this handle within its conversation (D's request id is unique)."""
        seed = f"{self.decode_url}|{handle_key(self.params)}"
        return hashlib.blake2b(seed.encode(), digest_size=8).hexdigest()

    def to_bytes(self) -> bytes:
        """``AKH3``, the fields as one JSON line, D's params as one JSON line, the digests."""
        assert isinstance(self.params, WireParams)
        meta = orjson.dumps(
            {
                "tail_tokens": self.tail_tokens,
                "num_tokens": self.num_tokens,
                "block_size": self.block_size,
                "epoch": self.epoch,
                "decode_url": self.decode_url,
                "root": self.root.hex(),
                "prefix": self.prefix_digest.hex(),
            }
        )
        return b"".join((_MAGIC, meta, b"\n", self.params.raw, b"\n", self.block_hashes))

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredHandle:
        """Parse :meth:`to_bytes`'s output; ``ValueError`` on anything else (another format)."""
        if not data.startswith(_MAGIC):
            raise ValueError(f"stored handle is not in format {_FORMAT}")
        first = data.find(b"\n", len(_MAGIC))
        second = data.find(b"\n", first + 1) if first >= 0 else -1
        if second < 0:
            raise ValueError("stored handle is truncated")
        try:
            obj = orjson.loads(data[len(_MAGIC) : first])
            params = WireParams(data[first + 1 : second])
        except orjson.JSONDecodeError as e:
            raise ValueError(f"stored handle is not JSON: {e}") from None
        except ValueError:
            raise ValueError("stored handle: params must be an object") from None
        if not isinstance(obj, dict):
            raise ValueError("stored handle is not a JSON object")
        block_hashes = data[second + 1 :]
        if len(block_hashes) % DIGEST_SIZE:
            raise ValueError("stored handle: block_hashes is not a whole number of digests")
        tail_tokens = obj.get("tail_tokens")
        if not isinstance(tail_tokens, list) or not all(_is_int(t) for t in tail_tokens):
            raise ValueError("stored handle: tail_tokens must be a list of integers")
        ints: dict[str, int] = {}
        for name in ("num_tokens", "block_size", "epoch"):
            value = obj.get(name)
            if not _is_int(value):
                raise ValueError(f"stored handle: {name} must be an integer")
            ints[name] = value
        decode_url, root = obj.get("decode_url"), obj.get("root")
        if not isinstance(decode_url, str):
            raise ValueError("stored handle: decode_url must be a string")
        if not isinstance(root, str):
            raise ValueError("stored handle: root must be a string")
        prefix = obj.get("prefix", "")
        try:
            root_bytes = bytes.fromhex(root)
            prefix_bytes = bytes.fromhex(prefix) if isinstance(prefix, str) else None
        except ValueError:
            raise ValueError("stored handle: root and prefix must be hex") from None
        if prefix_bytes is None or len(prefix_bytes) not in (0, DIGEST_SIZE):
            raise ValueError("stored handle: prefix must be one digest in hex")
        return cls(
            params=params,
            block_hashes=block_hashes,
            tail_tokens=tail_tokens,
            num_tokens=ints["num_tokens"],
            block_size=ints["block_size"],
            epoch=ints["epoch"],
            decode_url=decode_url,
            root=root_bytes,
            prefix_digest=prefix_bytes,
        )


def issued_by(handle: StoredHandle, engine: str | None) -> bool:
    """Whether ``engine`` (an engine id; None: none) issued ``handle``."""
    return engine is not None and engine_id(handle.params) == engine


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Taken:
    """A live handle read from the store (by :meth:`HandleStore.candidates` or ``take``)."""

    handle: StoredHandle
    age_s: float
    """Seconds since it was stored (the store's clock: the router's, or Redis's)."""


class HandleStore(Protocol):
    """Where the router keeps up to K transfer handles per (tenant, conversation id)."""

    async def put(
        self, key: StoreKey, handle: StoredHandle, ttl_s: float, *, age_s: float = 0.0
    ) -> list[StoredHandle]:
        """Store ``handle`` under ``key`` for ``ttl_s`` seconds from ``age_s`` ago (a handle put
        back keeps its age), replacing a handle with the same id.

        Returns the live handles this displaced: the conversation's oldest beyond K and any
        evicted to stay within the store's bounds, so the router can release their KV on D early.
        Expired handles are not returned (D reaps them itself)."""
        ...

    async def candidates(self, key: StoreKey) -> list[Taken]:
        """The conversation's live handles, newest first, without taking any."""
        ...

    async def take(self, key: StoreKey, handle_id: str | None = None) -> Taken | None:
        """Atomically get and delete one handle (``handle_id``, or the newest); ``None`` if absent,
        expired or already taken. A handle is taken once."""
        ...

    async def delete(self, key: StoreKey) -> list[StoredHandle]:
        """Remove and return the live handles under ``key``."""
        ...

    async def drop_decode(self, decode_url: str, *, except_engine_id: str | None = None) -> int:
        """Drop every handle held by ``decode_url`` (a D that died), or every one but those
        the engine ``except_engine_id`` issued (a D restarted: a new engine behind the URL);
        how many were dropped."""
        ...

    async def take_oldest(self, decode_url: str, fraction: float) -> list[StoredHandle]:
        """Take the oldest ``fraction`` (at least one) of the live handles ``decode_url`` holds
        (to release them when that D runs short of KV)."""
        ...

    async def size(self) -> int:
        """How many live handles the store holds."""
        ...

    async def aclose(self) -> None: ...


def check_ttl(ttl_s: float) -> None:
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError(f"ttl_s must be a positive finite number of seconds, got {ttl_s!r}")


def check_per_conversation(n: int) -> None:
    if n < 1:
        raise ValueError(f"per_conversation must be at least 1, got {n}")


def check_per_tenant(n: int | None) -> None:
    """``max_entries_per_tenant``: None (no bound of its own) or at least 1."""
    if n is not None and n < 1:
        raise ValueError(f"max_entries_per_tenant must be at least 1, got {n}")


def make_store(
    url: str | None = None,
    *,
    max_entries: int = 100_000,
    max_entries_per_tenant: int | None = None,
    per_conversation: int = DEFAULT_PER_CONVERSATION,
    clock: Callable[[], float] = time.monotonic,
    prefix: str = "agentkv:",
    on_evict: OnEvict | None = None,
) -> HandleStore:
    """The store a router configuration names: ``None`` or ``"memory"`` for a
    :class:`~agentkv.router.memory_store.MemoryStore`
    (``max_entries``, ``max_entries_per_tenant``, ``clock``), a ``redis://``, ``rediss://`` or
    ``unix://`` URL for a :class:`~agentkv.router.redis_store.RedisStore` (``prefix``,
    ``max_entries_per_tenant``; Redis bounds the whole itself, so ``max_entries`` does not
    apply). Both keep ``per_conversation`` handles per conversation and report evictions to
    ``on_evict``."""
    if url is None or url == "memory":
        from agentkv.router.memory_store import MemoryStore

        return MemoryStore(
            max_entries=max_entries,
            max_entries_per_tenant=max_entries_per_tenant,
            per_conversation=per_conversation,
            clock=clock,
            on_evict=on_evict,
        )
    if url.startswith(("redis://", "rediss://", "unix://")):
        from agentkv.router.redis_store import RedisStore

        return RedisStore(
            url,
            prefix=prefix,
            per_conversation=per_conversation,
            max_entries_per_tenant=max_entries_per_tenant,
            on_evict=on_evict,
        )
    raise ValueError(f"unknown handle store {url!r}: use 'memory' or a redis:// URL")
