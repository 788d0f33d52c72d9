"""``Client`` / ``AsyncClient``: the ``openai`` clients, with conversations that stay exact.

The twins only do I/O; every decision is in :class:`~agentkv._conversation.Ledger` (what to
render, what to send, what to record) and :mod:`agentkv._turn` (how a response or a stream
becomes a turn).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar, overload

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from agentkv._conversation import Ledger, TurnResult
from agentkv._lease import AsyncLeaseRenewer, LeaseRenewer, LeaseStats
from agentkv._receipt import Drift, Mode, RewriteReport, TurnReceipt
from agentkv._rendering import (
    AsyncRemoteRenderer,
    AsyncRenderer,
    RemoteRenderer,
    Renderer,
    root_url,
)
from agentkv._telemetry import TurnSpan, start_turn_span
from agentkv._turn import (
    StreamAccumulator,
    async_retrying,
    check_exact,
    diagnose,
    drift_windows,
    result_from_completion,
    retrying,
)

__all__ = [
    "AsyncClient",
    "AsyncConversation",
    "AsyncConversationStream",
    "Client",
    "Conversation",
    "ConversationStream",
    "wrap",
]

C = TypeVar("C", openai.OpenAI, openai.AsyncOpenAI)


class _BaseConversation(Generic[C]):
    """State and the operations that need no I/O (shared by both twins)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

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

    def sync(self, messages: Sequence[Mapping[str, Any]]) -> str:
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
        """JSON-serialisable state; ``Conversation.from_state`` resumes it."""
        return self._ledger.to_state()


def _released(answer: Any) -> bool:
    """The router's ``{"released": bool}``; any other 2xx answer counts as released."""
    return bool(answer.get("released", True)) if isinstance(answer, dict) else True


def _close_request(ledger: Ledger) -> tuple[str, dict[str, str]]:
    from agentkv.protocol import HEADER_CONVERSATION_ID, HEADER_EPOCH

    return f"/v1/conversations/{ledger.id}", {
        HEADER_CONVERSATION_ID: ledger.id,
        HEADER_EPOCH: str(ledger.epoch),
    }


class Conversation(_BaseConversation[openai.OpenAI]):
    """A conversation on a :class:`Client` (create one with ``client.conversation()``)."""

    def __init__(self, client: Client, ledger: Ledger) -> None:
        super().__init__(ledger)
        self._client = client

    @classmethod
    def from_state(cls, client: Client, state: Mapping[str, Any]) -> Conversation:
        return cls(client, Ledger.from_state(state))

    def compact(
        self, summarize: Callable[[list[dict[str, Any]]], str], *, keep_last: int = 4
    ) -> RewriteReport:
        """Replace all but the last ``keep_last`` messages with ``summarize(messages)``."""
        summary = summarize(self._ledger.messages)
        return self._ledger.rewrite(self._ledger.compacted(summary, keep_last), "compact")

    @overload
    def create(self, *, stream: Literal[True], **chat_kwargs: Any) -> ConversationStream: ...

    @overload
    def create(self, *, stream: Literal[False] = False, **chat_kwargs: Any) -> ChatCompletion: ...

    def create(self, **chat_kwargs: Any) -> ChatCompletion | ConversationStream:
        """Send the next turn; returns the ``openai`` response (or a stream of chunks)."""
        ledger, client = self._ledger, self._client
        span = start_turn_span(ledger)
        try:
            prompt_ids = self._render()
            request = ledger.request(prompt_ids, chat_kwargs)
            span.request(request, client.openai.base_url)
            if client._lease is not None:
                client._lease.turn(self, ledger.id, request["extra_headers"])
            started = time.perf_counter()
            raw = retrying(client.retries)(
                lambda: client.openai.chat.completions.with_raw_response.create(**request)
            )
            if request.get("stream"):
                return ConversationStream(self, raw, prompt_ids, started, span, chat_kwargs)
            completion: ChatCompletion = raw.parse()
            result = result_from_completion(completion, raw.headers, time.perf_counter() - started)
            self._finish(prompt_ids, result, span)
            return completion
        except BaseException as exc:
            ledger.abandon()
            span.fail(exc)
            raise

    def _render(self) -> list[int] | None:
        ledger = self._ledger
        if ledger.mode != "exact":
            return None
        renderer, job = self._client.renderer, ledger.render_job()
        rendered = retrying(self._client.retries)(lambda: renderer.render(job))
        return ledger.next_prompt(job, rendered)

    def _finish(
        self, prompt_ids: list[int] | None, result: TurnResult, span: TurnSpan
    ) -> TurnReceipt:
        ledger = self._ledger
        drift: Drift | None = None
        if ledger.mode == "exact" and prompt_ids is not None:
            prompt_ids = check_exact(ledger, prompt_ids, result)
        elif ledger.mode == "messages":
            windows = drift_windows(ledger, result)
            texts = [self._client.renderer.detokenize(w) for w in windows]
            drift = diagnose(ledger, result, texts)
        receipt = ledger.absorb(prompt_ids, result, drift)
        span.record(receipt, result.response_model)
        return receipt

    def close(self) -> bool:
        """Ask the router to release this conversation's KV now. True when it released a
        handle; False when it held none, or the server has no such endpoint (plain vLLM).
        Its lease, if any, is renewed no more."""
        if self._client._lease is not None:
            self._client._lease.forget(self)
        path, headers = _close_request(self._ledger)
        try:
            answer = self._client.openai.with_options(max_retries=0).delete(
                root_url(self._client.openai.base_url) + path,
                cast_to=object,
                options={"headers": headers},
            )
        except openai.APIStatusError as exc:
            if exc.status_code in (404, 405):
                return False
            raise
        return _released(answer)


