"""The sync and async twins expose the same public names (modulo the documented ones)."""

from __future__ import annotations

import pytest

import agentkv
from agentkv import pool


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


ONLY = {
    # (sync, async): names only one twin has, each documented in docs/sdk.md
    "client": (set(), set()),
    "conversation": (set(), set()),
    "stream": ({"close"}, {"aclose"}),
    "pool": (set(), set()),
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
