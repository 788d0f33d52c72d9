"""Keep agentkv ledgers in a LangGraph store (the one an app compiles its graph with)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentkv.pool import StateStore

__all__ = ["LangGraphStore"]


class LangGraphStore(StateStore):
    """A :class:`StateStore` on a LangGraph ``BaseStore`` (``InMemoryStore``, ``PostgresStore``,
    ...): one item per thread under ``namespace``, keyed by the thread id.

    ``ChatAgentKV(..., store=LangGraphStore(store))`` makes every thread's ledger survive a
    restart or move between replicas together with the graph's own checkpoints.
    """

    def __init__(self, store: Any, namespace: tuple[str, ...] = ("agentkv", "threads")) -> None:
        self.store = store
        self.namespace = namespace

    def load(self, key: str) -> Mapping[str, Any] | None:
        item = self.store.get(self.namespace, key)
        return dict(item.value) if item is not None else None

    def save(self, key: str, state: Mapping[str, Any]) -> None:
        self.store.put(self.namespace, key, dict(state), index=False)

    async def aload(self, key: str) -> Mapping[str, Any] | None:
        item = await self.store.aget(self.namespace, key)
        return dict(item.value) if item is not None else None

    async def asave(self, key: str, state: Mapping[str, Any]) -> None:
        await self.store.aput(self.namespace, key, dict(state), index=False)
