"""Engines that change or stall under the router (issue 21, items 1, 5 and 8), on real processes:
a D restarted on its own port, a turn only D would refuse, a P that hangs while its health checks
pass, a D that never answers a non-streamed turn. Each test is a row of docs/reliability.md."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv.protocol.promtext import parse_metrics
from agentkv.sim.launch import start_sims
from tests._support.stack import MODEL, Stack, exact, stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

COMMON = ("--time-scale", "0", "--block-size", "16")


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30_000 + 100 for i in range(n)]


def _router_metrics(s: Stack) -> dict[str, float]:
    text = httpx.get(f"{s.router.url}/metrics", timeout=10).text
    return {**parse_metrics(text), **parse_metrics(text, by="reason")}


def _wait_healthy(s: Stack, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{s.router.url}/health", timeout=5).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError("router never healthy again")


def _next(ids: list[int], r: httpx.Response, seed: int) -> list[int]:
    out = r.json()["choices"][0]["token_ids"]
    return [*ids, *out, *_ids(seed, 40)]


def test_a_d_restarted_on_its_port_never_serves_its_predecessors_handles(tmp_path: Path) -> None:
    """vLLM 0.32-like engines read whatever the blocks hold: a handle of the old D read from the
    new one would be wrong KV. The router knows the new engine by its id and drops the old
    handles; the conversations go on and pull again from the new D."""
    compat = (("--compat", "0.32"),)
    # restarted before the router ejects it (an ejection drops a D's handles anyway)
    router = {"upstream": {"eject_after_failures": 1000}}
    with stack(tmp_path, p_args=compat, d_args=compat, router=router) as s:
        convs = {f"restart-{i}": _ids(i, 300 + 16 * i) for i in range(6)}
        for conv, ids in convs.items():
            r = exact(s, conv, ids)
            assert r.status_code == 200, r.text
            convs[conv] = _next(ids, r, 100 + len(ids))
        old = s.decode[0]
        old.process.kill()
        old.process.wait(10)
        s.decode[0] = start_sims(
            [["--role", "decode", *COMMON, "--compat", "0.32"]], ports=[old.port]
        )[0]
        _wait_healthy(s)
        decisions = []
        for conv, ids in convs.items():
            r = exact(s, conv, ids)
            assert r.status_code == 200, r.text
            decisions.append(r.headers["x-agentkv-decision"])
            assert int(r.headers["x-agentkv-reused-tokens"]) == 0
            convs[conv] = _next(ids, r, 200 + len(ids))
        assert "pull" not in decisions, decisions
        assert s.wrong_kv() == 0
        # the new D's handles are the conversations' now: the next turns pull again
        for conv, ids in convs.items():
            r = exact(s, conv, ids)
            assert r.headers["x-agentkv-decision"] == "pull", r.headers
        assert s.wrong_kv() == 0
        m = _router_metrics(s)
        assert m.get("agentkv_router_engine_restarts_total", 0) >= 1
        assert m.get("agentkv_router_handles_dropped_total", 0) >= 6


def _context_stack(tmp: Path, **router: Any) -> Any:
    return stack(tmp, common=(*COMMON, "--max-model-len", "1024"), router=router or None)


@pytest.mark.parametrize("mode", ["exact", "messages", "stream"])
def test_a_turn_past_the_context_is_refused_before_it_spends_the_handle(
    tmp_path: Path, mode: str
) -> None:
    with _context_stack(tmp_path) as s:
        _wait_healthy(s)
        conv = f"ctx-{mode}"
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Tell me about block sizes. " * 20}
        ]

        def turn(max_tokens: int) -> httpx.Response:
            if mode == "exact":
                return exact(s, conv, ids, max_tokens=max_tokens)
            body: dict[str, Any] = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": max_tokens,
                "stream": mode == "stream",
            }
            return httpx.post(
                f"{s.router.url}/v1/chat/completions",
                json=body,
                headers={"X-Conversation-Id": conv},
                timeout=60,
            )

        ids = _ids(1, 300)
        r = turn(20)
        assert r.status_code == 200, r.text
        if mode == "exact":
            ids = _next(ids, r, 7)
        else:
            text = (
                r.json()["choices"][0]["message"]["content"]
                if mode == "messages"
                else _streamed_text(r)
            )
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "And page tables?"},
            ]
        bad = turn(5000)
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "max_tokens"
        assert "maximum context length is 1024 tokens" in error["message"]
        good = turn(20)
        assert good.status_code == 200, good.text
        assert good.headers["x-agentkv-decision"] in ("pull", "local"), good.headers
        assert good.headers["x-agentkv-decision"] != "miss"
        assert int(good.headers["x-agentkv-verified-prefix-tokens"]) > 0
        assert s.wrong_kv() == 0


def _streamed_text(r: httpx.Response) -> str:
    import orjson

    parts = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def test_a_p_that_hangs_while_passing_health_checks_does_not_hold_a_turn(tmp_path: Path) -> None:
    router = {"upstream": {"prefill_deadline_s": 1.5, "prefill_deadline_per_1k_s": 0}}
    with stack(tmp_path, p_args=((), ()), router=router) as s:
        _wait_healthy(s)
        for p in s.prefill:  # whichever P the conversation prefers: both hang, then one recovers
            httpx.post(f"{p.url}/_sim/faults", json={"delay_s": 60}, timeout=10)
        httpx.post(f"{s.prefill[1].url}/_sim/faults", json={"delay_s": 0}, timeout=10)
        started = time.monotonic()
        r = exact(s, "hang-p", _ids(3, 200))
        took = time.monotonic() - started
        assert r.status_code == 200, r.text
        assert took < 10, took
        httpx.post(f"{s.prefill[0].url}/_sim/faults", json={"delay_s": 0}, timeout=10)


def test_a_d_that_never_answers_a_non_streamed_turn_is_passed_over(tmp_path: Path) -> None:
    router = {"upstream": {"decode_first_byte_timeout_s": 1.0, "decode_token_timeout_s": 0.01}}
    with stack(tmp_path, d_args=((), ()), router=router) as s:
        _wait_healthy(s)
        httpx.post(f"{s.decode[0].url}/_sim/faults", json={"delay_s": 60}, timeout=10)
        started = time.monotonic()
        answered = [exact(s, f"stall-d-{i}", _ids(10 + i, 100)) for i in range(3)]
        took = time.monotonic() - started
        assert all(r.status_code == 200 for r in answered), [r.text for r in answered]
        assert took < 15, took
        httpx.post(f"{s.decode[0].url}/_sim/faults", json={"delay_s": 0}, timeout=10)
