"""Framework threads → agentkv conversations (used by agentkv's framework adapters).

A framework gives the model a *key* (LangGraph's ``thread_id``, a LlamaIndex chat session, an
OpenAI Agents SDK session) and the **whole** message list on every call. :class:`ConversationPool`
keeps, per key, a few agentkv conversations ("lanes") and routes each call to one of them:

1. a free lane whose history the messages extend (or repeat), with the same tools: the call is an
   ``append`` there and stays token-exact;
2. else the most recently used free lane with the same tools whose first message (the system
   prompt) or last message (its latest answer) the call still has: trimming, summarizing and
   memory flushes keep one of them. ``Conversation.sync`` sees a ``rewrite`` and the epoch moves
   on, so no stale KV is ever read for the changed part;
3. else a new lane. The first lane of a key uses the key itself as conversation id; calls that
   keep neither (a summarizer's or fact extractor's prompt over old messages), use other tools (a
   structured-output call) or come while the lane is busy (a parallel branch) get ``{key}#{n}``,
   so they never make the main conversation thrash between two histories.

Nothing here changes what is sent: the router verifies every reuse by token ids whatever lane a
call lands on; the lanes only decide how much can be reused.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from openai.types.chat import ChatCompletion, ChatCompletionChunk

import agentkv
from agentkv._ledger import fingerprint

__all__ = [
    "DEFAULT_BASE_URL",
    "ConversationPool",
    "Lane",
    "MemoryStateStore",
    "StateStore",
    "Turn",
    "TurnCallback",
    "client_factories",
    "fingerprint",
    "served_models",
]

Kind = Literal["new", "same", "append", "rewrite"]
AnyConversation = agentkv.Conversation | agentkv.AsyncConversation
TurnCallback = Callable[[AnyConversation, agentkv.TurnReceipt], None]
THREAD_STATE_VERSION = 1
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


class StateStore:
    """Where conversation ledgers outlive the process: ``load``/``save`` JSON-able state per key.

    Subclass it and implement :meth:`load` and :meth:`save`; override :meth:`aload` and
    :meth:`asave` when the backend has native async I/O (the defaults call the sync methods).
    """

    def load(self, key: str) -> Mapping[str, Any] | None:
        raise NotImplementedError

    def save(self, key: str, state: Mapping[str, Any]) -> None:
        raise NotImplementedError

    async def aload(self, key: str) -> Mapping[str, Any] | None:
        return self.load(key)

    async def asave(self, key: str, state: Mapping[str, Any]) -> None:
        self.save(key, state)


class MemoryStateStore(StateStore):
    """A :class:`StateStore` in a dict, stored as JSON text (what a real store would hold)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def load(self, key: str) -> Mapping[str, Any] | None:
        text = self.data.get(key)
        return cast(Mapping[str, Any], json.loads(text)) if text is not None else None

    def save(self, key: str, state: Mapping[str, Any]) -> None:
        self.data[key] = json.dumps(state)


def _tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True)


@dataclass
class Lane:
    """One agentkv conversation of a key."""

    id: str
    conversation: AnyConversation
    tools_key: str
    prints: list[tuple[Any, ...]]
    """Fingerprints of the conversation's history (what a framework would send back)."""
    busy: bool = False
    used: float = field(default_factory=time.monotonic)


@dataclass
class _Thread:
    key: str
    lanes: list[Lane] = field(default_factory=list)
    created: int = 0


@dataclass
class Turn:
    """What :meth:`ConversationPool.run` did: the lane, how the messages were taken, the answer."""

    lane: Lane
    kind: Kind
    completion: ChatCompletion | None = None
    receipt: agentkv.TurnReceipt | None = None

    @property
    def conversation_id(self) -> str:
        return self.lane.id


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


