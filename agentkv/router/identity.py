"""Token identity kept by the router, for clients that send messages.

A client that sends messages (not ids) gets its prompt rendered by the chat template, and the
previous answer, rendered back as history, often tokenizes differently from what the model
generated (reasoning pruned, tool calls re-serialized, merges across the seam): the prompt then
diverges from what D holds inside the answer and the pull is trimmed (cause ``drift``). The SDK
avoids this in exact mode; the router does the same for every client:

* after each answered chat turn with a conversation id it keeps, per (tenant, conversation id),
  an :class:`Entry`: the prompt's ids, the answer's ids, a digest of the client's messages as it
  sent them, a digest of the assistant message as the engine returned it (streamed answers are
  accumulated from their deltas by the relay), and a digest of the rendering context (model,
  tools, chat template and its kwargs);
* on the next request, when its messages are that request's messages + one assistant message
  equal to the returned one + new messages, in the same context, the prompt is the previous
  prompt + the answer's ids + the ids of the new messages alone, found by the SDK's exact-mode
  algorithm (:mod:`agentkv.protocol.exact`) driven against the tokenizing engine's
  ``/tokenize`` and ``/detokenize``. The probes that do not depend on the request are cached
  per context;
* otherwise (the client edited, stripped or compacted its history, ...) the longest prefix of
  its messages that ends with an earlier answer and equals what the ledger recorded (each kept
  entry carries a :class:`Mark` per answer whose ids it holds as generated: where that answer's
  ids end, and a digest of the messages up to it) keeps its recorded ids, and the messages after
  it are rendered by the same exact-mode algorithm (``kept-prefix``). The model sees what the
  client sent from the first change on: a message that differs from the recorded one (reasoning
  stripped, an edit) is never inside the kept prefix;
* with no such prefix the whole request is rendered as today and reuse stays at the verified
  prefix: the model never sees a token the client did not send.

The receipt says which (:data:`~agentkv.protocol.HEADER_IDENTITY`: ``kept``, ``kept-prefix`` or
``rendered:<reason>``, :data:`REASONS`). Entries are bounded (tokens per conversation, and in
memory tokens in all, least recently used first; :data:`MAX_MARKS` marks each), expire
``identity_ttl_s`` after the conversation's last turn (never before the router TTL: they outlive
D's KV, so a turn after a long pause is recomputed but keeps the answers' ids), are dropped when
the conversation is closed, and with a Redis store live in the same Redis so replicas share
them.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson

from agentkv.protocol.errors import UpstreamError
from agentkv.protocol.exact import (
    AppendJob,
    ChatCall,
    ExactError,
    Request,
    TextCall,
    append_plan,
    is_fixed,
    run_plan_async,
)
from agentkv.router.logs import safe
from agentkv.router.request import ClientRequest
from agentkv.router.store import StoreKey

if TYPE_CHECKING:
    import redis.asyncio

__all__ = [
    "KEPT",
    "KEPT_PREFIX",
    "MAX_MARKS",
    "REASONS",
    "Entry",
    "Identity",
    "IdentityLedger",
    "Mark",
    "MemoryLedger",
    "Pending",
    "RedisLedger",
    "Resolved",
    "answer_digest",
    "context_digest",
    "message_digest",
]

log = logging.getLogger("agentkv.router")

KEPT: Final = "kept"
KEPT_PREFIX: Final = "kept-prefix"
"""The history changed after an earlier answer: the recorded ids up to that answer (as
generated), then the client's messages after it rendered on their own."""
MAX_MARKS: Final = 64
"""Marks an entry keeps at most (the first quarter and the most recent of its answers)."""
REASONS: Final = (
    "first-turn",
    "no-record",
    "history-changed",
    "answer-changed",
    "context-changed",
    "options",
    "template",
    "probe-failed",
    "no-conversation",
    "exact-ids",
    "disabled",
)
"""Why a turn was rendered from the client's messages (``rendered:<reason>``): no earlier
answer in the history; an earlier answer but no record of it (expired, evicted, over the bound,
never kept); the messages before the last answer differ from what the client sent then; the
last assistant message differs from what the engine returned (for both: and no earlier recorded
answer ends an unchanged prefix, :data:`KEPT_PREFIX`); the model, tools or template differ;
request options the probes do not cover (``add_generation_prompt: false``,
``continue_final_message``, ``add_special_tokens``, nothing after the answer); the template
does not let new messages render on their own (or refused a probe: a 4xx); the probes'
``/tokenize`` failed otherwise (the engine); no
conversation id; the client sent its own ids; ``keep_token_identity`` off."""

