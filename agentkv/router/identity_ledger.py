"""Where token identity's entries live (:mod:`agentkv.router.identity`): one answered turn per
:class:`Entry` (digests, the prompt's and the answer's ids, kept compact by
:class:`~agentkv.router.identity_ids.PackedIds`, about 2 bytes an id), in one router's memory
(:class:`MemoryLedger`) or in Redis, shared by replicas (:class:`RedisLedger`, entries packed by
:func:`pack`: ids as int32 little-endian)."""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from agentkv.router.identity_digests import DIGEST_SIZE, mark_digest
from agentkv.router.identity_ids import PackedIds
from agentkv.router.store import StoreKey

if TYPE_CHECKING:
    import redis.asyncio

__all__ = [
    "MAX_MARKS",
    "Entry",
    "IdentityLedger",
    "Mark",
    "MemoryLedger",
    "RedisLedger",
    "bounded",
    "merged",
    "pack",
    "unpack",
]

MAX_MARKS: Final = 64
"""Marks an entry keeps at most (the first quarter and the most recent of its answers)."""


@dataclass(frozen=True)
class Mark:
    """An answer whose ids an entry's prompt holds as the model generated them: the client's
    messages up to and with it keep ``prompt[:end]``."""

    messages: int
    """The answer's index in the client's messages (how many came before it)."""
    start: int
    """Where its ids start in the prompt."""
    end: int
    """Where they end (the messages after it render from there)."""
    digest: bytes
    """:func:`~agentkv.router.identity_digests.mark_digest` of the messages before it and of
    the answer as returned."""


def bounded(marks: Sequence[Mark]) -> tuple[Mark, ...]:
    """At most :data:`MAX_MARKS`: the oldest quarter (a compaction keeps the start) and the
    most recent (an edit or a strip is usually near the end)."""
    if len(marks) <= MAX_MARKS:
        return tuple(marks)
    head = MAX_MARKS // 4
    return (*marks[:head], *marks[len(marks) - (MAX_MARKS - head) :])


@dataclass(frozen=True)
class Entry:
    """One answered turn, as the router keeps it."""

    messages: int
    """How many messages the client sent."""
    history: bytes
    """The digest of those messages."""
    answer: bytes
    """The digest of the assistant message the engine returned."""
    context: bytes
    prompt: PackedIds
    """The prompt's ids."""
    output: PackedIds
    """The answer's ids."""
    marks: tuple[Mark, ...] = ()
    """The earlier answers whose ids ``prompt`` holds as generated, oldest first."""

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def own_mark(self) -> Mark:
        """The mark of this entry's own answer."""
        return Mark(
            self.messages,
            len(self.prompt),
            self.tokens,
            mark_digest(self.history, self.answer),
        )

    @property
    def id(self) -> tuple[int, bytes]:
        """Which request it answered: two entries with one id are the same history's."""
        return (self.messages, self.history)


_HEAD = struct.Struct("<IIII")
_MARK = struct.Struct("<III")
_FORMAT = 2


def pack(entries: Sequence[Entry]) -> bytes:
    """Entries as bytes (ids little-endian, 4 bytes each; a mark 28 bytes)."""
    out = [bytes([_FORMAT, len(entries)])]
    for e in entries:
        out += [
            _HEAD.pack(e.messages, len(e.prompt), len(e.output), len(e.marks)),
            e.history,
            e.answer,
            e.context,
            e.prompt.le(),
            e.output.le(),
        ]
        for m in e.marks:
            out += [_MARK.pack(m.messages, m.start, m.end), m.digest]
    return b"".join(out)


def unpack(data: bytes) -> list[Entry]:
    """:func:`pack`'s entries ([] for bytes of another format or cut short)."""
    if len(data) < 2 or data[0] != _FORMAT:
        return []
    out: list[Entry] = []
    at = 2
    try:
        for _ in range(data[1]):
            messages, n_prompt, n_output, n_marks = _HEAD.unpack_from(data, at)
            at += _HEAD.size
            history, answer, context = (
                data[at + i * DIGEST_SIZE : at + (i + 1) * DIGEST_SIZE] for i in range(3)
            )
            at += 3 * DIGEST_SIZE
            prompt = data[at : at + 4 * n_prompt]
            at += 4 * n_prompt
            output = data[at : at + 4 * n_output]
            at += 4 * n_output
            if len(prompt) != 4 * n_prompt or len(output) != 4 * n_output:
                return []
            marks = []
            for _ in range(n_marks):
                m, start, end = _MARK.unpack_from(data, at)
                at += _MARK.size
                digest = data[at : at + DIGEST_SIZE]
                at += DIGEST_SIZE
                if len(digest) != DIGEST_SIZE:
                    return []
                marks.append(Mark(m, start, end, digest))
            out.append(
                Entry(
                    messages,
                    history,
                    answer,
                    context,
                    PackedIds.from_le(prompt),
                    PackedIds.from_le(output),
                    tuple(marks),
                )
            )
    except (struct.error, ValueError):
        return []
    return out


