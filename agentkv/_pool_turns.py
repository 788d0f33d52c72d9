"""A :class:`~agentkv.pool.ConversationPool`'s turns on each client: :class:`SyncPool` on the
sync :class:`agentkv.Client`, :class:`AsyncPool` on the :class:`agentkv.AsyncClient`. Both check a
lane out of the pool's table, run the turn on its conversation (a streamed one recorded when its
iterator is exhausted), record the answer's fingerprint and save the key's state."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from openai.types.chat import ChatCompletion, ChatCompletionChunk

import agentkv
from agentkv._history import fingerprint
from agentkv._lanes import AnyConversation, LaneTable, Turn, take_messages

if TYPE_CHECKING:
    from agentkv.pool import ConversationPool

__all__ = ["AsyncPool", "SyncPool"]


class _Answer:
    """The assistant message of a streamed turn, accumulated for its fingerprint."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, chunk: ChatCompletionChunk) -> None:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                self.content.append(delta.content)
            for call in delta.tool_calls or []:
                slot = self.calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""

    def message(self) -> dict[str, Any]:
        calls = [{"function": self.calls[i]} for i in sorted(self.calls)]
        return {"role": "assistant", "content": "".join(self.content), "tool_calls": calls}


ClientT = TypeVar("ClientT", bound=agentkv.Client | agentkv.AsyncClient)
ConvT = TypeVar("ConvT", bound=AnyConversation)


