"""``Conversation`` / ``AsyncConversation`` and their chunk streams.

Every decision is in :class:`~agentkv._ledger.Ledger` (what to render, what to send, what to
record) and :mod:`agentkv._turn` (how a response or a stream becomes a turn); what the twins
share without I/O is in :class:`_BaseConversation` and :class:`_BaseStream`. The twins only do
the I/O: render, send (with retries), detokenize drift windows, close.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, NoReturn, TypeVar, overload
from urllib.parse import quote

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from typing_extensions import Self

from agentkv._exceptions import ServerCapabilityError
from agentkv._ledger import Ledger, RenderJob, SyncKind, TurnResult
from agentkv._receipt import Drift, Mode, RewriteReport, TurnReceipt
from agentkv._rendering import root_url
from agentkv._telemetry import TurnSpan, start_turn_span
from agentkv._turn import (
    StreamAccumulator,
    check_exact,
    diagnose,
    drift_windows,
    result_from_completion,
)
from agentkv._wire import ChatSend
from agentkv.protocol import HEADER_CONVERSATION_ID, HEADER_EPOCH

if TYPE_CHECKING:
    from agentkv._client import AsyncClient, Client, _BaseClient  # noqa: F401 (in the bases)

__all__ = [
    "AsyncConversation",
    "AsyncConversationStream",
    "Conversation",
    "ConversationStream",
]

ClientT = TypeVar("ClientT", bound="_BaseClient[Any, Any, Any]")


def _released(answer: Any) -> bool:
    """The router's ``{"released": bool}``; any other 2xx answer counts as released."""
    return bool(answer.get("released", True)) if isinstance(answer, dict) else True


def _not_served(exc: openai.APIStatusError) -> bool:
    """``close()`` on a server without the route (plain vLLM): False; other errors raise."""
    if exc.status_code in (404, 405):
        return False
    raise exc


def _without_v1(exc: BaseException, base_url: Any, conversation_id: str) -> Exception | None:
    """A 404 from a base URL with no path (``http://host:8000``, not ``.../v1``): an error that
    names the ``/v1`` it lacks. None for anything else (the error passes through unchanged)."""
    if not isinstance(exc, openai.NotFoundError):
        return None
    base = str(base_url).rstrip("/")
    if httpx.URL(base).path.strip("/"):
        return None
    request = exc.response.request
    return ServerCapabilityError(
        f"{request.method} {request.url} answered 404 ({exc.message}): the base URL {base} has "
        "no /v1, under which OpenAI-compatible servers (agentkv's router, vLLM) serve the API: "
        f"use base_url={base + '/v1'!r}",
        conversation_id=conversation_id,
    )


def _parsed(send: ChatSend, raw: Any, started: float) -> tuple[ChatCompletion, TurnResult]:
    completion: ChatCompletion = send.parse(raw)
    return completion, result_from_completion(
        completion, raw.headers, time.perf_counter() - started
    )


