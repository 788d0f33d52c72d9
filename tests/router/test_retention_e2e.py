"""Leases, KV pressure and P's KV events on real processes (router + simulators on loopback)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from agentkv.sim.launch import free_port, start_sims
from tests._support.agents import LONG
from tests._support.stack import (
    MODEL,
    NO_P_CACHE,
    Stack,
    exact,
    held_after,
    ids_of,
    stack,
    start_router,
)

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]


def wait_until(fn, timeout_s: float = 10.0, step_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(step_s)
    return bool(fn())


def test_a_lapsed_lease_frees_d_at_once_and_a_renewed_one_keeps_it(tmp_path):
    # D keeps blocks for an hour: only the lease frees them early
    with stack(
        tmp_path,
        p_args=NO_P_CACHE,
        d_args=(("--decoder-kv-blocks-ttl", "3600"),),
        router={"retention": {"decoder_kv_blocks_ttl_s": 3600, "lease_check_interval_s": 0.2}},
    ) as s:
        ids = ids_of(s, LONG)
        lease = {"X-AgentKV-Lease": "4"}
        alive = exact(s, "live-agent", ids, headers=lease)
        gone = exact(s, "dead-agent", ids, headers=lease)
        started = time.monotonic()
        assert gone.status_code == alive.status_code == 200
        assert s.retained(s.decode[0]) == 2

        def renew() -> None:  # as the SDK's renewer does, through a wait longer than the lease
            r = httpx.post(
                f"{s.router.url}/v1/conversations/leases",
                json={"lease_s": 4, "ids": ["live-agent"]},
            )
            assert r.status_code == 200 and r.json()["data"][0]["lease_s"] == 4

        while s.retained(s.decode[0]) == 2 and time.monotonic() - started < 12:
            renew()
            time.sleep(0.5)
        freed_after = time.monotonic() - started
        assert s.retained(s.decode[0]) == 1
        assert 3.5 < freed_after < 4 + 4  # within the lease and a few seconds
        while time.monotonic() - started < 10:  # twice the lease: still held
            renew()
            time.sleep(0.5)
        assert s.retained(s.decode[0]) == 1
        nxt = exact(s, "live-agent", held_after(alive, ids), headers=lease)
        assert nxt.headers["x-agentkv-decision"] == "pull"


def test_bad_leases_are_400(tmp_path):
    with stack(tmp_path, p_args=NO_P_CACHE) as s:
        for value in ("0", "-1", "abc", "1e9", "nan"):
            r = exact(s, "c", [1, 2, 3], headers={"X-AgentKV-Lease": value})
            assert r.status_code == 400 and "X-AgentKV-Lease" in r.json()["error"]["message"]
        r = httpx.post(f"{s.router.url}/v1/conversations/c/lease", json={"lease_s": "x"})
        assert r.status_code == 400
        r = httpx.post(f"{s.router.url}/v1/conversations/leases", json={"lease_s": 5, "ids": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ids"


def test_d_under_kv_pressure_releases_retained_blocks_instead_of_starving(tmp_path):
    # 96 blocks of 16 tokens; each conversation retains ~25 of them for an hour
    d_args = (("--num-blocks", "96", "--decoder-kv-blocks-ttl", "3600"),)
    router = {
        "retention": {"decoder_kv_blocks_ttl_s": 3600, "kv_pressure_watermark": 0.5},
        "upstream": {"health_interval_s": 0.2, "request_timeout_s": 60},
    }
    with stack(tmp_path, p_args=NO_P_CACHE, d_args=d_args, router=router) as s:
        statuses = []
        for i in range(12):
            ids = ids_of(s, [{"role": "user", "content": f"Conversation {i}. "}, *LONG])
            statuses.append(exact(s, f"conv-{i}", ids).status_code)
            time.sleep(0.3)  # a pressure check runs between turns
        assert statuses == [200] * 12
        metrics = httpx.get(f"{s.router.url}/metrics").text
        assert 'agentkv_router_handles_released_total{reason="pressure"}' in metrics


def test_receipts_equal_what_p_read_with_its_prefix_cache_on(tmp_path):
    """P's prefix cache on (vLLM's default) and its KV events to the router: the reused tokens
    the receipts claim add up to P's own external_kv_transfer counter. With a replay socket the
    router knows from the start that P holds nothing yet, so no receipt is an estimate."""
    port = free_port()
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{free_port()}",
        "topic": "kv",
    }
    with stack(tmp_path, kv_events=events) as s:
        from tests._support.agents import SYSTEM, TOOLS, agent_turns, client

        before = s.metrics(s.prefill[0])
        with client(s) as c:
            conv = c.conversation(model=MODEL, system=SYSTEM, tools=TOOLS)
            conv.add_user("Find the bug.")
            time.sleep(0.5)  # the subscriber connects
            agent_turns(conv, 10)
        after = s.metrics(s.prefill[0])
        key = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"  # parse_metrics' key
        pulled = after.get(key, 0) - before.get(key, 0)
        claimed = sum(r.reused_tokens or 0 for r in conv.receipts)
        assert not any(r.estimated for r in conv.receipts)
        assert all(r.local_prefix_tokens is not None for r in conv.receipts)
        assert claimed == pulled
        assert s.wrong_kv() == 0


def test_the_p_with_the_longest_local_prefix_is_chosen(tmp_path):
    ports = [free_port(), free_port()]
    events = [
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{p}", "topic": "kv"} for p in ports
    ]
    common = ["--time-scale", "0", "--block-size", "16"]
    sims = start_sims(
        [
            *(["--role", "prefill", *common, "--kv-events-config", json.dumps(e)] for e in events),
            ["--role", "decode", *common],
        ]
    )
    s = Stack(sims[:2], sims[2:])
    try:
        cfg = {
            "upstream": {
                "prefill": [
                    {"url": p.url, "kv_events": e} for p, e in zip(s.prefill, events, strict=True)
                ],
                "decode": [{"url": s.decode[0].url}],
                "block_size": 16,
            }
        }
        s.routers.append(start_router(cfg, tmp_path))
        time.sleep(0.5)
        ids = ids_of(s, LONG)
        # warm one P's prefix cache directly, then route a conversation-less turn
        for p in (s.prefill[1],):
            httpx.post(
                f"{p.url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}
            )
        before = [s.metrics(p).get("vllm:prompt_tokens_total", 0) for p in s.prefill]
        assert wait_until(
            lambda: (
                exact(s, "anyone", [*ids, 1, 2]).headers.get("x-agentkv-local-prefix-tokens")
                not in (None, "0")
            ),
            timeout_s=5,
        )
        after = [s.metrics(p).get("vllm:prompt_tokens_total", 0) for p in s.prefill]
        assert after[1] > before[1]
    finally:
        s.stop()