Ask = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""``ask(path, body)``: the tokenizing engine's JSON answer to a POST (raises on failure)."""

_DIGEST = 16
_CONTEXT_KEYS = ("model", "tools", "chat_template", "chat_template_kwargs")
_ANSWER_KEYS = frozenset({"role", "content", "reasoning", "reasoning_content", "tool_calls"})
_EMPTY: tuple[Any, ...] = (None, "", [], {})
_PROBE_CACHE = 1024


# -- digests --------------------------------------------------------------------------------------
def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def _canonical_digest(value: Any) -> bytes:
    """The digest of a JSON value with sorted keys: orjson's text, or for a value nested past
    its depth (orjson reads 1024 levels, writes 254) a walk without recursion."""
    try:
        return _digest(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    except TypeError:
        pass
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"deep")
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            h.update(b"{%d" % len(item))
            for k in sorted(item, reverse=True):
                stack += [item[k], str(k)]
        elif isinstance(item, list):
            h.update(b"[%d" % len(item))
            stack += reversed(item)
        else:
            h.update(b"%d:" % len(repr(item)) + repr(item).encode())
    return h.digest()


def _content(content: Any) -> Any:
    """Text as text: None is empty, a list of plain text parts is their text joined as vLLM
    joins them; anything else as it is."""
    if content is None:
        return ""
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, Mapping)
            and p.get("type") == "text"
            and isinstance(p.get("text"), str)
            and set(p) <= {"type", "text"}
            for p in content
        )
    ):
        return "\n".join(p["text"] for p in content)
    return content


def _calls(calls: Any) -> Any:
    """Tool calls as (id, function name, arguments as sent): ``type`` and a stream's
    ``index`` are not the call."""
    if not isinstance(calls, list):
        return calls or []
    out: list[Any] = []
    for call in calls:
        if not isinstance(call, Mapping):
            out.append(call)
            continue
        fn = call.get("function")
        fn = fn if isinstance(fn, Mapping) else {}
        rest = {k: v for k, v in call.items() if k not in ("id", "type", "index", "function")}
        out.append([call.get("id"), fn.get("name"), fn.get("arguments"), rest or None])
    return out


def _normalized(message: Mapping[str, Any]) -> dict[str, Any]:
    """What a message says: role, content text, reasoning (either name), tool calls, and every
    other field that is set (``tool_call_id``, ``name``, ...)."""
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    return {
        "role": message.get("role"),
        "content": _content(message.get("content")),
        "reasoning": reasoning or "",
        "tool_calls": _calls(message.get("tool_calls")),
        "rest": {k: v for k, v in message.items() if k not in _ANSWER_KEYS and v not in _EMPTY},
    }


def message_digest(message: Any) -> bytes:
    """A message's digest (:func:`_normalized`; anything that is not a message digests as
    itself)."""
    return _canonical_digest(_normalized(message) if isinstance(message, Mapping) else message)


def answer_digest(message: Mapping[str, Any]) -> bytes:
    """The digest of an assistant message, as the engine returned it or as a client sends it
    back (the same as :func:`message_digest`, with the role fixed)."""
    return message_digest({**message, "role": "assistant"})


def context_digest(body: Mapping[str, Any]) -> bytes:
    """What the rendering depends on besides the messages: model, tools, chat template and
    its kwargs."""
    return _canonical_digest({k: body.get(k) for k in _CONTEXT_KEYS})


def _prefix_digests(messages: Sequence[Any], counts: set[int]) -> dict[int, bytes]:
    """The digest of ``messages[:n]`` for every ``n`` in ``counts`` (one pass)."""
    out: dict[int, bytes] = {}
    running = hashlib.blake2b(digest_size=_DIGEST)
    if 0 in counts:
        out[0] = running.digest()
    for i, message in enumerate(messages, 1):
        running.update(message_digest(message))
        if i in counts:
            out[i] = running.digest()
    return out