class _BaseConversation(Generic[ClientT]):
    """State and the operations that need no I/O (shared by both twins)."""

    def __init__(self, client: ClientT, ledger: Ledger) -> None:
        self._client = client
        self._ledger = ledger

    @classmethod
    def from_state(cls, client: ClientT, state: Mapping[str, Any]) -> Self:
        return cls(client, Ledger.from_state(state))

    @property
    def id(self) -> str:
        return self._ledger.id

    @property
    def epoch(self) -> int:
        return self._ledger.epoch

    @property
    def mode(self) -> Mode:
        return self._ledger.mode

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The history exactly as generated (reasoning, raw tool-call arguments, ids)."""
        return self._ledger.messages

    @property
    def token_ids(self) -> list[int] | None:
        """Exact mode: the last prompt + the last answer's ids."""
        return None if self._ledger.ids is None else list(self._ledger.ids)

    @property
    def receipts(self) -> list[TurnReceipt]:
        return list(self._ledger.receipts)

    @property
    def last_receipt(self) -> TurnReceipt | None:
        return self._ledger.receipts[-1] if self._ledger.receipts else None

    def add(self, message: Mapping[str, Any]) -> None:
        self._ledger.add(message)

    def add_user(self, content: str | list[dict[str, Any]]) -> None:
        self._ledger.add_user(content)

    def add_tool_result(self, tool_call_id: str, content: str) -> None:
        self._ledger.add_tool_result(tool_call_id, content)

    def rewrite(
        self, messages: Sequence[Mapping[str, Any]], *, reason: str = "rewrite"
    ) -> RewriteReport:
        """Replace the history; bumps the epoch so no stale KV is ever read for it."""
        return self._ledger.rewrite(messages, reason)

    def strip_reasoning(self) -> RewriteReport:
        return self._ledger.rewrite(self._ledger.without_reasoning(), "strip-reasoning")

    def sync(self, messages: Sequence[Mapping[str, Any]]) -> SyncKind:
        """Adopt a framework's full message list: ``same``, ``append`` (new messages added)
        or ``rewrite`` (history replaced, epoch bumped)."""
        kind = self._ledger.classify(messages)
        if kind == "append":
            for msg in list(messages)[len(self._ledger.messages) :]:
                self._ledger.add(msg)
        elif kind == "rewrite":
            self._ledger.rewrite(messages, "sync")
        return kind

    def to_state(self) -> dict[str, Any]:
        """JSON-serialisable state; ``client.resume(state)`` resumes it."""
        return self._ledger.to_state()

    # -- the sans-IO steps of a turn (the twins do the I/O between them) --------------------
    def _compacted(self, summary: Any, keep_last: int) -> RewriteReport:
        return self._ledger.rewrite(self._ledger.compacted(str(summary), keep_last), "compact")

    def _render_job(self) -> RenderJob | None:
        """What to render before the request (None in messages mode)."""
        return self._ledger.render_job() if self._ledger.mode == "exact" else None

    def _request(
        self, prompt_ids: list[int] | None, chat_kwargs: Mapping[str, Any], span: TurnSpan
    ) -> dict[str, Any]:
        """The ``openai`` arguments of the turn (its lease header and tracking included)."""
        ledger, client = self._ledger, self._client
        request = ledger.request(prompt_ids, chat_kwargs)
        span.request(request, client.openai.base_url)
        if client._lease is not None:
            client._lease.turn(self, ledger.id, request["extra_headers"])
        return request

    def _failed(self, exc: BaseException, span: TurnSpan) -> None:
        self._ledger.abandon()
        span.fail(exc)

    def _raise_failed(self, exc: BaseException, span: TurnSpan) -> NoReturn:
        """A turn failed: undo it and raise ``exc``, or an error that names the ``/v1`` the
        base URL lacks."""
        self._failed(exc, span)
        better = _without_v1(exc, self._client.openai.base_url, self._ledger.id)
        if better is not None:
            raise better from exc
        raise exc

    def _drift_windows(self, result: TurnResult) -> list[list[int]]:
        """Messages mode: the id windows to detokenize for the drift diagnosis."""
        return drift_windows(self._ledger, result) if self._ledger.mode == "messages" else []

    def _absorb(
        self,
        prompt_ids: list[int] | None,
        result: TurnResult,
        texts: Sequence[str],
        span: TurnSpan,
    ) -> TurnReceipt:
        ledger = self._ledger
        drift: Drift | None = None
        if ledger.mode == "exact" and prompt_ids is not None:
            prompt_ids = check_exact(ledger, prompt_ids, result)
        elif ledger.mode == "messages":
            drift = diagnose(ledger, result, texts)
        receipt = ledger.absorb(prompt_ids, result, drift)
        span.record(receipt, result.response_model)
        return receipt

    def _close_request(self) -> tuple[str, dict[str, str]]:
        """Stop the lease; the URL and options of ``DELETE /v1/conversations/{id}``."""
        if self._client._lease is not None:
            self._client._lease.forget(self)
        ledger = self._ledger
        headers = {HEADER_CONVERSATION_ID: ledger.id, HEADER_EPOCH: str(ledger.epoch)}
        url = (
            root_url(self._client.openai.base_url)
            + f"/v1/conversations/{quote(ledger.id, safe='')}"
        )
        return url, headers


class Conversation(_BaseConversation["Client"]):
    """A conversation on a :class:`Client` (create one with ``client.conversation()``)."""

    def compact(
        self, summarize: Callable[[list[dict[str, Any]]], str], *, keep_last: int = 4
    ) -> RewriteReport:
        """Replace all but the last ``keep_last`` messages with ``summarize(messages)``."""
        return self._compacted(summarize(self._ledger.messages), keep_last)

    @overload
    def create(self, *, stream: Literal[True], **chat_kwargs: Any) -> ConversationStream: ...

    @overload
    def create(self, *, stream: Literal[False] = False, **chat_kwargs: Any) -> ChatCompletion: ...

    def create(self, **chat_kwargs: Any) -> ChatCompletion | ConversationStream:
        """Send the next turn; returns the ``openai`` response (or a stream of chunks)."""
        client = self._client
        span = start_turn_span(self._ledger)
        try:
            prompt_ids = self._render()
            request = self._request(prompt_ids, chat_kwargs, span)
            started = time.perf_counter()
            send = ChatSend(client.openai, request, prompt_ids)
            raw = client.retry.call(send)
            if request.get("stream"):
                return ConversationStream(self, raw, prompt_ids, started, span, chat_kwargs)
            completion, result = _parsed(send, raw, started)
            self._finish(prompt_ids, result, span)
            return completion
        except BaseException as exc:
            self._raise_failed(exc, span)

    def _render(self) -> list[int] | None:
        job = self._render_job()
        if job is None:
            return None
        renderer = self._client.renderer
        rendered = self._client.retry.call(lambda: renderer.render(job))
        return self._ledger.next_prompt(job, rendered)

    def _finish(
        self, prompt_ids: list[int] | None, result: TurnResult, span: TurnSpan
    ) -> TurnReceipt:
        texts = [self._client.renderer.detokenize(w) for w in self._drift_windows(result)]
        return self._absorb(prompt_ids, result, texts, span)

    def close(self) -> bool:
        """Ask the router to release this conversation's KV now. True when it released a
        handle; False when it held none, or the server has no such endpoint (plain vLLM).
        Its lease, if any, is renewed no more."""
        url, headers = self._close_request()
        try:
            answer = self._client.openai.with_options(max_retries=0).delete(
                url, cast_to=object, options={"headers": headers}
            )
        except openai.APIStatusError as exc:
            return _not_served(exc)
        return _released(answer)