class ConversationPool:
    """Conversations by framework key, with lanes, an LRU bound and an optional state store.

    Args:
        model: the served model name every conversation uses.
        client: a factory for the sync :class:`agentkv.Client` (called once, when first needed).
        async_client: a factory for the :class:`agentkv.AsyncClient`.
        mode: ``"exact"`` (token ids) or ``"messages"``.
        chat_template_kwargs: passed to every conversation.
        store: keep each key's ledgers there too (``to_state``), and load them from there when
            the key is not in memory (another process, a restart).
        max_keys: keys kept in memory (least recently used dropped first).
        max_lanes: conversations per key.
        on_turn: called with the conversation and its receipt after every turn.
        owns_clients: whether :meth:`close` closes the clients (False for clients the
            application passed in).
    """

    def __init__(
        self,
        *,
        model: str,
        client: Callable[[], agentkv.Client],
        async_client: Callable[[], agentkv.AsyncClient],
        mode: Literal["exact", "messages"] = "exact",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        store: StateStore | None = None,
        max_keys: int = 1024,
        max_lanes: int = 4,
        on_turn: TurnCallback | None = None,
        owns_clients: tuple[bool, bool] = (True, True),
    ) -> None:
        if max_keys < 1 or max_lanes < 1:
            raise ValueError("max_keys and max_lanes must be at least 1")
        self.model = model
        self.mode: Literal["exact", "messages"] = mode
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self.store = store
        self.max_keys = max_keys
        self.max_lanes = max_lanes
        self.on_turn = on_turn
        self.owns_clients = owns_clients
        self._client_factory = client
        self._async_client_factory = async_client
        self._client: agentkv.Client | None = None
        self._async_client: agentkv.AsyncClient | None = None
        self._threads: OrderedDict[str, _Thread] = OrderedDict()
        self._lock = threading.RLock()

    # -- clients ------------------------------------------------------------------------------
    @property
    def client(self) -> agentkv.Client:
        with self._lock:
            if self._client is None:
                self._client = self._client_factory()
            return self._client

    @property
    def async_client(self) -> agentkv.AsyncClient:
        with self._lock:
            if self._async_client is None:
                self._async_client = self._async_client_factory()
            return self._async_client

    # -- inspection ---------------------------------------------------------------------------
    def conversations(self, key: str) -> list[AnyConversation]:
        """The conversations of ``key`` (the first one is the key's own)."""
        with self._lock:
            thread = self._threads.get(key)
            return [lane.conversation for lane in thread.lanes] if thread else []

    def conversation(self, key: str) -> AnyConversation | None:
        """The conversation whose id is ``key`` itself (None before its first turn)."""
        for conv in self.conversations(key):
            if conv.id == key:
                return conv
        return None

    # -- one turn -----------------------------------------------------------------------------
    def run(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> Turn:
        """One non-streamed turn on the sync client."""
        self._load(key)
        turn = self._checkout(key, messages, tools, asynchronous=False)
        try:
            conv = self._bind(turn.lane, asynchronous=False)
            assert isinstance(conv, agentkv.Conversation)
            turn.kind = self._sync(turn, conv, messages)
            completion = conv.create(**chat_kwargs)
            assert isinstance(completion, ChatCompletion)
            turn.completion = completion
            self._finish(turn, _message_dump(completion))
            self._save(key)
            return turn
        finally:
            self._release(turn.lane)

    def stream(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> tuple[Turn, Iterator[ChatCompletionChunk]]:
        """One streamed turn; the turn is recorded when the iterator is exhausted."""
        self._load(key)
        turn = self._checkout(key, messages, tools, asynchronous=False)
        try:
            conv = self._bind(turn.lane, asynchronous=False)
            assert isinstance(conv, agentkv.Conversation)
            turn.kind = self._sync(turn, conv, messages)
            stream = conv.create(stream=True, **chat_kwargs)
        except BaseException:
            self._release(turn.lane)
            raise
        assert isinstance(stream, agentkv.ConversationStream)
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
            self._save(key)
        finally:
            # An abandoned stream is not recorded (the SDK undoes the turn); close it now, not
            # when it is garbage collected.
            close = getattr(chunks, "close", None)
            if callable(close):
                close()
            stream.close()
            self._release(turn.lane)

    async def arun(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> Turn:
        """One non-streamed turn on the async client."""
        await self._aload(key)
        turn = self._checkout(key, messages, tools, asynchronous=True)
        try:
            conv = self._bind(turn.lane, asynchronous=True)
            assert isinstance(conv, agentkv.AsyncConversation)
            turn.kind = self._sync(turn, conv, messages)
            completion = await conv.create(**chat_kwargs)
            assert isinstance(completion, ChatCompletion)
            turn.completion = completion
            self._finish(turn, _message_dump(completion))
            await self._asave(key)
            return turn
        finally:
            self._release(turn.lane)

    async def astream(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_kwargs: Any,
    ) -> tuple[Turn, AsyncIterator[ChatCompletionChunk]]:
        """One streamed turn on the async client."""
        await self._aload(key)
        turn = self._checkout(key, messages, tools, asynchronous=True)
        try:
            conv = self._bind(turn.lane, asynchronous=True)
            assert isinstance(conv, agentkv.AsyncConversation)
            turn.kind = self._sync(turn, conv, messages)
            stream = await conv.create(stream=True, **chat_kwargs)
        except BaseException:
            self._release(turn.lane)
            raise
        assert isinstance(stream, agentkv.AsyncConversationStream)
        return turn, self._arelay(key, turn, stream)

    async def _arelay(
        self, key: str, turn: Turn, stream: agentkv.AsyncConversationStream
    ) -> AsyncIterator[ChatCompletionChunk]:
        answer = _Answer()
        chunks = stream.__aiter__()
        try:
            async for chunk in chunks:
                answer.add(chunk)
                yield chunk
            self._finish(turn, answer.message())
            await self._asave(key)
        finally:
            # AsyncConversationStream has no close(): closing its generator undoes the turn now.
            aclose = getattr(chunks, "aclose", None)
            if callable(aclose):
                await aclose()
            self._release(turn.lane)

    # -- lanes --------------------------------------------------------------------------------
    def _checkout(
        self,
        key: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        asynchronous: bool,
    ) -> Turn:
        if not messages:
            raise agentkv.ConversationError("No messages to send.", conversation_id=key)
        prints = [fingerprint(m) for m in messages]
        tools_key = _tools_key(tools)
        with self._lock:
            thread = self._threads.get(key)
            if thread is None:
                thread = self._threads[key] = _Thread(key)
                self._evict_keys()
            self._threads.move_to_end(key)
            free = [ln for ln in thread.lanes if not ln.busy and ln.tools_key == tools_key]
            extends = [ln for ln in free if prints[: len(ln.prints)] == ln.prints]
            seen = set(prints)
            kept = [
                ln
                for ln in free
                if ln.prints and (ln.prints[0] == prints[0] or ln.prints[-1] in seen)
            ]
            if extends:
                lane = max(extends, key=lambda ln: (len(ln.prints), ln.used))
                kind: Kind = "same" if len(lane.prints) == len(prints) else "append"
            elif kept:
                lane, kind = max(kept, key=lambda ln: ln.used), "rewrite"
            else:
                lane, kind = self._new_lane(thread, tools, asynchronous), "new"
            lane.busy = True
            lane.used = time.monotonic()
            return Turn(lane, kind)

    def _new_lane(
        self, thread: _Thread, tools: Sequence[Mapping[str, Any]] | None, asynchronous: bool
    ) -> Lane:
        taken = {ln.id for ln in thread.lanes}
        lane_id = thread.key
        while lane_id in taken:
            thread.created += 1
            lane_id = f"{thread.key}#{thread.created}"
        conv = self.client_conversation(lane_id, tools, asynchronous=asynchronous)
        lane = Lane(lane_id, conv, _tools_key(tools), [])
        thread.lanes.append(lane)
        free = [ln for ln in thread.lanes if not ln.busy and ln is not lane]
        while len(thread.lanes) > self.max_lanes and free:
            oldest = min(free, key=lambda ln: ln.used)
            free.remove(oldest)
            thread.lanes.remove(oldest)
        return lane

    def client_conversation(
        self,
        conversation_id: str,
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        asynchronous: bool = False,
    ) -> AnyConversation:
        """A new conversation on the sync or the async client."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tools": list(tools) if tools else None,
            "mode": self.mode,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        if asynchronous:
            return self.async_client.conversation(conversation_id, **kwargs)
        return self.client.conversation(conversation_id, **kwargs)

    def _bind(self, lane: Lane, *, asynchronous: bool) -> AnyConversation:
        """The lane's conversation on the client the caller uses (moved over by its state)."""
        conv = lane.conversation
        if asynchronous and not isinstance(conv, agentkv.AsyncConversation):
            conv = lane.conversation = self.async_client.resume(conv.to_state())
        elif not asynchronous and not isinstance(conv, agentkv.Conversation):
            conv = lane.conversation = self.client.resume(conv.to_state())
        return conv

    def _sync(
        self, turn: Turn, conv: AnyConversation, messages: Sequence[Mapping[str, Any]]
    ) -> Kind:
        try:
            kind = cast(Kind, conv.sync(messages))
        except agentkv.ConversationError:
            # The messages cannot extend this history as they are (a tool result whose call id
            # the framework changed, a history that starts with a tool result): take them as a
            # new history instead.
            conv.rewrite(messages, reason="sync")
            kind = "rewrite"
        if turn.kind == "new" and kind != "rewrite":
            kind = "new"
        elif kind == "same" and messages[-1].get("role") == "assistant":
            # The framework resends the history up to the model's own last answer: nothing new
            # to send, so the history is taken as it is (a new epoch, the router releases the
            # old handle).
            conv.rewrite(messages, reason="resend")
            kind = "rewrite"
        turn.lane.prints = [fingerprint(m) for m in messages]
        return kind

    def _finish(self, turn: Turn, answer: Mapping[str, Any]) -> None:
        conv = turn.lane.conversation
        turn.lane.prints.append(fingerprint(answer))
        turn.receipt = conv.last_receipt
        if self.on_turn is not None and turn.receipt is not None:
            self.on_turn(conv, turn.receipt)

    def _release(self, lane: Lane) -> None:
        with self._lock:
            lane.busy = False

    def _evict_keys(self) -> None:
        while len(self._threads) > self.max_keys:
            for key, thread in self._threads.items():
                if not any(ln.busy for ln in thread.lanes):
                    del self._threads[key]
                    break
            else:
                return

    # -- state --------------------------------------------------------------------------------
    def to_state(self, key: str) -> dict[str, Any] | None:
        """All conversations of ``key`` as JSON-able state (None when the key is unknown)."""
        with self._lock:
            thread = self._threads.get(key)
            if thread is None:
                return None
            lanes = [(ln.id, ln.conversation) for ln in thread.lanes]
            created = thread.created
        return {
            "version": THREAD_STATE_VERSION,
            "key": key,
            "created": created,
            "lanes": [{"id": i, "state": c.to_state()} for i, c in lanes],
        }

    def from_state(self, state: Mapping[str, Any], *, asynchronous: bool = False) -> None:
        """Take over a key's conversations saved by :meth:`to_state` (on the async client with
        ``asynchronous``; a conversation moves to the other client when a call needs it)."""
        if not isinstance(state, Mapping) or state.get("version") != THREAD_STATE_VERSION:
            raise agentkv.StateError(
                f"Not an agentkv thread state of version {THREAD_STATE_VERSION}."
            )
        key = str(state["key"])
        thread = _Thread(key, created=int(state.get("created", 0)))
        for item in state.get("lanes") or []:
            saved = item["state"]
            conv: AnyConversation = (
                self.async_client.resume(saved) if asynchronous else self.client.resume(saved)
            )
            tools = saved.get("tools")
            prints = [fingerprint(m) for m in saved.get("messages") or []]
            thread.lanes.append(Lane(str(item["id"]), conv, _tools_key(tools), prints, used=0.0))
        with self._lock:
            old = self._threads.get(key)
            if old is not None and any(ln.busy for ln in old.lanes):
                return  # a turn is running on the copy in memory: it is the newer one
            self._threads[key] = thread
            self._threads.move_to_end(key)
            self._evict_keys()

    def _load(self, key: str) -> None:
        if self.store is None or key in self._threads:
            return
        state = self.store.load(key)
        if state is not None:
            self.from_state(state)

    async def _aload(self, key: str) -> None:
        if self.store is None or key in self._threads:
            return
        state = await self.store.aload(key)
        if state is not None:
            self.from_state(state, asynchronous=True)

    def _save(self, key: str) -> None:
        if self.store is not None and (state := self.to_state(key)) is not None:
            self.store.save(key, state)

    async def _asave(self, key: str) -> None:
        if self.store is not None and (state := self.to_state(key)) is not None:
            await self.store.asave(key, state)

    # -- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the sync client if this pool owns it (use :meth:`aclose` for both)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self.owns_clients[0]:
            client.close()

    async def aclose(self) -> None:
        """Close the clients this pool owns."""
        self.close()
        with self._lock:
            aclient, self._async_client = self._async_client, None
        if aclient is not None and self.owns_clients[1]:
            await aclient.close()


def _message_dump(completion: ChatCompletion) -> dict[str, Any]:
    if not completion.choices:
        return {"role": "assistant", "content": ""}
    return copy.deepcopy(completion.choices[0].message.model_dump(exclude_none=True))


def client_factories(
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    client: agentkv.Client | None = None,
    async_client: agentkv.AsyncClient | None = None,
    timeout: float | None = None,
    retries: int = 2,
    lease_s: float | None = None,
) -> tuple[Callable[[], agentkv.Client], Callable[[], agentkv.AsyncClient], tuple[bool, bool]]:
    """Factories for the sync and async agentkv clients, and whether the pool owns each.

    An application's own client is used as it is; the missing twin is made with the same base
    URL, API key and retries (and the async twin of a local renderer). Without clients, the
    connection settings are used: ``base_url`` (else ``$AGENTKV_BASE_URL``, else
    ``http://127.0.0.1:8000/v1``) and ``api_key`` (else ``$AGENTKV_API_KEY``). ``lease_s``:
    the clients the pool makes hold a retention lease on every open conversation (see
    docs/sdk.md, "Leases"); an application's own client keeps its own setting."""
    import os

    url = base_url or os.environ.get("AGENTKV_BASE_URL") or DEFAULT_BASE_URL
    key = api_key or os.environ.get("AGENTKV_API_KEY") or "agentkv"
    options: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if lease_s is not None:
        options["lease_s"] = lease_s

    def make_client() -> agentkv.Client:
        if client is not None:
            return client
        if async_client is not None:
            renderer: Any = "remote"
            local = async_client.renderer
            if isinstance(local, agentkv.AsyncLocalRenderer):
                renderer = local.local
            return agentkv.Client(
                base_url=str(async_client.openai.base_url),
                api_key=async_client.openai.api_key,
                retries=async_client.retries,
                renderer=renderer,
                **options,
            )
        return agentkv.Client(base_url=url, api_key=key, retries=retries, **options)

    def make_async_client() -> agentkv.AsyncClient:
        if async_client is not None:
            return async_client
        if client is not None:
            renderer: Any = "remote"
            if isinstance(client.renderer, agentkv.LocalRenderer):
                renderer = client.renderer.as_async()
            return agentkv.AsyncClient(
                base_url=str(client.openai.base_url),
                api_key=client.openai.api_key,
                retries=client.retries,
                renderer=renderer,
                **options,
            )
        return agentkv.AsyncClient(base_url=url, api_key=key, retries=retries, **options)

    return make_client, make_async_client, (client is None, async_client is None)


def served_models(client: agentkv.Client, *, timeout: float = 5.0) -> list[dict[str, Any]]:
    """``GET /v1/models`` of the client's server: vLLM's model cards (``id``,
    ``max_model_len``, ...), as agentkv's router and simulator serve them too. Raises the
    ``openai`` error when the server cannot be reached (one try, ``timeout`` seconds)."""
    page = client.openai.with_options(timeout=timeout, max_retries=0).models.list()
    return [card.model_dump() for card in page.data]
