"""The conversation ledger: messages as generated, their exact token ids, and the epoch.

Pure logic, no I/O: the sync and async conversations (:mod:`agentkv._conversation`) ask the
ledger what to render, render it, send the request the ledger builds and hand the response back
to :meth:`Ledger.absorb`. A turn therefore runs:

1. ``render_job()``: the whole history (first turn, or after a rewrite) or only the messages
   added since the last answer;
2. ``request(prompt_ids, chat_kwargs)``: the ``openai`` keyword arguments, with the conversation
   id (header + ``session_id``), the epoch header, ``return_token_ids`` and, in exact mode,
   ``kv_transfer_params.prompt_token_ids``;
3. ``absorb(...)``: append the assistant message exactly as generated and its token ids, and
   build the :class:`~agentkv._receipt.TurnReceipt`.

Nothing is appended before a response has been received, so a failed or retried request never
changes the history.
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentkv._exceptions import ConversationError, StateError
from agentkv._history import (
    clean_message,
    compacted,
    fingerprint,
    open_tool_calls,
    wire_messages,
    without_reasoning,
)
from agentkv._receipt import Drift, Mode, RewriteReport, TurnReceipt, router_fields
from agentkv.protocol import (
    BODY_KV_TRANSFER_PARAMS,
    BODY_PROMPT_TOKEN_IDS,
    BODY_RETURN_TOKEN_IDS,
    BODY_SESSION_ID,
    HEADER_CONVERSATION_ID,
    HEADER_EPOCH,
)
from agentkv.protocol.prefix import common_prefix

__all__ = ["STATE_VERSION", "Ledger", "RenderJob", "SyncKind", "TurnResult"]

SyncKind = Literal["same", "append", "rewrite"]
"""What :meth:`Conversation.sync` found: the history, an extension of it, or a rewrite."""

STATE_VERSION = 1
_RESERVED = {"messages", "model", "n"}


@dataclass(frozen=True)
class RenderJob:
    """What has to become token ids before the next request."""

    kind: Literal["full", "append"]
    messages: list[dict[str, Any]]
    """``full``: the whole history; ``append``: only the messages added since the last answer."""
    tools: list[dict[str, Any]] | None
    chat_template_kwargs: dict[str, Any] | None
    last_output_ids: list[int]
    """``append``: the previous answer's ids (the renderer drops a duplicated end-of-turn)."""
    previous: dict[str, Any] | None = None
    """``append``: the previous assistant message (its tool calls name the tools that new tool
    results answer; some templates render those names)."""


@dataclass
class TurnResult:
    """One response, reduced to what the ledger needs (streams are accumulated into it)."""

    message: dict[str, Any]
    """The assistant message as generated: content, reasoning, tool calls with raw arguments."""
    prompt_token_ids: list[int] | None
    output_token_ids: list[int] | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    headers: Mapping[str, str]
    latency_s: float
    ttft_s: float | None = None
    request_id: str | None = None
    response_model: str | None = None
    """The ``model`` the server answered with."""