class AsyncConversation(_BaseConversation["AsyncClient"]):
    """A conversation on an :class:`AsyncClient`."""

    async def compact(
        self, summarize: Callable[[list[dict[str, Any]]], Any], *, keep_last: int = 4
    ) -> RewriteReport:
        """Like :meth:`Conversation.compact`; ``summarize`` may be a coroutine function."""
        summary = summarize(self._ledger.messages)
        if hasattr(summary, "__await__"):
            summary = await summary
        return self._compacted(summary, keep_last)

    @overload
    async def create(
        self, *, stream: Literal[True], **chat_kwargs: Any
    ) -> AsyncConversationStream: ...

    @overload
    async def create(
        self, *, stream: Literal[False] = False, **chat_kwargs: Any
    ) -> ChatCompletion: ...

    async def create(self, **chat_kwargs: Any) -> ChatCompletion | AsyncConversationStream:
        """Send the next turn (see :meth:`Conversation.create`)."""
        client = self._client
        span = start_turn_span(self._ledger)
        try:
            prompt_ids = await self._render()
            request = self._request(prompt_ids, chat_kwargs, span)
            started = time.perf_counter()
            send = ChatSend(client.openai, request, prompt_ids)
            raw: Any = await client.retry.acall(send)
            if request.get("stream"):
                return AsyncConversationStream(self, raw, prompt_ids, started, span, chat_kwargs)
            completion, result = _parsed(send, raw, started)
            await self._finish(prompt_ids, result, span)
            return completion
        except BaseException as exc:
            self._raise_failed(exc, span)

    async def _render(self) -> list[int] | None:
        job = self._render_job()
        if job is None:
            return None
        renderer = self._client.renderer
        rendered: list[int] = await self._client.retry.acall(lambda: renderer.render(job))
        return self._ledger.next_prompt(job, rendered)

    async def _finish(
        self, prompt_ids: list[int] | None, result: TurnResult, span: TurnSpan
    ) -> TurnReceipt:
        windows = self._drift_windows(result)
        texts = [await self._client.renderer.detokenize(w) for w in windows]
        return self._absorb(prompt_ids, result, texts, span)

    async def aclose(self) -> bool:
        """Like :meth:`Conversation.close`; ``close()`` is the same."""
        url, headers = self._close_request()
        try:
            answer = await self._client.openai.with_options(max_retries=0).delete(
                url, cast_to=object, options={"headers": headers}
            )
        except openai.APIStatusError as exc:
            return _not_served(exc)
        return _released(answer)

    close = aclose


ConvT = TypeVar("ConvT", Conversation, AsyncConversation)


class _BaseStream(Generic[ConvT]):
    """A turn's chunk stream: the turn is recorded when it ends cleanly, never otherwise."""

    def __init__(
        self,
        conversation: ConvT,
        raw: Any,
        prompt_ids: list[int] | None,
        started: float,
        span: TurnSpan,
        chat_kwargs: Mapping[str, Any],
    ) -> None:
        self._conv: ConvT = conversation
        self._prompt_ids, self._span = prompt_ids, span
        self._stream = raw.parse()
        self._acc = StreamAccumulator(raw.headers, started, chat_kwargs)
        self.receipt: TurnReceipt | None = None

    def _failed(self, exc: BaseException) -> None:
        self._conv._failed(exc, self._span)

    def _closed(self) -> None:
        if self.receipt is None:
            self._conv._ledger.abandon()
        self._span.end()


class ConversationStream(_BaseStream[Conversation]):
    """The ``openai`` chunk stream of a turn; ``close()`` (or ``with``) stops reading, and an
    unfinished turn is not recorded."""

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        try:
            for chunk in self._stream:
                if self._acc.add(chunk):
                    yield chunk
        except BaseException as exc:
            self._failed(exc)
            raise
        self.receipt = self._conv._finish(self._prompt_ids, self._acc.result(), self._span)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading; an unfinished turn is not recorded."""
        self._stream.close()
        self._closed()


class AsyncConversationStream(_BaseStream[AsyncConversation]):
    """The async twin of :class:`ConversationStream` (``aclose()`` or ``close()``, ``async
    with``)."""

    async def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        try:
            async for chunk in self._stream:
                if self._acc.add(chunk):
                    yield chunk
        except BaseException as exc:
            self._failed(exc)
            raise
        result = self._acc.result()
        self.receipt = await self._conv._finish(self._prompt_ids, result, self._span)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop reading; an unfinished turn is not recorded. ``close()`` is the same."""
        await self._stream.close()
        self._closed()

    close = aclose
