"""The upstream client: /tokenize is retried like the prefill call (in-process, httpx mock)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from agentkv.protocol.errors import APIError
from agentkv.router.config import RouterConfig
from agentkv.router.metrics import RouterMetrics
from agentkv.router.pd import Router
from agentkv.router.request import parse_request
from agentkv.router.store import make_store
from agentkv.router.upstream import EnginePool

CONFIG = RouterConfig(prefill=[{"url": "http://p:1"}], decode=[{"url": "http://d:2"}])
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def turn_ids(failures: int) -> tuple[list[int] | Exception, int]:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        assert request.url.path == "/tokenize"
        calls += 1
        if calls <= failures:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"tokens": [1, 2, 3]})

    async def run() -> list[int] | Exception:
        pool = EnginePool(CONFIG, transport=httpx.MockTransport(handler))
        router = Router(CONFIG, pool, make_store("memory"), RouterMetrics())
        req = parse_request(BODY, {}, chat=True, config=CONFIG)
        try:
            return await router.prompt_ids(req)
        except APIError as exc:
            return exc
        finally:
            await pool.aclose()

    return asyncio.run(run()), calls


def test_one_connection_error_on_the_only_p_does_not_fail_the_turn() -> None:
    ids, calls = turn_ids(failures=1)
    assert ids == [1, 2, 3] and calls == 2


def test_tokenize_gives_up_after_the_retries_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agentkv.router"):
        result, calls = turn_ids(failures=10)
    assert isinstance(result, APIError) and result.status == 503
    assert calls == CONFIG.retries + 1
    assert "could not tokenize" in caplog.text
