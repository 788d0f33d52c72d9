"""What agentkv's framework adapters share (``integrations/``: langchain-agentkv,
llama-index-llms-agentkv, agentkv-openai-agents).

Each adapter is a distribution of its own that depends only on vllm-agentkv, so the code they
would otherwise each write again lives here: the pool built from an adapter's settings, its
pass-through methods to that pool, the contextvar block that names a conversation, and the
receipt and reasoning read from a turn. Exported nowhere else (not from ``agentkv``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol

from pydantic import SecretStr

import agentkv
from agentkv.pool import ConversationPool, StateStore, Turn, TurnCallback, client_factories

__all__ = [
    "AdapterSettings",
    "PoolMethods",
    "bind_conversation",
    "pool_for",
    "reasoning_text",
    "turn_metadata",
]


class AdapterSettings(Protocol):
    """The connection and conversation settings an adapter model has under these names."""

    @property
    def model(self) -> str: ...
    @property
    def base_url(self) -> str | None: ...
    @property
    def api_key(self) -> SecretStr | None: ...
    @property
    def timeout(self) -> float | None: ...
    @property
    def retries(self) -> int: ...
    @property
    def lease_s(self) -> float | None: ...
    @property
    def mode(self) -> Literal["exact", "messages"]: ...
    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def max_lanes(self) -> int: ...


def pool_for(
    settings: AdapterSettings,
    *,
    max_keys: int,
    client: agentkv.Client | None = None,
    async_client: agentkv.AsyncClient | None = None,
    store: StateStore | None = None,
    on_turn: TurnCallback | None = None,
) -> ConversationPool:
    """The :class:`ConversationPool` of an adapter model: its clients made from ``settings``
    (or the ``client`` / ``async_client`` given, which the pool then does not close)."""
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    make_client, make_async_client, owns = client_factories(
        base_url=settings.base_url,
        api_key=api_key,
        client=client,
        async_client=async_client,
        timeout=settings.timeout,
        retries=settings.retries,
        lease_s=settings.lease_s,
    )
    return ConversationPool(
        model=settings.model,
        client=make_client,
        async_client=make_async_client,
        mode=settings.mode,
        chat_template_kwargs=settings.chat_template_kwargs,
        store=store,
        max_keys=max_keys,
        max_lanes=settings.max_lanes,
        on_turn=on_turn,
        owns_clients=owns,
    )


class PoolMethods:
    """An adapter model's pass-through methods to its :class:`ConversationPool` (``_pool``)."""

    _pool: ConversationPool

    @property
    def pool(self) -> ConversationPool:
        """The agentkv conversations of the framework's threads or sessions."""
        return self._pool

    def from_state(self, state: Mapping[str, Any]) -> None:
        """Take over a thread's or session's conversations saved with ``to_state``."""
        self._pool.from_state(state)

    def close(self) -> None:
        """Close the sync HTTP client this model created (:meth:`aclose`: both)."""
        self._pool.close()

    async def aclose(self) -> None:
        """Close the HTTP clients this model created."""
        await self._pool.aclose()


@contextlib.contextmanager
def bind_conversation(var: contextvars.ContextVar[str | None], key: str) -> Iterator[str]:
    """A block inside which ``var`` holds the conversation id ``key`` (set back after it)."""
    token = var.set(key)
    try:
        yield key
    finally:
        var.reset(token)


def turn_metadata(turn: Turn) -> dict[str, Any]:
    """A turn's conversation id, how its messages were taken, and its receipt, as a dict."""
    data: dict[str, Any] = {"conversation_id": turn.conversation_id, "sync": turn.kind}
    if turn.receipt is not None:
        data.update(turn.receipt.to_dict())
    return data


def reasoning_text(message: Any) -> str | None:
    """The reasoning of a message or delta (``reasoning`` or ``reasoning_content``, also as an
    extra field of the OpenAI types), or None."""
    extra = getattr(message, "model_extra", None) or {}
    value = getattr(message, "reasoning", None) or extra.get("reasoning")
    value = value or getattr(message, "reasoning_content", None) or extra.get("reasoning_content")
    return value if isinstance(value, str) and value else None
