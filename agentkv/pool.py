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

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, cast

import agentkv
from agentkv._history import fingerprint
from agentkv._lanes import AnyConversation, Lane, LaneTable, Turn
from agentkv._pool_turns import AsyncPool, SyncPool

__all__ = [
    "DEFAULT_BASE_URL",
    "AsyncPool",
    "ConversationPool",
    "Lane",
    "LaneTable",
    "MemoryStateStore",
    "StateStore",
    "SyncPool",
    "Turn",
    "TurnCallback",
    "client_factories",
    "fingerprint",
    "served_models",
]

TurnCallback = Callable[[AnyConversation, agentkv.TurnReceipt], None]
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


class ConversationPool:
    """Conversations by framework key, with lanes, an LRU bound and an optional state store.

    The keys and lanes are a :class:`LaneTable` (``pool.table``); turns run on
    :class:`SyncPool` (``pool.sync``: :meth:`run`, :meth:`stream`) or :class:`AsyncPool`
    (``pool.aio``: :meth:`arun`, :meth:`astream`), which share it.

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
        self.table = LaneTable(max_keys=max_keys, max_lanes=max_lanes)
        self.model = model
        self.mode: Literal["exact", "messages"] = mode
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self.store = store
        self.on_turn = on_turn
        self.owns_clients = owns_clients
        self.sync = SyncPool(self, client)
        self.aio = AsyncPool(self, async_client)
        self.run = self.sync.run
        self.stream = self.sync.stream
        self.arun = self.aio.run
        self.astream = self.aio.stream

    @property
    def max_keys(self) -> int:
        return self.table.max_keys

    @property
    def max_lanes(self) -> int:
        return self.table.max_lanes

    @property
    def client(self) -> agentkv.Client:
        return self.sync.client

    @property
    def async_client(self) -> agentkv.AsyncClient:
        return self.aio.client

    def conversations(self, key: str) -> list[AnyConversation]:
        """The conversations of ``key`` (the first one is the key's own)."""
        return self.table.conversations(key)

    def conversation(self, key: str) -> AnyConversation | None:
        """The conversation whose id is ``key`` itself (None before its first turn)."""
        for conv in self.conversations(key):
            if conv.id == key:
                return conv
        return None

    def to_state(self, key: str) -> dict[str, Any] | None:
        """All conversations of ``key`` as JSON-able state (None when the key is unknown)."""
        return self.table.to_state(key)

    def from_state(self, state: Mapping[str, Any]) -> None:
        """Take over a key's conversations saved by :meth:`to_state`, on the sync client (a
        conversation moves to the async client when a call needs it; ``pool.aio.from_state``
        resumes them there)."""
        self.sync.from_state(state)

    def close(self) -> None:
        """Close the sync client if this pool owns it (use :meth:`aclose` for both)."""
        self.sync.close()

    async def aclose(self) -> None:
        """Close the clients this pool owns."""
        self.sync.close()
        await self.aio.aclose()


def client_factories(
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    client: agentkv.Client | None = None,
    async_client: agentkv.AsyncClient | None = None,
    timeout: float | None = None,
    retries: int | agentkv.RetryPolicy = 2,
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

    def settings(renderer: Any, like: agentkv.Client | agentkv.AsyncClient | None) -> Any:
        """The twin's connection: ``like``'s base URL, API key and retries, else the
        arguments."""
        if like is None:
            return {"base_url": url, "api_key": key, "retries": retries, **options}
        return {
            "base_url": str(like.openai.base_url),
            "api_key": like.openai.api_key,
            "retries": like.retry,
            "renderer": renderer,
            **options,
        }

    def make_client() -> agentkv.Client:
        if client is not None:
            return client
        local = async_client.renderer if async_client is not None else None
        renderer = local.local if isinstance(local, agentkv.AsyncLocalRenderer) else "remote"
        return agentkv.Client(**settings(renderer, async_client))

    def make_async_client() -> agentkv.AsyncClient:
        if async_client is not None:
            return async_client
        local = client.renderer if client is not None else None
        renderer = local.as_async() if isinstance(local, agentkv.LocalRenderer) else "remote"
        return agentkv.AsyncClient(**settings(renderer, client))

    return make_client, make_async_client, (client is None, async_client is None)


def served_models(client: agentkv.Client, *, timeout: float = 5.0) -> list[dict[str, Any]]:
    """``GET /v1/models`` of the client's server: vLLM's model cards (``id``,
    ``max_model_len``, ...), as agentkv's router and simulator serve them too. Raises the
    ``openai`` error when the server cannot be reached (one try, ``timeout`` seconds)."""
    page = client.openai.with_options(timeout=timeout, max_retries=0).models.list()
    return [card.model_dump() for card in page.data]
