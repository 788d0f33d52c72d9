"""``agentkv.adapters``: what the three framework adapters share (no server needed)."""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace
from typing import Any

from openai.types.chat import ChatCompletionMessage
from pydantic import SecretStr

import agentkv
from agentkv.adapters import (
    PoolMethods,
    bind_conversation,
    pool_for,
    reasoning_text,
    turn_metadata,
)


def _settings(**overrides: Any) -> Any:
    values: dict[str, Any] = {
        "model": "m",
        "base_url": "http://127.0.0.1:9/v1",
        "api_key": SecretStr("secret"),
        "timeout": 3.0,
        "retries": 1,
        "lease_s": None,
        "mode": "messages",
        "chat_template_kwargs": {"enable_thinking": False},
        "max_lanes": 3,
    }
    return SimpleNamespace(**{**values, **overrides})


def test_pool_for_builds_the_pool_from_the_settings() -> None:
    pool = pool_for(_settings(), max_keys=7)
    assert (pool.model, pool.mode, pool.max_keys, pool.max_lanes) == ("m", "messages", 7, 3)
    assert pool.chat_template_kwargs == {"enable_thinking": False}
    assert pool.owns_clients == (True, True)
    assert str(pool.client.openai.base_url) == "http://127.0.0.1:9/v1/"
    assert pool.client.openai.api_key == "secret"
    pool.close()


def test_pool_for_keeps_the_given_clients_open() -> None:
    client = agentkv.Client(base_url="http://127.0.0.1:9/v1", api_key="k")
    pool = pool_for(_settings(api_key=None), max_keys=1, client=client)
    assert pool.client is client
    assert pool.owns_clients == (False, True)
    pool.close()
    client.close()


def test_pool_methods_pass_through_to_the_pool() -> None:
    calls: list[Any] = []

    class FakePool:
        def from_state(self, state: Any) -> None:
            calls.append(("from_state", state))

        async def aclose(self) -> None:
            calls.append("aclose")

    class Model(PoolMethods):
        def __init__(self) -> None:
            self._pool = FakePool()  # type: ignore[assignment]

    model = Model()
    assert model.pool is model._pool
    model.from_state({"key": "k"})
    asyncio.run(model.aclose())
    assert calls == [("from_state", {"key": "k"}), "aclose"]


def test_bind_conversation_sets_the_id_inside_the_block_only() -> None:
    var: contextvars.ContextVar[str | None] = contextvars.ContextVar("test_key", default=None)
    with bind_conversation(var, "outer") as outer:
        assert outer == "outer" and var.get() == "outer"
        with bind_conversation(var, "inner"):
            assert var.get() == "inner"
        assert var.get() == "outer"
    assert var.get() is None


def test_turn_metadata_and_reasoning_text() -> None:
    turn: Any = SimpleNamespace(conversation_id="c", kind="append", receipt=None)
    assert turn_metadata(turn) == {"conversation_id": "c", "sync": "append"}
    assert reasoning_text(SimpleNamespace(reasoning="why")) == "why"
    message = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": "x", "reasoning_content": "because"}
    )
    assert reasoning_text(message) == "because"
    assert reasoning_text(SimpleNamespace(reasoning="")) is None
