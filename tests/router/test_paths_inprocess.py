"""Decode in place when D fails, in-process (the router and simulators in one event loop): what
the driver reports of D's failure takes the turn core's fault rows (``PATH_ROWS`` in
``test_turn_core.py``) — D refusing passes its error on and keeps the handle, D answering 503
leaves its KV to read back through P, D unreachable makes P recompute; never wrong KV. And
``paths = "pull"`` never decodes in place."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import pytest

from tests._support.inprocess_stack import D_PORT, InProcessStack, Sim, inprocess_stack

pytestmark = pytest.mark.anyio

FIRST = list(range(1000, 1200))


async def turn(s: InProcessStack, ids: list[int], conv: str = "c") -> httpx.Response:
    return await s.http.post(
        f"{s.router.url}/v1/chat/completions",
        json={
            "model": "agentkv-sim",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 8,
            "kv_transfer_params": {"prompt_token_ids": ids},
            "return_token_ids": True,
        },
        headers={"X-Conversation-Id": conv},
    )


async def first_turn(s: InProcessStack) -> tuple[list[int], Sim, Sim]:
    """The conversation's first turn; the prompt of its second (a few tokens more), the D that
    holds it and the other D."""
    r = await turn(s, FIRST)
    assert r.headers["x-agentkv-decision"] == "miss"
    held = [*FIRST, *r.json()["choices"][0]["token_ids"]]
    holder = next(d for d in s.decode if s.retained(d) == 1)
    other = next(d for d in s.decode if d is not holder)
    return [*held, 7, 8, 9], holder, other


@pytest.fixture
def stack_args() -> dict[str, Any]:
    return {"d_args": ({}, {}), "router": {"paths": {"mode": "choose"}}}


async def test_d_refuses_the_turn_its_error_passes_and_the_handle_stays(stack_args) -> None:
    async with inprocess_stack(**stack_args) as s:
        ids, holder, _ = await first_turn(s)
        holder.state.faults.fail_status = 400
        holder.state.faults.fail_next = 1
        r = await turn(s, ids)
        assert r.status_code == 400 and "error" in r.json()
        r = await turn(s, ids)  # the handle was put back: the same turn decodes in place
        assert r.headers["x-agentkv-decision"] == "decode", dict(r.headers)
        assert s.wrong_kv() == 0


async def test_d_answers_503_its_kv_is_read_back_through_p_for_the_other_d(stack_args) -> None:
    async with inprocess_stack(**stack_args) as s:
        ids, holder, other = await first_turn(s)
        holder.state.faults.fail_status = 503
        holder.state.faults.fail_next = 1
        before = s.metrics(other).get("vllm:prompt_tokens_total", 0.0)
        r = await turn(s, ids)
        assert r.status_code == 200
        assert r.headers["x-agentkv-decision"] == "pull", dict(r.headers)
        assert int(r.headers["x-agentkv-reused-tokens"]) >= len(FIRST)
        assert s.metrics(other)["vllm:prompt_tokens_total"] - before == len(ids)
        metrics = (await s.http.get(f"{s.router.url}/metrics")).text
        assert 'agentkv_router_retries_total{reason="decode_in_place"} 1.0' in metrics
        assert s.wrong_kv() == 0


async def test_d_unreachable_p_recomputes_for_the_other_d(stack_args) -> None:
    async with inprocess_stack(**stack_args) as s:
        ids, holder, other = await first_turn(s)
        port = D_PORT + s.decode.index(holder)
        s.transport.apps.pop(port)  # nothing listens there any more
        r = await turn(s, ids)
        assert r.status_code == 200
        assert r.headers["x-agentkv-decision"] == "recompute", dict(r.headers)
        assert s.retained(other) == 1
        assert s.wrong_kv() == 0


async def test_paths_pull_never_decodes_in_place() -> None:
    async with inprocess_stack(d_args=({}, {}), router={"paths": {"mode": "pull"}}) as s:
        ids, decisions = list(FIRST), []
        for new in (0, 30, 5):
            ids = [*ids, *range(3000, 3000 + new)]
            r = await turn(s, ids)
            decisions.append(r.headers["x-agentkv-decision"])
            assert "x-agentkv-runner-up" not in r.headers
            ids = [*ids, *r.json()["choices"][0]["token_ids"]]
        assert decisions == ["miss", "pull", "pull"]
        assert s.wrong_kv() == 0


async def test_a_decode_turn_in_the_metrics_the_span_and_the_log(otel, caplog) -> None:
    async with inprocess_stack(d_args=({}, {}), router={"paths": {"mode": "choose"}}) as s:
        ids, holder, _ = await first_turn(s)
        otel.spans.clear()
        with caplog.at_level(logging.INFO, logger="agentkv.router"):
            r = await turn(s, ids)
        assert r.headers["x-agentkv-decision"] == "decode"
        found = int(r.headers["x-agentkv-decode-cached-tokens"])
        metrics = (await s.http.get(f"{s.router.url}/metrics")).text
        assert 'agentkv_router_requests_total{decision="decode",endpoint="chat"} 1.0' in metrics
        (span,) = [x for x in otel.spans.get_finished_spans() if x.name == "agentkv.router.turn"]
        attrs = dict(span.attributes or {})
        assert attrs["agentkv.decision"] == "decode" and attrs["agentkv.prefill.url"] == ""
        assert attrs["agentkv.decode.url"] == holder.url
        assert attrs["agentkv.decode.cached_tokens"] == found
        assert attrs["agentkv.path.runner_up"] == r.headers["x-agentkv-runner-up"]
        assert attrs["agentkv.path.estimate_ms"] == pytest.approx(
            float(r.headers["x-agentkv-path-estimate-ms"]), abs=0.05
        )
        (line,) = [m for m in caplog.messages if m.startswith("turn ")]
        assert "decision=decode" in line and "prefill=-" in line and f"found={found}" in line


async def test_a_d_restarted_under_a_decode_turn_is_not_sent_the_old_handle_s_release() -> None:
    async with inprocess_stack(d_args=({}, {}), router={"paths": {"mode": "choose"}}) as s:
        ids, holder, _ = await first_turn(s)
        holder.state.config.engine_id = "restarted"  # D answers as another engine from now on
        before = s.metrics(s.prefill[0]).get("vllm:prompt_tokens_total", 0.0)
        r = await turn(s, ids)
        assert r.headers["x-agentkv-decision"] == "decode"
        await anyio.sleep(0.2)  # releases run in the background
        metrics = (await s.http.get(f"{s.router.url}/metrics")).text
        assert 'reason="superseded"' not in metrics  # the new engine never had that request
        assert s.metrics(s.prefill[0]).get("vllm:prompt_tokens_total", 0.0) == before
