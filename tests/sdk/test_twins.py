"""The sync and async twins expose the same public names (modulo the documented ones)."""

from __future__ import annotations

import inspect

import pytest

import agentkv
from agentkv import pool


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


ONLY = {
    # (sync, async): names only one twin has, each documented in docs/sdk.md
    "client": (set(), {"aclose"}),
    "conversation": (set(), {"aclose"}),
    "stream": (set(), {"aclose"}),
    "pool": (set(), {"aclose"}),
}


@pytest.mark.parametrize(
    ("what", "sync", "asynchronous"),
    [
        ("client", agentkv.Client, agentkv.AsyncClient),
        ("conversation", agentkv.Conversation, agentkv.AsyncConversation),
        ("stream", agentkv.ConversationStream, agentkv.AsyncConversationStream),
        ("pool", pool.SyncPool, pool.AsyncPool),
    ],
)
def test_twins_have_the_same_public_names(what: str, sync: type, asynchronous: type) -> None:
    sync_only, async_only = ONLY[what]
    assert public(sync) - public(asynchronous) == sync_only
    assert public(asynchronous) - public(sync) == async_only


def test_streams_are_context_managers() -> None:
    assert hasattr(agentkv.ConversationStream, "__enter__")
    assert hasattr(agentkv.ConversationStream, "__exit__")
    assert hasattr(agentkv.AsyncConversationStream, "__aenter__")
    assert hasattr(agentkv.AsyncConversationStream, "__aexit__")


def test_pool_runs_on_the_twins() -> None:
    p = pool.ConversationPool(model="m", client=lambda: None, async_client=lambda: None)  # type: ignore[arg-type,return-value]
    assert p.run == p.sync.run and p.arun == p.aio.run
    assert p.stream == p.sync.stream and p.astream == p.aio.stream


# Objects with a sync ``close()`` (the sync side) and an async ``aclose()`` (both sides).
MIXED = {"ConversationPool"}


def test_every_async_object_closes_by_both_spellings() -> None:
    """``aclose()`` (httpx, the standard library's async generators and ``aclosing``) and
    ``close()`` (``openai.AsyncOpenAI``'s spelling) are one coroutine on every async object."""
    found = {getattr(agentkv, name) for name in agentkv.__all__} | {
        getattr(pool, name) for name in dir(pool) if not name.startswith("_")
    }
    closable = {
        cls
        for cls in found
        if isinstance(cls, type)
        and cls.__module__.startswith("agentkv")
        and any(inspect.iscoroutinefunction(getattr(cls, n, None)) for n in ("close", "aclose"))
    }
    mixed = {cls.__name__ for cls in closable if not inspect.iscoroutinefunction(cls.close)}
    assert mixed == MIXED
    both = closable - {getattr(pool, name) for name in MIXED}
    assert {cls.__name__ for cls in both} >= {
        "AsyncClient",
        "AsyncConversation",
        "AsyncConversationStream",
        "AsyncRemoteRenderer",
        "AsyncPool",
    }
    for cls in both:
        assert cls.close is cls.aclose, cls.__name__