def merged(
    old: Sequence[Entry], entry: Entry, replaces: set[tuple[int, bytes]], branches: int, cap: int
) -> list[Entry]:
    """A conversation's entries after ``entry`` (newest first): without those it supersedes,
    at most ``branches`` of them and ``cap`` tokens in all."""
    out: list[Entry] = []
    total = 0
    for e in [entry, *(e for e in old if e.id not in replaces and e.id != entry.id)]:
        if len(out) >= branches:
            break
        if total + e.tokens > cap:
            continue
        out.append(e)
        total += e.tokens
    return out


class IdentityLedger(Protocol):
    """Where entries live: :class:`MemoryLedger` or :class:`RedisLedger`."""

    async def get(self, key: StoreKey) -> list[Entry]:
        """The conversation's entries, newest first."""
        ...

    async def put(self, key: StoreKey, entry: Entry, replaces: set[tuple[int, bytes]]) -> None:
        """Keep ``entry``, dropping the entries it supersedes (their ids in ``replaces``)."""
        ...

    async def drop(self, key: StoreKey) -> None: ...

    async def aclose(self) -> None: ...


class MemoryLedger:
    """One router's entries: ``max_tokens`` in all (least recently used conversations go
    first), ``per_conversation`` tokens and ``branches`` entries per conversation, each
    forgotten ``ttl_s`` after it was kept."""

    def __init__(
        self,
        *,
        max_tokens: int,
        per_conversation: int,
        branches: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_tokens, self.per_conversation = max_tokens, per_conversation
        self.branches = branches
        self.ttl_s, self._clock = ttl_s, clock
        self._held: OrderedDict[StoreKey, tuple[float, list[Entry]]] = OrderedDict()
        self.tokens = 0

    def _remove(self, key: StoreKey) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.tokens -= sum(e.tokens for e in held[1])

    async def get(self, key: StoreKey) -> list[Entry]:
        held = self._held.get(key)
        if held is None:
            return []
        if self._clock() - held[0] > self.ttl_s:
            self._remove(key)
            return []
        self._held.move_to_end(key)
        return list(held[1])

    async def put(self, key: StoreKey, entry: Entry, replaces: set[tuple[int, bytes]]) -> None:
        held = self._held.get(key)
        old = held[1] if held is not None and self._clock() - held[0] <= self.ttl_s else []
        cap = min(self.per_conversation, self.max_tokens)
        entries = merged(old, entry, replaces, self.branches, cap)
        self._remove(key)
        if not entries:
            return
        self._held[key] = (self._clock(), entries)
        self.tokens += sum(e.tokens for e in entries)
        while self.tokens > self.max_tokens and self._held:
            self._remove(next(iter(self._held)))

    async def drop(self, key: StoreKey) -> None:
        self._remove(key)

    async def aclose(self) -> None:
        self._held.clear()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._held)


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace(":", "%3A")


class RedisLedger:
    """Entries in Redis, shared by the router's replicas: one key per conversation,
    ``{prefix}identity:{tenant}:{conversation id}`` (``%`` and ``:`` escaped), its entries
    packed (:func:`pack`), expiring ``ttl_s`` after the last turn kept. Replicas racing on one
    conversation keep the last write (an entry lost costs one rendered turn, never a wrong one:
    an entry is used only where the request's own digests match it)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        prefix: str,
        per_conversation: int,
        branches: int,
        ttl_s: float,
    ) -> None:
        self.client, self.prefix = client, prefix
        self.per_conversation, self.branches, self.ttl_s = per_conversation, branches, ttl_s

    def key(self, key: StoreKey) -> str:
        tenant, conversation = key
        return f"{self.prefix}identity:{_escape(tenant)}:{_escape(conversation)}"

    async def get(self, key: StoreKey) -> list[Entry]:
        raw = await self.client.get(self.key(key))
        return unpack(raw) if isinstance(raw, bytes) else []

    async def put(self, key: StoreKey, entry: Entry, replaces: set[tuple[int, bytes]]) -> None:
        old = await self.get(key)
        entries = merged(old, entry, replaces, self.branches, self.per_conversation)
        if entries:
            px = max(1, round(self.ttl_s * 1000))
            await self.client.set(self.key(key), pack(entries), px=px)
        else:
            await self.client.delete(self.key(key))

    async def drop(self, key: StoreKey) -> None:
        await self.client.delete(self.key(key))

    async def aclose(self) -> None:
        """The client is the handle store's: it closes it."""
