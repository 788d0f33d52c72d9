"""The upstream client: /tokenize is retried like the prefill call (in-process, the engine
client's fake in front of a /tokenize app, its first calls refused)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentkv.protocol.errors import APIError
from agentkv.router.config import RouterConfig
from agentkv.router.http import Body, Headers, Pool, Reply, TransportError
from agentkv.router.metrics import RouterMetrics
from agentkv.router.pd import Router
from agentkv.router.request import parse_request
from agentkv.router.store import make_store
from agentkv.router.upstream import EnginePool
from tests._support.engine_client import InProcessEngine

CONFIG = RouterConfig.model_validate(
    {"upstream": {"prefill": [{"url": "http://p:1"}], "decode": [{"url": "http://d:2"}]}}
)
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


async def _tokenize(request: Request) -> JSONResponse:
    return JSONResponse({"tokens": [1, 2, 3]})


ENGINE = Starlette(routes=[Route("/tokenize", _tokenize, methods=["POST"])])


def turn_ids(failures: int) -> tuple[list[int] | Exception, int]:
    calls = 0

    class Refusing(InProcessEngine):
        """Its first ``failures`` requests cannot connect."""

        async def post(
            self, path: str, body: Body, *, timeout: float | None = None, headers: Headers = None
        ) -> Reply:
            nonlocal calls
            assert path == "/tokenize"
            calls += 1
            if calls <= failures:
                raise TransportError(f"POST {self.base_url}{path}: connection refused")
            return await super().post(path, body, timeout=timeout, headers=headers)

    def engine_client(url: str, pool: Pool) -> Refusing:
        return Refusing({1: ENGINE, 2: ENGINE}, url, pool)

    async def run() -> list[int] | Exception:
        pool = EnginePool(CONFIG, engine_client=engine_client)
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
    assert calls == CONFIG.upstream.retries + 1
    assert "could not tokenize" in caplog.text