class ConversationStream:
    """The ``openai`` chunk stream of a turn; the turn is recorded when it ends cleanly."""

    def __init__(
        self,
        conversation: Conversation,
        raw: Any,
        prompt_ids: list[int] | None,
        started: float,
        span: Any,
        chat_kwargs: Mapping[str, Any],
    ) -> None:
        self._conv, self._prompt_ids, self._span = conversation, prompt_ids, span
        self._stream = raw.parse()
        self._acc = StreamAccumulator(raw.headers, started, chat_kwargs)
        self.receipt: TurnReceipt | None = None

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        try:
            for chunk in self._stream:
                if self._acc.add(chunk):
                    yield chunk
        except BaseException as exc:
            self._conv._ledger.abandon()
            self._span.fail(exc)
            raise
        self.receipt = self._conv._finish(self._prompt_ids, self._acc.result(), self._span)

    def __enter__(self) -> ConversationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading; an unfinished turn is not recorded."""
        self._stream.close()
        if self.receipt is None:
            self._conv._ledger.abandon()
        self._span.end()


class Client:
    """``openai.OpenAI`` with agentkv conversations. Takes ``openai.OpenAI``'s arguments.

    Args:
        renderer: how new messages become token ids in exact mode: ``"remote"`` (the server's
            ``/tokenize``; default) or a :class:`~agentkv._rendering.Renderer` such as
            ``agentkv.LocalRenderer(...)``.
        retries: attempts after the first on connection errors, 429 and 503 (tenacity).
        lease_s: a retention lease (seconds): every turn carries ``X-AgentKV-Lease`` and a
            background thread renews the lease of every open conversation with one batched
            request every ``lease_s / 3`` (see docs/sdk.md, "Leases"). None: no lease.
        **openai_kwargs: passed to ``openai.OpenAI`` (``base_url``, ``api_key``, ...).
    """

    def __init__(
        self,
        *,
        renderer: str | Renderer = "remote",
        retries: int = 2,
        openai_client: openai.OpenAI | None = None,
        lease_s: float | None = None,
        **openai_kwargs: Any,
    ) -> None:
        if openai_client is None:
            openai_kwargs.setdefault("max_retries", 0)
            openai_client = openai.OpenAI(**openai_kwargs)
        else:
            openai_client = openai_client.with_options(max_retries=0)
        self.openai = openai_client
        self.retries = retries
        if isinstance(renderer, str):
            if renderer != "remote":
                raise ValueError("renderer must be 'remote' or a Renderer instance")
            renderer = RemoteRenderer.for_client(openai_client)
        self.renderer: Renderer = renderer
        self._lease = None if lease_s is None else LeaseRenewer.for_openai(openai_client, lease_s)
        if self._lease is not None:
            weakref.finalize(self, self._lease.close)

    @property
    def lease_stats(self) -> LeaseStats | None:
        """What the lease renewer has done; None without ``lease_s``."""
        return None if self._lease is None else self._lease.stats

    def conversation(
        self,
        id: str | None = None,
        *,
        model: str | None = None,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        mode: Mode = "exact",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Conversation:
        """A conversation with a stable id (a new uuid4 unless given)."""
        ledger = Ledger(
            id=id,
            model=model,
            system=system,
            tools=tools,
            mode=mode,
            chat_template_kwargs=chat_template_kwargs,
        )
        return Conversation(self, ledger)

    def resume(self, state: Mapping[str, Any]) -> Conversation:
        return Conversation.from_state(self, state)

    def close(self) -> None:
        """Stop the lease renewer; close the HTTP connections (the openai client's and the
        renderer's)."""
        if self._lease is not None:
            self._lease.close()
        self.openai.close()
        closer = getattr(self.renderer, "close", None)
        if callable(closer):
            closer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.openai, name)