class Ledger:
    """One conversation's history, token ids and epoch."""

    def __init__(
        self,
        *,
        id: str | None = None,
        model: str | None = None,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        mode: Mode = "exact",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if mode not in ("exact", "messages"):
            raise ConversationError(f"mode must be 'exact' or 'messages', not {mode!r}")
        self.id = id or str(uuid.uuid4())
        if not isinstance(self.id, str) or not self.id:
            raise ConversationError("A conversation id must be a non-empty string.")
        self.model = model
        self.mode: Mode = mode
        self.tools = [dict(t) for t in tools] if tools else None
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self.epoch = 0
        self.turns = 0
        self._messages: list[dict[str, Any]] = []
        self._sent = 0
        """Messages already part of ``ids`` (all messages before the pending ones)."""
        self.ids: list[int] | None = None
        """Exact mode: the previous prompt + the previous answer's ids; None until a turn ran
        or after a rewrite."""
        self.last_output_ids: list[int] = []
        self.last_prompt_len: int | None = None
        self._boundaries: list[tuple[int, int]] = []
        """(message count, token offset): ``ids[:offset]`` holds exactly the first
        ``message count`` messages (plus the turn's generation prompt)."""
        self._turn_base: int | None = None
        self.pending_rewrite: RewriteReport | None = None
        self._before_rewrite: list[int] | None = None
        """Exact ids of the history before the pending rewrite: the next prompt measures what
        survived it."""
        self.warned_drift = False
        self.receipts: list[TurnReceipt] = []
        if system is not None:
            self._messages.append({"role": "system", "content": system})

    # -- history --------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict[str, Any]]:
        """The history exactly as generated (a copy)."""
        return copy.deepcopy(self._messages)

    def add(self, message: Mapping[str, Any]) -> None:
        msg = clean_message(message)
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ConversationError(f"Unknown message role {role!r}.", conversation_id=self.id)
        if role == "tool":
            self._check_tool_result(str(msg.get("tool_call_id", "")))
        self._messages.append(msg)

    def add_user(self, content: str | list[dict[str, Any]]) -> None:
        self.add({"role": "user", "content": content})

    def add_tool_result(self, tool_call_id: str, content: str) -> None:
        self.add({"role": "tool", "tool_call_id": tool_call_id, "content": content})

    def _check_tool_result(self, tool_call_id: str) -> None:
        open_ids = open_tool_calls(self._messages)
        if tool_call_id not in open_ids:
            known = ", ".join(open_ids) or "none"
            raise ConversationError(
                f"Unknown or already answered tool_call_id {tool_call_id!r}; the last assistant "
                f"message's open tool calls are: {known}.",
                conversation_id=self.id,
            )

    @property
    def pending(self) -> list[dict[str, Any]]:
        """Messages added since the last answer (not yet in ``ids``)."""
        return copy.deepcopy(self._messages[self._sent :])

    # -- a turn ---------------------------------------------------------------------------
    def render_job(self) -> RenderJob:
        pending = self._messages[self._sent :]
        if not self._messages or (self.ids is not None and not pending):
            raise ConversationError(
                "Nothing to send: add a user message or a tool result first.",
                conversation_id=self.id,
            )
        if self.ids is None:
            return RenderJob("full", self.messages, self.tools, self.chat_template_kwargs, [])
        before = self._messages[self._sent - 1] if self._sent else None
        previous = copy.deepcopy(before) if before and before.get("role") == "assistant" else None
        return RenderJob(
            "append",
            copy.deepcopy(pending),
            self.tools,
            self.chat_template_kwargs,
            list(self.last_output_ids),
            previous,
        )

    def next_prompt(self, job: RenderJob, rendered: list[int]) -> list[int]:
        """The whole next prompt from what the renderer returned for ``job``.

        An ``append`` prompt is the ledger's own id list, extended in place (no copy of the
        history per turn); :meth:`abandon` takes the extension back if the turn fails."""
        if job.kind == "full":
            return list(rendered)
        assert self.ids is not None
        self._turn_base = len(self.ids)
        self.ids.extend(rendered)
        return self.ids

    def abandon(self) -> None:
        """Undo :meth:`next_prompt` after a failed turn: the history is as before it."""
        if self._turn_base is not None and self.ids is not None:
            del self.ids[self._turn_base :]
        self._turn_base = None

    def request(
        self, prompt_ids: list[int] | None, chat_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Keyword arguments for ``client.chat.completions.create``."""
        bad = _RESERVED & set(chat_kwargs)
        if "n" in bad and chat_kwargs.get("n") in (None, 1):
            bad.discard("n")
        if bad:
            raise ConversationError(
                f"{', '.join(sorted(bad))} cannot be passed to create(): the conversation owns "
                "its messages and model (add messages with add_user/add_tool_result).",
                conversation_id=self.id,
            )
        kwargs = dict(chat_kwargs)
        user_body = dict(kwargs.pop("extra_body", None) or {})
        user_headers = dict(kwargs.pop("extra_headers", None) or {})
        model = self.model
        if not model:
            raise ConversationError(
                "No model: pass model= to conversation().", conversation_id=self.id
            )
        extra_body: dict[str, Any] = {**user_body, BODY_SESSION_ID: self.id}
        extra_body[BODY_RETURN_TOKEN_IDS] = True
        if self.chat_template_kwargs:
            extra_body["chat_template_kwargs"] = {
                **self.chat_template_kwargs,
                **(user_body.get("chat_template_kwargs") or {}),
            }
        # A client never sends its own transfer handle: only the exact prompt ids.
        extra_body.pop(BODY_KV_TRANSFER_PARAMS, None)
        if self.mode == "exact" and prompt_ids is not None:
            extra_body[BODY_KV_TRANSFER_PARAMS] = {BODY_PROMPT_TOKEN_IDS: prompt_ids}
        if kwargs.get("stream"):
            options = dict(kwargs.get("stream_options") or {})
            options["include_usage"] = True
            kwargs["stream_options"] = options
        if self.tools is not None and "tools" not in kwargs:
            kwargs["tools"] = self.tools
        return {
            "model": model,
            "messages": wire_messages(self._messages),
            "extra_body": extra_body,
            "extra_headers": {
                **user_headers,
                HEADER_CONVERSATION_ID: self.id,
                HEADER_EPOCH: str(self.epoch),
            },
            **kwargs,
        }

    @property
    def last_prompt_ids(self) -> list[int] | None:
        """The last prompt's ids (a copy)."""
        if self.ids is None or self.last_prompt_len is None:
            return None
        return self.ids[: self.last_prompt_len]

    def absorb(
        self, prompt_ids: list[int] | None, result: TurnResult, drift: Drift | None
    ) -> TurnReceipt:
        """Record a successful response; returns its receipt.

        ``prompt_ids`` (exact mode) is taken over, not copied: the ledger extends it with the
        answer's ids, so a turn costs no copy of the history."""
        self._turn_base = None
        message = {k: v for k, v in result.message.items() if v is not None}
        message["role"] = "assistant"
        if "content" not in message:
            message["content"] = None
        out_ids = result.output_token_ids
        if prompt_ids is not None:
            sent_ids: list[int] | None = prompt_ids
        elif result.prompt_token_ids is not None:
            sent_ids = list(result.prompt_token_ids)
        else:
            sent_ids = None
        start = len(self._messages)
        self._messages.append(message)
        self._sent = len(self._messages)
        self.turns += 1
        if sent_ids is not None and out_ids is not None:
            if self.ids is not None and self.mode == "exact":
                self._boundaries.append((start, len(sent_ids)))
            else:
                # Messages mode: the boundaries still hold where the new prompt matches the
                # last one (all of it, without drift).
                keep = drift.matched_tokens if drift is not None else len(sent_ids)
                kept = [b for b in self._boundaries if b[1] <= keep] if self.ids is not None else []
                self._boundaries = [*kept, (start, len(sent_ids))]
            self.last_prompt_len = len(sent_ids)
            sent_ids.extend(out_ids)
            self.ids = sent_ids
            self._boundaries.append((len(self._messages), len(self.ids)))
        else:
            self.ids = None
            self.last_prompt_len = None
            self._boundaries = []
        self.last_output_ids = list(out_ids or [])
        usage = result.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        fields = router_fields(result.headers)
        receipt = TurnReceipt(
            conversation_id=self.id,
            turn=self.turns,
            epoch=self.epoch,
            mode=self.mode,
            prompt_tokens=int(usage.get("prompt_tokens") or self.last_prompt_len or 0),
            completion_tokens=int(usage.get("completion_tokens") or len(out_ids or [])),
            cached_tokens=details.get("cached_tokens") if isinstance(details, Mapping) else None,
            decision=fields.decision,
            reused_tokens=fields.reused,
            verified_prefix_tokens=fields.verified,
            finish_reason=result.finish_reason,
            latency_s=result.latency_s,
            ttft_s=result.ttft_s,
            drift=drift,
            rewrite=self._measured_rewrite(sent_ids, self.last_prompt_len),
            request_id=result.request_id,
            local_prefix_tokens=fields.local,
            estimated=fields.estimated,
            trim_cause=fields.cause,
            model_ttft_ms=fields.model_ttft_ms,
        )
        self.pending_rewrite = None
        self._before_rewrite = None
        self.receipts.append(receipt)
        return receipt

    def _measured_rewrite(
        self, ids: Sequence[int] | None, prompt_len: int | None
    ) -> RewriteReport | None:
        """The pending rewrite's report, its surviving tokens measured on the prompt that
        followed it (the common prefix of the old exact history and the new prompt)."""
        report, before = self.pending_rewrite, self._before_rewrite
        if report is None or before is None or ids is None or prompt_len is None:
            return report
        kept = common_prefix(before, ids[:prompt_len])
        return dataclasses.replace(report, surviving_tokens=kept, dropped_tokens=len(before) - kept)

    def expected_prefix(self) -> list[int] | None:
        """Messages mode: what the next prompt should start with (previous prompt + output)."""
        return list(self.ids) if self.ids is not None else None

    def message_at_token(self, offset: int) -> int | None:
        """The index of the message whose tokens contain ``offset`` (best known boundary)."""
        index = None
        for count, token_offset in self._boundaries:
            if token_offset <= offset:
                index = count
        return index

    # -- rewriting --------------------------------------------------------------------------
    def rewrite(self, messages: Sequence[Mapping[str, Any]], reason: str) -> RewriteReport:
        new = [clean_message(m) for m in messages]
        if not new:
            raise ConversationError(
                "rewrite() needs at least one message.", conversation_id=self.id
            )
        for msg in new:
            if msg.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ConversationError(
                    f"Unknown message role {msg.get('role')!r}.", conversation_id=self.id
                )
        same = 0
        for old, cur in zip(self._messages, new, strict=False):
            if old != cur:
                break
            same += 1
        surviving_tokens = None
        dropped = None
        if self.ids is not None:
            known = [offset for count, offset in self._boundaries if count <= same]
            # a boundary at or before the first changed message gives a lower bound; without
            # one (e.g. only the system prompt survives) the next prompt measures it
            if known or same == 0:
                surviving_tokens = known[-1] if known else 0
                dropped = len(self.ids) - surviving_tokens
            if self._before_rewrite is None:
                self._before_rewrite = self.ids
        self._messages = new
        self._sent = 0
        self.ids = None
        self._boundaries = []
        self.last_output_ids = []
        self.epoch += 1
        report = RewriteReport(reason, self.epoch, same, surviving_tokens, dropped)
        self.pending_rewrite = report
        return report

    def without_reasoning(self) -> list[dict[str, Any]]:
        return without_reasoning(self._messages)

    def compacted(self, summary: str, keep_last: int) -> list[dict[str, Any]]:
        """System messages, a user message holding ``summary``, then the last ``keep_last``
        messages (moved back so the kept part starts at a user message)."""
        if keep_last < 0:
            raise ConversationError("keep_last must be >= 0.", conversation_id=self.id)
        return compacted(self._messages, summary, keep_last)

    def classify(self, messages: Sequence[Mapping[str, Any]]) -> SyncKind:
        """Whether ``messages`` is the history, extends it, or rewrites it."""
        mine = [fingerprint(m) for m in self._messages]
        theirs = [fingerprint(clean_message(m)) for m in messages]
        if theirs[: len(mine)] != mine:
            return "rewrite"
        return "same" if len(theirs) == len(mine) else "append"

    # -- state ----------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "id": self.id,
            "model": self.model,
            "mode": self.mode,
            "tools": self.tools,
            "chat_template_kwargs": self.chat_template_kwargs,
            "epoch": self.epoch,
            "turns": self.turns,
            "messages": self.messages,
            "sent": self._sent,
            "ids": self.ids,
            "last_output_ids": self.last_output_ids,
            "last_prompt_len": self.last_prompt_len,
            "boundaries": [list(b) for b in self._boundaries],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Ledger:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise StateError(
                f"Not an agentkv conversation state of version {STATE_VERSION}: "
                "save it with Conversation.to_state()."
            )
        try:
            ledger = cls(
                id=str(state["id"]),
                model=state.get("model"),
                tools=state.get("tools"),
                mode=state.get("mode", "exact"),
                chat_template_kwargs=state.get("chat_template_kwargs"),
            )
            ledger.epoch = int(state["epoch"])
            ledger.turns = int(state["turns"])
            ledger._messages = [clean_message(m) for m in state["messages"]]
            ledger._sent = int(state["sent"])
            ids = state.get("ids")
            ledger.ids = [int(t) for t in ids] if ids is not None else None
            ledger.last_output_ids = [int(t) for t in state.get("last_output_ids") or []]
            last = state.get("last_prompt_len")
            ledger.last_prompt_len = int(last) if last is not None else None
            ledger._boundaries = [(int(a), int(b)) for a, b in state.get("boundaries") or []]
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"Malformed conversation state: {exc!r}") from exc
        if not 0 <= ledger._sent <= len(ledger._messages):
            raise StateError("Malformed conversation state: 'sent' is out of range.")
        return ledger