# -- entries --------------------------------------------------------------------------------------
def _ids(values: Sequence[int]) -> array[int]:
    return array("i", values)


def _mark_digest(history: bytes, answer: bytes) -> bytes:
    """The digest of messages ``[:n]`` (``history``, :func:`_prefix_digests`) followed by the
    answer ``n`` (its :func:`message_digest`)."""
    return _digest(history + answer)


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
    """:func:`_mark_digest` of the messages before it and of the answer as returned."""


def _bounded(marks: Sequence[Mark]) -> tuple[Mark, ...]:
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
    prompt: array[int]
    """The prompt's ids."""
    output: array[int]
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
            _mark_digest(self.history, self.answer),
        )

    @property
    def id(self) -> tuple[int, bytes]:
        """Which request it answered: two entries with one id are the same history's."""
        return (self.messages, self.history)


_HEAD = struct.Struct("<IIII")
_MARK = struct.Struct("<III")
_FORMAT = 2


def _le(ids: array[int]) -> bytes:
    if sys.byteorder == "little":
        return ids.tobytes()
    swapped = array("i", ids)
    swapped.byteswap()
    return swapped.tobytes()


def _from_le(data: bytes) -> array[int]:
    ids = array("i")
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def pack(entries: Sequence[Entry]) -> bytes:
    """Entries as bytes (ids little-endian, 4 bytes each; a mark 28 bytes)."""
    out = [bytes([_FORMAT, len(entries)])]
    for e in entries:
        out += [
            _HEAD.pack(e.messages, len(e.prompt), len(e.output), len(e.marks)),
            e.history,
            e.answer,
            e.context,
            _le(e.prompt),
            _le(e.output),
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
                data[at + i * _DIGEST : at + (i + 1) * _DIGEST] for i in range(3)
            )
            at += 3 * _DIGEST
            prompt = _from_le(data[at : at + 4 * n_prompt])
            at += 4 * n_prompt
            output = _from_le(data[at : at + 4 * n_output])
            at += 4 * n_output
            if len(prompt) != n_prompt or len(output) != n_output:
                return []
            marks = []
            for _ in range(n_marks):
                m, start, end = _MARK.unpack_from(data, at)
                at += _MARK.size
                digest = data[at : at + _DIGEST]
                at += _DIGEST
                if len(digest) != _DIGEST:
                    return []
                marks.append(Mark(m, start, end, digest))
            out.append(Entry(messages, history, answer, context, prompt, output, tuple(marks)))
    except (struct.error, ValueError):
        return []
    return out