def wrap(client: openai.OpenAI | openai.AsyncOpenAI, **kwargs: Any) -> Client | AsyncClient:
    """An agentkv client around an existing ``openai`` client."""
    if isinstance(client, openai.AsyncOpenAI):
        return AsyncClient(openai_client=client, **kwargs)
    if isinstance(client, openai.OpenAI):
        return Client(openai_client=client, **kwargs)
    raise TypeError(
        f"wrap() takes an openai.OpenAI or openai.AsyncOpenAI, not {type(client).__name__}"
    )


# -- async twin ---------------------------------------------------------------------------------
class AsyncConversation(_BaseConversation[openai.AsyncOpenAI]):
    """A conversation on an :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient, ledger: Ledger) -> None:
        super().__init__(ledger)
        self._client = client

    @classmethod
    def from_state(cls, client: AsyncClient, state: Mapping[str, Any]) -> AsyncConversation:
        return cls(client, Ledger.from_state(state))

    async def compact(
        self, summarize: Callable[[list[dict[str, Any]]], Any], *, keep_last: int = 4
    ) -> RewriteReport:
        """Like :meth:`Conversation.compact`; ``summarize`` may be a coroutine function."""
        summary = summarize(self._ledger.messages)
        if hasattr(summary, "__await__"):
            summary = await summary
        return self._ledger.rewrite(self._ledger.compacted(str(summary), keep_last), "compact")

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
        ledger, client = self._ledger, self._client
        span = start_turn_span(ledger)
        try:
            prompt_ids = await self._render()
            request = ledger.request(prompt_ids, chat_kwargs)
            span.request(request, client.openai.base_url)
            if client._lease is not None:
                client._lease.turn(self, ledger.id, request["extra_headers"])
            started = time.perf_counter()

            async def send() -> Any:
                return await client.openai.chat.completions.with_raw_response.create(**request)

            raw: Any = await async_retrying(client.retries)(send)
            if request.get("stream"):
                return AsyncConversationStream(self, raw, prompt_ids, started, span, chat_kwargs)
            completion: ChatCompletion = raw.parse()
            result = result_from_completion(completion, raw.headers, time.perf_counter() - started)
            await self._finish(prompt_ids, result, span)
            return completion
        except BaseException as exc:
            ledger.abandon()
            span.fail(exc)
            raise

    async def _render(self) -> list[int] | None:
        ledger = self._ledger
        if ledger.mode != "exact":
            return None
        renderer, job = self._client.renderer, ledger.render_job()

        async def render() -> list[int]:
            return await renderer.render(job)

        rendered: list[int] = await async_retrying(self._client.retries)(render)
        return ledger.next_prompt(job, rendered)

    async def _finish(
        self, prompt_ids: list[int] | None, result: TurnResult, span: TurnSpan
    ) -> TurnReceipt:
        ledger = self._ledger
        drift: Drift | None = None
        if ledger.mode == "exact" and prompt_ids is not None:
            prompt_ids = check_exact(ledger, prompt_ids, result)
        elif ledger.mode == "messages":
            windows = drift_windows(ledger, result)
            texts = [await self._client.renderer.detokenize(w) for w in windows]
            drift = diagnose(ledger, result, texts)
        receipt = ledger.absorb(prompt_ids, result, drift)
        span.record(receipt, result.response_model)
        return receipt

    async def close(self) -> bool:
        if self._client._lease is not None:
            self._client._lease.forget(self)
        path, headers = _close_request(self._ledger)
        try:
            answer = await self._client.openai.with_options(max_retries=0).delete(
                root_url(self._client.openai.base_url) + path,
                cast_to=object,
                options={"headers": headers},
            )
        except openai.APIStatusError as exc:
            if exc.status_code in (404, 405):
                return False
            raise
        return _released(answer)


class AsyncConversationStream:
    """The async twin of :class:`ConversationStream`."""

    def __init__(
        self,
        conversation: AsyncConversation,
        raw: Any,
        prompt_ids: list[int] | None,
        started: float,
        span: Any,
        chat_kwargs: Mapping[str, Any],
    ) -> None:
        self._conv, self._prompt_ids, self._span = conversation, prompt_ids, span
        self._raw = raw
        self._acc = StreamAccumulator(raw.headers, started, chat_kwargs)
        self.receipt: TurnReceipt | None = None

    async def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        stream = self._raw.parse()
        try:
            async for chunk in stream:
                if self._acc.add(chunk):
                    yield chunk
        except BaseException as exc:
            self._conv._ledger.abandon()
            self._span.fail(exc)
            raise
        self.receipt = await self._conv._finish(self._prompt_ids, self._acc.result(), self._span)


class AsyncClient:
    """``openai.AsyncOpenAI`` with agentkv conversations (see :class:`Client`)."""

    def __init__(
        self,
        *,
        renderer: str | AsyncRenderer = "remote",
        retries: int = 2,
        openai_client: openai.AsyncOpenAI | None = None,
        lease_s: float | None = None,
        **openai_kwargs: Any,
    ) -> None:
        if openai_client is None:
            openai_kwargs.setdefault("max_retries", 0)
            openai_client = openai.AsyncOpenAI(**openai_kwargs)
        else:
            openai_client = openai_client.with_options(max_retries=0)
        self.openai = openai_client
        self.retries = retries
        if isinstance(renderer, str):
            if renderer != "remote":
                raise ValueError("renderer must be 'remote' or an AsyncRenderer instance")
            renderer = AsyncRemoteRenderer.for_client(openai_client)
        self.renderer: AsyncRenderer = renderer
        self._lease = (
            None if lease_s is None else AsyncLeaseRenewer.for_openai(openai_client, lease_s)
        )
        if self._lease is not None:
            weakref.finalize(self, self._lease.close)

    @property
    def lease_stats(self) -> LeaseStats | None:
        """What the lease renewer has done; None without ``lease_s``."""
        return None if self._lease is None else self._lease.stats

    def conversation(
        self,
        id: str | None = None,
        *,
        model: str | None = None,
        system: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        mode: Mode = "exact",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> AsyncConversation:
        ledger = Ledger(
            id=id,
            model=model,
            system=system,
            tools=tools,
            mode=mode,
            chat_template_kwargs=chat_template_kwargs,
        )
        return AsyncConversation(self, ledger)

    def resume(self, state: Mapping[str, Any]) -> AsyncConversation:
        return AsyncConversation.from_state(self, state)

    async def close(self) -> None:
        if self._lease is not None:
            await self._lease.aclose()
        await self.openai.close()
        closer = getattr(self.renderer, "aclose", None)
        if callable(closer):
            await closer()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.openai, name)
