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
``identity.ttl_s`` after the conversation's last turn (never before the router TTL: they outlive
D's KV, so a turn after a long pause is recomputed but keeps the answers' ids), are dropped when
the conversation is closed, and with a Redis store live in the same Redis so replicas share
them.

The digests are :mod:`agentkv.router.identity_digests`', the entries and where they live
:mod:`agentkv.router.identity_ledger`'s (their ids kept compact,
:mod:`agentkv.router.identity_ids`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

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
from agentkv.router.identity_digests import (
    CONTEXT_KEYS,
    answer_digest,
    context_digest,
    mark_digest,
    message_digest,
    prefix_digests,
)
from agentkv.router.identity_ids import PackedIds, le_ints
from agentkv.router.identity_ledger import (
    MAX_MARKS,
    Entry,
    IdentityLedger,
    Mark,
    MemoryLedger,
    RedisLedger,
    bounded,
    pack,
    unpack,
)
from agentkv.router.logs import safe
from agentkv.router.request import ClientRequest, TokenIds, int32_le
from agentkv.router.store import StoreKey

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
    "pack",
    "unpack",
]

log = logging.getLogger("agentkv.router")

KEPT: Final = "kept"
KEPT_PREFIX: Final = "kept-prefix"
"""The history changed after an earlier answer: the recorded ids up to that answer (as
generated), then the client's messages after it rendered on their own."""
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
conversation id; the client sent its own ids; ``identity.keep`` off."""

Ask = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""``ask(path, body)``: the tokenizing engine's JSON answer to a POST (raises on failure)."""

_PROBE_CACHE = 1024


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

    ids: TokenIds | None
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
        prefixes = prefix_digests(messages, counts | {len(messages)})
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
            return replace(got, pending=replace(pending, marks=bounded([*entry.marks, mark])))
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
                    and mark_digest(history, message_digest(answer)) == mark.digest
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
    ) -> TokenIds:
        context = entry.context
        body = req.body
        extra = {k: body[k] for k in CONTEXT_KEYS if body.get(k) is not None}
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

        data = (entry.prompt.le() + entry.output.le())[: 4 * mark.end]
        # only the last answer's ids become a list (the append plan reads them)
        job = AppendJob([dict(m) for m in new], le_ints(data[4 * mark.start :]), dict(answer))
        appended = await run_plan_async(append_plan(job), answer_call)
        # the kept ids' int32 bytes are the ledger's: only the new messages' are encoded
        return TokenIds.from_le(data + int32_le(appended))

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
                PackedIds.of(prompt_ids),
                PackedIds.of(output_ids),
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