def _merged(
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
        entries = _merged(old, entry, replaces, self.branches, cap)
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
        entries = _merged(old, entry, replaces, self.branches, self.per_conversation)
        if entries:
            px = max(1, round(self.ttl_s * 1000))
            await self.client.set(self.key(key), pack(entries), px=px)
        else:
            await self.client.delete(self.key(key))

    async def drop(self, key: StoreKey) -> None:
        await self.client.delete(self.key(key))

    async def aclose(self) -> None:
        """The client is the handle store's: it closes it."""


# -- one turn -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pending:
    """What a turn keeps once it is answered."""

    key: StoreKey
    messages: int
    history: bytes
    context: bytes
    replaces: frozenset[tuple[int, bytes]]
    """The entries this turn's history extends (superseded by its own)."""
    marks: tuple[Mark, ...] = ()
    """The earlier answers whose generated ids the turn's prompt holds (when it was kept)."""


@dataclass(frozen=True)
class Resolved:
    """A turn's prompt as far as token identity goes."""

    ids: list[int] | None
    """The prompt (previous prompt + answer + the new messages' ids, or the ids kept up to an
    earlier answer + the ids of the messages after it); None: render the client's messages."""
    outcome: str | None
    """``kept``, ``kept-prefix`` or ``rendered:<reason>`` (None: not a chat request, no
    receipt)."""
    pending: Pending | None = None


def _rendered(reason: str, pending: Pending | None = None) -> Resolved:
    return Resolved(None, f"rendered:{reason}", pending)


def _options_ok(body: Mapping[str, Any]) -> bool:
    return (
        body.get("add_generation_prompt", True) is not False
        and not body.get("continue_final_message")
        and not body.get("add_special_tokens")
    )


def _tokens(answer: Any, what: str) -> list[int]:
    tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
    if not isinstance(tokens, list):
        raise ValueError(f"{what} returned no 'tokens'")
    return [int(t) for t in tokens]


class Identity:
    """Keeps token identity for one router (see the module docstring)."""

    def __init__(
        self,
        ledger: IdentityLedger,
        *,
        enabled: bool = True,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.ledger, self.enabled, self._on_error = ledger, enabled, on_error
        self._probes: OrderedDict[tuple[bytes, bool], list[int]] = OrderedDict()
        """Answers of the probes that do not depend on the request, per context."""

    def _failed(self, op: str, exc: Exception) -> None:
        log.warning("token identity: %s failed: %s", op, safe(repr(exc)))
        if self._on_error is not None:
            self._on_error(op)

    async def resolve(self, req: ClientRequest, ask: Ask) -> Resolved:
        """The prompt for ``req`` when its history repeats the conversation's last answer as
        the engine returned it; otherwise why not (the caller renders the messages)."""
        if not req.chat:
            return Resolved(None, None)
        if not self.enabled:
            return _rendered("disabled")
        if req.prompt_ids is not None:
            return _rendered("exact-ids")
        if not req.conversation_id:
            return _rendered("no-conversation")
        key: StoreKey = (req.tenant, req.conversation_id)
        messages: list[Any] = req.body.get("messages") or []
        context = context_digest(req.body)
        try:
            entries = await self.ledger.get(key)
        except Exception as exc:  # an accelerator: a failing Redis costs identity, not the turn
            self._failed("identity_get", exc)
            entries = []
        counts = {e.messages for e in entries} | {m.messages for e in entries for m in e.marks}
        prefixes = _prefix_digests(messages, counts | {len(messages)})
        extended = [
            e
            for e in entries
            if e.messages < len(messages) and prefixes.get(e.messages) == e.history
        ]
        pending = Pending(
            key,
            len(messages),
            prefixes[len(messages)],
            context,
            frozenset(e.id for e in extended),
        )
        if not entries:
            answered = any(
                isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages
            )
            return _rendered("no-record" if answered else "first-turn", pending)
        reason = "" if extended else "history-changed"
        for entry in extended:
            found = self._check(entry, messages, context, req.body)
            if isinstance(found, str):
                reason = reason or found
                continue
            mark = entry.own_mark()
            got = await self._kept(entry, mark, found, messages, req, ask, pending)
            if got.ids is None:
                return got
            return replace(got, pending=replace(pending, marks=_bounded([*entry.marks, mark])))
        # the history changed: the longest prefix ending with a recorded answer, if any
        best: tuple[Entry, int] | None = None
        for entry in entries:
            if entry.context != context or not _options_ok(req.body):
                continue
            for i, mark in enumerate(entry.marks):
                if best is not None and best[0].marks[best[1]].messages >= mark.messages:
                    continue
                if mark.messages + 1 >= len(messages):
                    continue  # nothing after it (or not in this history)
                answer = messages[mark.messages]
                history = prefixes.get(mark.messages)
                if (
                    history is not None
                    and isinstance(answer, Mapping)
                    and _mark_digest(history, message_digest(answer)) == mark.digest
                    and all(isinstance(m, Mapping) for m in messages[mark.messages + 1 :])
                ):
                    best = (entry, i)
        if best is None:
            return _rendered(reason, pending)
        entry, i = best
        mark = entry.marks[i]
        got = await self._kept(
            entry, mark, messages[mark.messages], messages, req, ask, pending, KEPT_PREFIX
        )
        if got.ids is None:
            return got
        return replace(got, pending=replace(pending, marks=entry.marks[: i + 1]))

    async def _kept(
        self,
        entry: Entry,
        mark: Mark,
        answer: Mapping[str, Any],
        messages: Sequence[Any],
        req: ClientRequest,
        ask: Ask,
        pending: Pending,
        outcome: str = KEPT,
    ) -> Resolved:
        """The entry's ids up to ``mark``'s answer + the ids of the messages after it."""
        try:
            ids = await self._append(entry, mark, answer, messages[mark.messages + 1 :], req, ask)
        except (ExactError, UpstreamError) as exc:
            # the template cannot render the new messages alone, or refused a probe
            why = exc.kind if isinstance(exc, ExactError) else f"/tokenize {exc.status}"
            log.info(
                "token identity: rendering the messages conv=%s: %s",
                safe(req.conversation_id),
                why,
            )
            return _rendered("template", pending)
        except Exception as exc:  # the probes' /tokenize: render the messages instead
            self._failed("identity_probe", exc)
            return _rendered("probe-failed", pending)
        return Resolved(ids, outcome, pending)

    @staticmethod
    def _check(
        entry: Entry, messages: Sequence[Any], context: bytes, body: Mapping[str, Any]
    ) -> Mapping[str, Any] | str:
        """The assistant message that repeats ``entry``'s answer, or why the turn cannot
        extend ``entry``."""
        answer = messages[entry.messages]
        if (
            not isinstance(answer, Mapping)
            or answer.get("role") != "assistant"
            or answer_digest(answer) != entry.answer
        ):
            return "answer-changed"
        if context != entry.context:
            return "context-changed"
        new = messages[entry.messages + 1 :]
        if not new or not _options_ok(body) or not all(isinstance(m, Mapping) for m in new):
            return "options"
        return answer

    async def _append(
        self,
        entry: Entry,
        mark: Mark,
        answer: Mapping[str, Any],
        new: Sequence[Any],
        req: ClientRequest,
        ask: Ask,
    ) -> list[int]:
        context = entry.context
        body = req.body
        extra = {k: body[k] for k in _CONTEXT_KEYS if body.get(k) is not None}
        model = {"model": body["model"]} if body.get("model") is not None else {}

        async def answer_call(request: Request) -> Any:
            if isinstance(request, ChatCall):
                fixed = (context, request.continue_final_message) if is_fixed(request) else None
                if fixed is not None and fixed in self._probes:
                    self._probes.move_to_end(fixed)
                    return list(self._probes[fixed])
                ids = _tokens(
                    await ask(
                        "/tokenize",
                        {
                            "messages": request.messages,
                            "add_generation_prompt": request.add_generation_prompt,
                            "continue_final_message": request.continue_final_message,
                            **extra,
                        },
                    ),
                    "/tokenize",
                )
                if fixed is not None:
                    self._probes[fixed] = list(ids)
                    while len(self._probes) > _PROBE_CACHE:
                        self._probes.popitem(last=False)
                return ids
            if isinstance(request, TextCall):
                body = {"prompt": request.text, "add_special_tokens": False, **model}
                return _tokens(await ask("/tokenize", body), "/tokenize")
            text = (await ask("/detokenize", {"tokens": request.ids, **model})).get("prompt")
            if not isinstance(text, str):
                raise ValueError("/detokenize returned no 'prompt'")
            return text

        kept = (entry.prompt.tolist() + entry.output.tolist())[: mark.end]
        job = AppendJob([dict(m) for m in new], kept[mark.start :], dict(answer))
        appended = await run_plan_async(append_plan(job), answer_call)
        return kept + appended

    async def record(
        self,
        pending: Pending,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        message: Mapping[str, Any] | None,
    ) -> None:
        """Keep an answered turn (nothing without its ids or its message)."""
        if not output_ids or not prompt_ids or message is None:
            return
        marks = pending.marks
        if marks and marks[-1].end > len(prompt_ids):
            marks = ()  # not the prompt resolved: its marks do not hold
        try:
            entry = Entry(
                pending.messages,
                pending.history,
                answer_digest(message),
                pending.context,
                _ids(prompt_ids),
                _ids(output_ids),
                marks,
            )
            await self.ledger.put(pending.key, entry, set(pending.replaces))
        except Exception as exc:
            self._failed("identity_put", exc)

    async def drop(self, key: StoreKey) -> None:
        try:
            await self.ledger.drop(key)
        except Exception as exc:
            self._failed("identity_drop", exc)
