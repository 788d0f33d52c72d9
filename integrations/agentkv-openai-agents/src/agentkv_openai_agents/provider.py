"""``AgentKVModelProvider``: OpenAI Agents SDK models whose turns run through agentkv."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal, cast

import openai
from agents.exceptions import UserError
from agents.models.interface import Model, ModelProvider
from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import agentkv
from agentkv.adapters import bind_conversation
from agentkv.pool import (
    AnyConversation,
    ConversationPool,
    StateStore,
    TurnCallback,
    client_factories,
    served_models,
)

__all__ = ["AgentKVModel", "AgentKVModelProvider", "conversation"]

_CONVERSATION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentkv_openai_agents_conversation", default=None
)
_PROMPT_CACHE_KEY = "prompt_cache_key"


def _conversation_key(session_or_id: Any) -> str:
    if isinstance(session_or_id, str):
        return session_or_id
    value = getattr(session_or_id, "session_id", None)
    if isinstance(value, str) and value:
        return value
    raise TypeError(f"conversation() takes a session or an id, not {type(session_or_id).__name__}")


def conversation(session_or_id: Any) -> contextlib.AbstractContextManager[str]:
    """Runs started inside the block use this conversation id: a session's ``session_id``
    verbatim, or any id (``Runner.run_streamed`` started inside the block keeps it too)."""
    return bind_conversation(_CONVERSATION, _conversation_key(session_or_id))


class AgentKVModelProvider(ModelProvider):
    """A model provider whose models run their turns through agentkv conversations.

    ``RunConfig(model_provider=AgentKVModelProvider(...))`` is the one-line change. The Agents
    SDK sends the whole history on every turn; agentkv matches it to the session's conversation
    (``Conversation.sync``), sends exact token ids and announces rewrites (a session trimmed by
    ``SessionSettings(limit=...)``, a compaction) with a new epoch.

    Conversation ids, in this order: the innermost :func:`conversation` block (a session's id
    verbatim), else the key the Runner derives per session / trace group / run (its
    ``prompt_cache_key``: ``agents-sdk:session:<hash of the session id>``), else one id per model.

    Usage: streamed runs (``Runner.run_streamed``) report input, cached and output tokens
    like the others: the request asks for the usage chunk unless
    ``ModelSettings(include_usage=False)``.

    Tracing is the Agents SDK's own: by default it exports traces to OpenAI (with
    ``OPENAI_API_KEY``; without one it logs that it skips the export). Turn it off with
    ``set_tracing_disabled(True)``, ``RunConfig(tracing_disabled=True)`` or
    ``OPENAI_AGENTS_DISABLE_TRACING=1``; export with another key via
    ``set_tracing_export_api_key(...)``; or send the spans elsewhere with
    ``set_trace_processors([...])`` / ``add_trace_processor(...)``.

    Args:
        model: the served model for agents that name none (``Agent(model=None)``). None: the
            server's own, read once from ``GET /v1/models`` (its first model, as vLLM lists
            its base model first); an agent's ``model=`` always wins.
        base_url, api_key: connection settings (else ``$AGENTKV_BASE_URL`` /
            ``$AGENTKV_API_KEY``); or pass ``client`` / ``async_client``.
        on_turn: called with the agentkv conversation and its receipt after every turn.
        store: keep each conversation's ledger in a :class:`StateStore` too.
        lease_s: hold each session's KV while this process lives (a retention lease renewed in
            the background; see agentkv's docs/sdk.md, "Leases").
    """

    def __init__(
        self,
        *,
        model: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        client: agentkv.Client | None = None,
        async_client: agentkv.AsyncClient | None = None,
        timeout: float | None = None,
        retries: int = 2,
        mode: Literal["exact", "messages"] = "exact",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        store: StateStore | None = None,
        max_sessions: int = 1024,
        max_lanes: int = 4,
        on_turn: TurnCallback | None = None,
        lease_s: float | None = None,
    ) -> None:
        self.default_model = model
        self._factories = client_factories(
            base_url=base_url,
            api_key=api_key,
            client=client,
            async_client=async_client,
            timeout=timeout,
            retries=retries,
            lease_s=lease_s,
        )
        self._settings: dict[str, Any] = {
            "mode": mode,
            "chat_template_kwargs": chat_template_kwargs,
            "store": store,
            "max_keys": max_sessions,
            "max_lanes": max_lanes,
            "on_turn": on_turn,
        }
        self._lock = threading.Lock()
        self._client: agentkv.Client | None = None
        self._async_client: agentkv.AsyncClient | None = None
        self._models: dict[str, AgentKVModel] = {}

    def _sync_client(self) -> agentkv.Client:
        with self._lock:
            if self._client is None:
                self._client = self._factories[0]()
            return self._client

    def _aclient(self) -> agentkv.AsyncClient:
        with self._lock:
            if self._async_client is None:
                self._async_client = self._factories[1]()
            return self._async_client

    def served_model(self) -> str:
        """The model agents use when they name none: ``model``, else the server's first
        (``GET /v1/models``, read once)."""
        if self.default_model is not None:
            return self.default_model
        try:
            cards = served_models(self._sync_client())
        except openai.OpenAIError as exc:
            raise UserError(
                "AgentKVModelProvider: the agent names no model and the server's model list "
                f"cannot be read ({type(exc).__name__}: {exc}); pass model= to the provider "
                "or to the Agent."
            ) from exc
        if not cards or not isinstance(cards[0].get("id"), str):
            raise UserError(
                "AgentKVModelProvider: the agent names no model and the server lists none; "
                "pass model= to the provider or to the Agent."
            )
        self.default_model = str(cards[0]["id"])
        return self.default_model

    def get_model(self, model_name: str | None) -> Model:
        name = model_name or self.served_model()
        with self._lock:
            model = self._models.get(name)
            if model is None:
                pool = ConversationPool(
                    model=name,
                    client=self._sync_client,
                    async_client=self._aclient,
                    owns_clients=(False, False),
                    **self._settings,
                )
                model = self._models[name] = AgentKVModel(name, pool)
            return model

    def conversation(self, key: str, model: str | None = None) -> AnyConversation | None:
        """The agentkv conversation whose id is ``key`` (a session id in a
        :func:`conversation` block, else the Runner's key), once it has run."""
        found = cast(AgentKVModel, self.get_model(model))
        return found.pool.conversation(key)

    async def aclose(self) -> None:
        """Close the HTTP clients this provider created."""
        owns = self._factories[2]
        with self._lock:
            client, self._client = self._client, None
            aclient, self._async_client = self._async_client, None
        if client is not None and owns[0]:
            client.close()
        if aclient is not None and owns[1]:
            await aclient.aclose()


class AgentKVModel(OpenAIChatCompletionsModel):
    """The Agents SDK's Chat Completions model, on an agentkv conversation pool.

    The SDK's own conversion of items, tools, handoffs, output schemas and streams is used as
    it is; only the ``chat.completions.create`` call goes through agentkv."""

    def __init__(self, model: str, pool: ConversationPool) -> None:
        self.pool = pool
        self._default_key = f"agentkv-{uuid.uuid4()}"
        facade = _ChatClient(self)
        super().__init__(model=model, openai_client=cast(openai.AsyncOpenAI, facade))

    def _supports_default_prompt_cache_key(self) -> bool:
        """Ask the Runner for its per-session key (the conversation id without a block)."""
        return True


class _ChatClient:
    """The part of ``openai.AsyncOpenAI`` that ``OpenAIChatCompletionsModel`` uses."""

    def __init__(self, model: AgentKVModel) -> None:
        self.model = model
        self.chat = self
        self.completions = self

    @property
    def base_url(self) -> Any:
        client = self.model.pool.async_client
        return client.openai.base_url

    def with_options(self, **_: Any) -> _ChatClient:
        return self

    async def create(self, **kwargs: Any) -> ChatCompletion | _Stream:
        params = {
            k: v
            for k, v in kwargs.items()
            if v is not None and not isinstance(v, openai.Omit | openai.NotGiven)
        }
        params.pop("model", None)
        messages = params.pop("messages")
        tools = params.pop("tools", None) or None
        cache_key = params.pop(_PROMPT_CACHE_KEY, None)
        key = _CONVERSATION.get() or cache_key or self.model._default_key
        pool = self.model.pool
        if params.pop("stream", False):
            # the SDK asks for usage only from api.openai.com: agentkv always has it (the
            # ModelSettings(include_usage=False) of an agent still turns it off)
            params.setdefault("stream_options", {"include_usage": True})
            _turn, chunks = await pool.astream(key, messages, tools, **params)
            return _Stream(chunks)
        turn = await pool.arun(key, messages, tools, **params)
        assert turn.completion is not None
        return turn.completion


class _Stream:
    """The chunks of a streamed turn, closable like ``openai.AsyncStream``."""

    def __init__(self, chunks: AsyncIterator[ChatCompletionChunk]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        return self._chunks

    async def aclose(self) -> None:
        aclose = getattr(self._chunks, "aclose", None)
        if callable(aclose):
            await aclose()

    close = aclose