class _Side(Generic[ClientT, ConvT]):
    """What the sync and async pools share: the table, the settings, the client, the lanes'
    conversations on that client."""

    _CONVERSATION: type[ConvT]

    def __init__(self, pool: ConversationPool, factory: Callable[[], ClientT]) -> None:
        self._pool: ConversationPool = pool
        self._table: LaneTable = pool.table
        self._factory: Callable[[], ClientT] = factory
        self._client: ClientT | None = None

    @property
    def client(self) -> ClientT:
        """The client (made by the factory when first needed)."""
        with self._table.lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def new_conversation(
        self, conversation_id: str, tools: Sequence[Mapping[str, Any]] | None
    ) -> ConvT:
        """A new conversation with the pool's model, mode and template arguments."""
        pool = self._pool
        conv = self.client.conversation(
            conversation_id,
            model=pool.model,
            tools=list(tools) if tools else None,
            mode=pool.mode,
            chat_template_kwargs=pool.chat_template_kwargs,
        )
        return cast(ConvT, conv)

    def resume(self, state: Mapping[str, Any]) -> ConvT:
        return cast(ConvT, self.client.resume(state))

    def _checkout(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> tuple[Turn, ConvT]:
        """The call's lane, its conversation on this client, the messages taken."""
        turn = self._table.checkout(key, messages, tools, lambda i: self.new_conversation(i, tools))
        try:
            conv = turn.lane.conversation
            if not isinstance(conv, self._CONVERSATION):
                conv = self.resume(conv.to_state())
                turn.lane.conversation = conv
            turn.kind = take_messages(turn, conv, messages)
        except BaseException:
            self._table.release(turn.lane)
            raise
        return turn, conv

    def _finish(self, turn: Turn, answer: Mapping[str, Any]) -> None:
        conv = turn.lane.conversation
        turn.lane.prints.append(fingerprint(answer))
        turn.receipt = conv.last_receipt
        on_turn = self._pool.on_turn
        if on_turn is not None and turn.receipt is not None:
            on_turn(conv, turn.receipt)

    def _detach(self) -> ClientT | None:
        with self._table.lock:
            client, self._client = self._client, None
        return client


class SyncPool(_Side[agentkv.Client, agentkv.Conversation]):
    """A :class:`ConversationPool`'s turns on the sync :class:`agentkv.Client`."""

    _CONVERSATION = agentkv.Conversation

    def run(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> Turn:
        """One non-streamed turn."""
        self.load(key)
        turn, conv = self._checkout(key, messages, tools)
        try:
            turn.completion = _completion(conv.create(**chat_kwargs))
            self._finish(turn, _message_dump(turn.completion))
            self.save(key)
            return turn
        finally:
            self._table.release(turn.lane)

    def stream(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> tuple[Turn, Iterator[ChatCompletionChunk]]:
        """One streamed turn; the turn is recorded when the iterator is exhausted."""
        self.load(key)
        turn, conv = self._checkout(key, messages, tools)
        try:
            stream = conv.create(stream=True, **chat_kwargs)
        except BaseException:
            self._table.release(turn.lane)
            raise
        return turn, self._relay(key, turn, stream)

    def _relay(
        self, key: str, turn: Turn, stream: agentkv.ConversationStream
    ) -> Iterator[ChatCompletionChunk]:
        answer = _Answer()
        chunks = iter(stream)
        try:
            for chunk in chunks:
                answer.add(chunk)
                yield chunk
            self._finish(turn, answer.message())
            self.save(key)
        finally:
            # An abandoned stream is not recorded (the SDK undoes the turn); close it now, not
            # when it is garbage collected.
            close = getattr(chunks, "close", None)
            if callable(close):
                close()
            stream.close()
            self._table.release(turn.lane)

    def from_state(self, state: Mapping[str, Any]) -> None:
        """Take over a key's conversations saved by :meth:`ConversationPool.to_state`."""
        self._table.from_state(state, self.resume)

    def load(self, key: str) -> None:
        store = self._pool.store
        if store is not None and key not in self._table:
            state = store.load(key)
            if state is not None:
                self.from_state(state)

    def save(self, key: str) -> None:
        store = self._pool.store
        if store is not None and (state := self._table.to_state(key)) is not None:
            store.save(key, state)

    def close(self) -> None:
        """Close the client if the pool owns it."""
        client = self._detach()
        if client is not None and self._pool.owns_clients[0]:
            client.close()


class AsyncPool(_Side[agentkv.AsyncClient, agentkv.AsyncConversation]):
    """A :class:`ConversationPool`'s turns on the :class:`agentkv.AsyncClient`."""

    _CONVERSATION = agentkv.AsyncConversation

    async def run(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> Turn:
        """One non-streamed turn."""
        await self.load(key)
        turn, conv = self._checkout(key, messages, tools)
        try:
            turn.completion = _completion(await conv.create(**chat_kwargs))
            self._finish(turn, _message_dump(turn.completion))
            await self.save(key)
            return turn
        finally:
            self._table.release(turn.lane)

    async def stream(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> tuple[Turn, AsyncIterator[ChatCompletionChunk]]:
        """One streamed turn; the turn is recorded when the iterator is exhausted."""
        await self.load(key)
        turn, conv = self._checkout(key, messages, tools)
        try:
            stream = await conv.create(stream=True, **chat_kwargs)
        except BaseException:
            self._table.release(turn.lane)
            raise
        return turn, self._relay(key, turn, stream)

    async def _relay(
        self, key: str, turn: Turn, stream: agentkv.AsyncConversationStream
    ) -> AsyncIterator[ChatCompletionChunk]:
        answer = _Answer()
        chunks = stream.__aiter__()
        try:
            async for chunk in chunks:
                answer.add(chunk)
                yield chunk
            self._finish(turn, answer.message())
            await self.save(key)
        finally:
            # An abandoned stream is not recorded: close it now (the SDK undoes the turn).
            aclose = getattr(chunks, "aclose", None)
            if callable(aclose):
                await aclose()
            await stream.aclose()
            self._table.release(turn.lane)

    def from_state(self, state: Mapping[str, Any]) -> None:
        """Take over a key's conversations saved by :meth:`ConversationPool.to_state`."""
        self._table.from_state(state, self.resume)

    async def load(self, key: str) -> None:
        store = self._pool.store
        if store is not None and key not in self._table:
            state = await store.aload(key)
            if state is not None:
                self.from_state(state)

    async def save(self, key: str) -> None:
        store = self._pool.store
        if store is not None and (state := self._table.to_state(key)) is not None:
            await store.asave(key, state)

    async def aclose(self) -> None:
        """Close the client if the pool owns it (``close()`` is the same)."""
        client = self._detach()
        if client is not None and self._pool.owns_clients[1]:
            await client.aclose()

    close = aclose


def _completion(answer: Any) -> ChatCompletion:
    if not isinstance(answer, ChatCompletion):
        raise TypeError("run() sends a non-streamed turn: use stream() for a streamed one")
    return answer


def _message_dump(completion: ChatCompletion) -> dict[str, Any]:
    if not completion.choices:
        return {"role": "assistant", "content": ""}
    return copy.deepcopy(completion.choices[0].message.model_dump(exclude_none=True))
