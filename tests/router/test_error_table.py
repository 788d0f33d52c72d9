"""Every kind of error, per API: its status and body shape, from the router and the simulator
(in-process, real templates and tokenizer). One error type (``APIError``) is raised everywhere;
the apps' handlers render it as the API the request came in on: OpenAI's ``{"error": {...}}``
(Chat Completions, Completions, Responses, the rest), Anthropic's ``{"type": "error", ...}``
(``/v1/messages``), the simulator's FastAPI ``{"detail": ...}`` for unknown paths, as vLLM."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentkv.protocol.names import RouterMetric
from agentkv.protocol.promtext import parse_metrics
from agentkv.router.memory_store import MemoryStore
from agentkv.router.store import StoreKey, Taken
from tests._support.inprocess_stack import InProcessStack, inprocess_stack

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MSG = {"model": "agentkv-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
BIG = b"x" * 5000  # above the router's max_body_bytes below
PREVIOUS = {"input": "x", "previous_response_id": "resp_no"}
DEEP: dict[str, Any] = {"x": 1}
for _ in range(260):  # deeper than orjson writes (254), which the router must to forward it
    DEEP = {"x": DEEP}
DEEP_MSG = [{"name": "t", "input_schema": {"type": "object", "properties": DEEP}}]
DEEP_R = [{"type": "function", "name": "t", "parameters": {"type": "object", "properties": DEEP}}]
NOT_FOUND = "not_found_error"
NIXL = "/_sim/nixl/read"
Case = tuple[str, str, str, dict[str, Any], int, str, str | None]
"""(server: r|s, method, path, httpx kwargs, status, shape, the error's type; None: not checked)."""

CASES: list[Case] = [
    # the router's own errors
    ("r", "POST", "/v1/chat/completions", {"content": b"{x"}, 400, "openai", "BadRequestError"),
    ("r", "POST", "/v1/completions", {"content": b"[1]"}, 400, "openai", "BadRequestError"),
    ("r", "POST", "/v1/responses", {"content": b"{x"}, 400, "openai", "BadRequestError"),
    ("r", "POST", "/v1/messages", {"content": b"{x"}, 400, "anthropic", "invalid_request_error"),
    ("r", "POST", "/v1/messages/count_tokens", {"json": {}}, 400, "anthropic", None),
    ("r", "POST", "/v1/chat/completions", {"json": {**CHAT, "n": 2}}, 400, "openai", None),
    ("r", "POST", "/v1/chat/completions", {"content": BIG}, 413, "openai", "RequestTooLargeError"),
    ("r", "POST", "/v1/messages", {"content": BIG}, 413, "anthropic", "request_too_large"),
    ("r", "POST", "/v1/responses", {"json": {"input": "x", "tools": 1}}, 400, "openai", None),
    ("r", "POST", "/v1/responses", {"json": PREVIOUS}, 404, "openai", "invalid_request_error"),
    ("r", "GET", "/v1/responses/resp_no", {}, 404, "openai", "invalid_request_error"),
    ("r", "POST", "/v1/chat/completions", {"json": {**CHAT, "x": DEEP}}, 400, "openai", None),
    ("r", "POST", "/v1/messages", {"json": {**MSG, "tools": DEEP_MSG}}, 400, "anthropic", None),
    ("r", "POST", "/v1/responses", {"json": {"input": "x", "tools": DEEP_R}}, 400, "openai", None),
    ("r", "POST", "/v1/conversations/c/lease", {"json": {}}, 400, "openai", "BadRequestError"),
    ("r", "GET", "/nope", {}, 404, "openai", "NotFoundError"),
    ("r", "GET", "/v1/messages", {}, 405, "openai", "MethodNotAllowedError"),
    # an engine's own 4xx: its body unchanged, or as Anthropic's
    ("r", "POST", "/v1/chat/completions", {"json": {**CHAT, "model": "m"}}, 404, "openai", None),
    ("r", "POST", "/v1/messages", {"json": {**MSG, "model": "m"}}, 404, "anthropic", None),
    ("r", "POST", "/detokenize", {"json": {"tokens": [-5]}}, 400, "openai", "BadRequestError"),
    # the simulator, as vLLM answers
    ("s", "POST", "/v1/chat/completions", {"json": {**CHAT, "n": 2}}, 400, "openai", None),
    ("s", "POST", "/v1/completions", {"json": {"prompt": "a", "n": 3}}, 400, "openai", None),
    ("s", "POST", "/v1/messages", {"json": {**MSG, "model": "m"}}, 404, "anthropic", NOT_FOUND),
    ("s", "POST", "/v1/messages", {"content": b"{x"}, 400, "anthropic", "invalid_request_error"),
    ("s", "POST", "/v1/messages/count_tokens", {"json": {}}, 400, "anthropic", None),
    ("s", "POST", "/v1/responses", {"json": PREVIOUS}, 404, "openai", "NotFoundError"),
    ("s", "POST", NIXL, {"json": {"request_id": "x", "block_ids": [1]}}, 410, "openai", None),
    # a raw ValueError (int("a")): 400 with its text, as vLLM's create_error_response
    ("s", "POST", NIXL, {"json": {"request_id": "x", "block_ids": ["a"]}}, 400, "openai", None),
    ("s", "GET", "/nope", {}, 404, "detail", None),
]  # fmt: skip


class BuggyStore(MemoryStore):
    """A real memory store with a bug in one read (a KeyError): not an outage, so the guard
    must let it through and the router answer 500, not a miss."""

    async def candidates(self, key: StoreKey) -> list[Taken]:
        raise KeyError("a bug")


@pytest.fixture
async def st(anyio_backend: str) -> AsyncIterator[InProcessStack]:
    async with inprocess_stack(router={"http": {"max_body_bytes": 4000}}) as stack:
        yield stack


def check_shape(r: httpx.Response, status: int, shape: str, kind: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body: dict[str, Any] = r.json()
    if shape == "openai":
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        got = body["error"]["type"]
    elif shape == "anthropic":
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        got = body["error"]["type"]
    else:
        assert set(body) == {"detail"}
        got = None
    if kind is not None:
        assert got == kind
    assert "Traceback" not in r.text and "localhost:8" not in r.text
    return body


async def test_every_error_kind_in_its_apis_shape(st: InProcessStack) -> None:
    for server, method, path, kwargs, status, shape, kind in CASES:
        base = st.router.url if server == "r" else st.prefill[0].url
        r = await st.http.request(method, base + path, **kwargs)
        check_shape(r, status, shape, kind)
        if status == 413:  # the body was not read to its end: the connection is not reused
            assert r.headers["connection"] == "close"
        if status == 405:
            assert r.headers["allow"]


async def test_an_engine_failure_is_the_clients_error_in_each_api(st: InProcessStack) -> None:
    for s in [*st.prefill, *st.decode]:
        faults = {"fail_next": 3, "fail_status": 400, "fail_message": "refused by the engine"}
        await st.http.post(f"{s.url}/_sim/faults", json=faults)
    for path, body, shape in (
        ("/v1/chat/completions", CHAT, "openai"),
        ("/v1/responses", {"input": "hi"}, "openai"),
        ("/v1/messages", MSG, "anthropic"),
    ):
        r = await st.http.post(st.router.url + path, json=body)
        got = check_shape(r, 400, shape, None)
        assert got["error"]["message"] == "refused by the engine"


async def test_a_bug_is_a_500_in_each_apis_shape_never_a_miss(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "agentkv.router")
    async with inprocess_stack(store=BuggyStore()) as st:
        headers = {"x-conversation-id": "c1"}
        for path, body, shape, kind in (
            ("/v1/chat/completions", CHAT, "openai", "InternalServerError"),
            ("/v1/messages", MSG, "anthropic", "api_error"),
        ):
            r = await st.http.post(st.router.url + path, json=body, headers=headers)
            got = check_shape(r, 500, shape, kind)
            assert got["error"]["message"] == "Internal router error."
        r = await st.http.get(st.router.url + "/metrics")
        failed = parse_metrics(r.text, by="status")
        assert failed[f"{RouterMetric.FAILED_REQUESTS}_total[500]"] == 2
    assert sum("router failure" in m for m in caplog.messages) == 2
    assert "KeyError" in caplog.text
