"""Planner v2 on real processes: every verifiable token reused, nothing read across salts, handles
kept through rejected turns, dropped streams and branches; faults degrade to recompute."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests._support.agents import LONG, SYSTEM, TOOLS, agent_turns, client
from tests._support.redis_server import _start, start_redis
from tests._support.stack import MODEL, NO_P_CACHE, exact, held_after, ids_of, stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with stack(tmp_path_factory.mktemp("planner"), p_args=NO_P_CACHE) as s:
        yield s


def test_a_rewrite_with_a_new_epoch_pulls_its_verified_prefix(pd):
    before = pd.wrong_kv()
    with client(pd) as c:
        conv = c.conversation(model=MODEL, system=SYSTEM, tools=TOOLS)
        conv.add_user("Find the bug in module 0.")
        agent_turns(conv, 4)
        conv.strip_reasoning()
        conv.add_user("Continue.")
        conv.create(max_tokens=40)
        r = conv.last_receipt
        assert r.epoch == 1 and r.decision == "pull" and r.trim_cause == "rewrite"
        # everything before the first stripped reasoning is still read back
        assert r.reused_tokens and r.reused_tokens >= 300
        report = conv.compact(lambda msgs: "We read modules 0-3.", keep_last=2)
        conv.add_user("What next?")
        conv.create(max_tokens=40)
        r = conv.last_receipt
        assert r.decision == "pull" and r.trim_cause == "rewrite"
        assert r.rewrite is not None and r.rewrite.surviving_tokens
        # the system prompt survived the summary, and it is what was pulled
        assert r.rewrite.surviving_tokens >= r.reused_tokens > 0
        assert report.surviving_tokens is None or report.surviving_tokens <= r.reused_tokens + 16
    assert pd.wrong_kv() == before


def test_two_agents_on_one_conversation_id_both_pull(pd):
    before = pd.wrong_kv()
    with client(pd) as c:
        planner = c.conversation("shared-thread", model=MODEL, system="You plan. " * 30)
        coder = c.conversation("shared-thread", model=MODEL, system="You write code. " * 30)
        for turn in range(4):
            for conv, name in ((planner, "plan"), (coder, "code")):
                conv.add_user(f"{name} step {turn}")
                conv.create(max_tokens=30, extra_body={"agentkv_sim": {"content": name * 20}})
        for conv in (planner, coder):
            assert [r.decision for r in conv.receipts[1:]] == ["pull"] * 3, conv.receipts
    assert pd.wrong_kv() == before


def test_a_salt_change_never_reads_and_never_says_how_much_matched(pd):
    before = pd.wrong_kv()
    ids = ids_of(pd, LONG)
    r1 = exact(pd, "salted", ids, salt="s1")
    assert r1.status_code == 200
    nxt = [*held_after(r1, ids), *ids_of(pd, [{"role": "user", "content": "more"}])[-8:]]
    r2 = exact(pd, "salted", nxt, salt="s2")
    assert r2.status_code == 200
    assert r2.headers["x-agentkv-decision"] != "pull"
    assert r2.headers["x-agentkv-verified-prefix-tokens"] == "0"
    assert r2.headers["x-agentkv-reused-tokens"] == "0"
    # s1's branch was kept: the next s1 turn still pulls all of it
    r3 = exact(pd, "salted", nxt, salt="s1")
    assert r3.headers["x-agentkv-decision"] == "pull"
    assert int(r3.headers["x-agentkv-verified-prefix-tokens"]) == len(held_after(r1, ids)) - 1
    assert pd.wrong_kv() == before


@pytest.mark.parametrize(
    "bad",
    [
        {"min_tokens": 50, "max_tokens": 10},
        {"ids": [10**9]},
    ],
    ids=["min-over-max", "id-out-of-vocabulary"],
)
def test_a_rejected_turn_keeps_the_handle(pd, bad):
    conv = f"rejected-{next(iter(bad))}"
    ids = ids_of(pd, LONG)
    r1 = exact(pd, conv, ids)
    held = held_after(r1, ids)
    more = ids_of(pd, [{"role": "user", "content": "and"}])[-6:]
    extra = {k: v for k, v in bad.items() if k != "ids"}
    r2 = exact(pd, conv, [*held, *more, *bad.get("ids", [])], **extra)
    assert 400 <= r2.status_code < 500 and "error" in r2.json()
    r3 = exact(pd, conv, [*held, *more])
    assert r3.headers["x-agentkv-decision"] == "pull"
    assert int(r3.headers["x-agentkv-verified-prefix-tokens"]) == len(held) - 1


def test_a_dropped_stream_is_read_to_the_end_and_the_resent_turn_pulls(pd):
    ids = ids_of(pd, LONG)
    r1 = exact(pd, "dropped", ids)
    turn2 = [*held_after(r1, ids), *ids_of(pd, [{"role": "user", "content": "go on"}])[-6:]]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 200,
        "stream": True,
        "kv_transfer_params": {"prompt_token_ids": turn2},
        "agentkv_sim": {"content": "word " * 150},
    }
    held = pd.retained(pd.decode[0])
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"{pd.router.url}/v1/chat/completions",
            json=body,
            headers={"X-Conversation-Id": "dropped"},
        ) as r,
    ):
        assert r.status_code == 200
        next(r.iter_lines())  # one event, then hang up
    # D finishes the turn anyway: its handle is stored, a resent turn pulls it
    deadline = time.monotonic() + 10
    again = None
    while time.monotonic() < deadline:
        again = exact(pd, "dropped", turn2)
        if again.headers["x-agentkv-decision"] == "pull":
            break
        time.sleep(0.2)
    assert again is not None and again.headers["x-agentkv-decision"] == "pull"
    # the dropped turn's own handle (the old one was read by that turn): every full block
    assert int(again.headers["x-agentkv-verified-prefix-tokens"]) == len(turn2) // 16 * 16
    assert pd.retained(pd.decode[0]) <= held + 1


def test_d_dying_mid_stream_ends_in_an_sse_error(tmp_path):
    with stack(tmp_path, p_args=NO_P_CACHE) as s:
        httpx.post(f"{s.decode[0].url}/_sim/faults", json={"cut_stream_after": 3})
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 50,
            "stream": True,
            "agentkv_sim": {"content": "word " * 40},
        }
        with httpx.stream("POST", f"{s.router.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == 502 and error["type"] and "broke" in error["message"]


def test_a_stalled_d_is_passed_over_within_the_first_byte_deadline(tmp_path):
    with stack(
        tmp_path,
        p_args=NO_P_CACHE,
        d_args=((), ()),
        router={"upstream": {"decode_first_byte_timeout_s": 2.0, "health_interval_s": 0.5}},
    ) as s:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 10,
            "stream": True,
        }
        os.kill(s.decode[0].process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for _ in range(3):
                with httpx.stream(
                    "POST", f"{s.router.url}/v1/chat/completions", json=body, timeout=30
                ) as r:
                    assert r.status_code == 200
                    assert [ln for ln in r.iter_lines() if ln][-1] == "data: [DONE]"
            assert time.monotonic() - started < 20
        finally:
            os.kill(s.decode[0].process.pid, signal.SIGCONT)


def test_redis_dying_under_traffic_costs_reuse_not_answers(tmp_path: Path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    process = _start(binary, tmp_path)
    port = process.port
    url = f"redis://127.0.0.1:{port}/0"
    try:
        router = {"store": {"backend": url, "open_s": 0.5}}
        with stack(tmp_path, p_args=NO_P_CACHE, router=router) as s:
            ids = ids_of(s, LONG)
            statuses: list[int] = []
            for i in range(6):
                statuses.append(exact(s, f"r{i}", ids).status_code)
            process.stop(5)
            for i in range(12):
                r = exact(s, f"r{i % 6}", ids)
                statuses.append(r.status_code)
            health = httpx.get(f"{s.router.url}/health").json()
            assert health["store"] == "degraded"
            metrics = httpx.get(f"{s.router.url}/metrics").text
            assert "agentkv_router_store_errors_total" in metrics
            # Redis is back on the same port: reuse resumes on fresh connections
            process = start_redis(binary, tmp_path, port=port)
            time.sleep(1.0)
            for i in range(6):
                statuses.append(exact(s, f"back{i}", ids).status_code)
            again = exact(s, "back0", held_after(exact(s, "back0", ids), ids))
            assert again.headers["x-agentkv-decision"] == "pull"
            assert httpx.get(f"{s.router.url}/health").json()["store"] == "ok"
            assert set(statuses) == {200}
    finally:
        process.stop(5)


def test_one_tenants_conversations_never_evict_another_tenants_handle(tmp_path):
    tenants = [
        {"name": "quiet", "api_keys": ["key-quiet"]},
        {"name": "noisy", "api_keys": ["key-noisy"]},
    ]
    router = {"tenancy": {"tenants": tenants}, "store": {"max_entries_per_tenant": 5}}
    with stack(tmp_path, p_args=NO_P_CACHE, router=router) as s:
        ids = ids_of(s, LONG)

        def turn(key: str, conv: str, prompt: list[int]) -> httpx.Response:
            return exact(s, conv, prompt, headers={"Authorization": f"Bearer {key}"}, max_tokens=10)

        first = turn("key-quiet", "mine", ids)
        assert first.status_code == 200
        for i in range(25):
            assert turn("key-noisy", f"theirs-{i}", ids).status_code == 200
        again = turn("key-quiet", "mine", held_after(first, ids))
        assert again.headers["x-agentkv-decision"] == "pull"
        # and the noisy tenant's own bound held: only its 5 newest conversations still pull
        late = turn("key-noisy", "theirs-0", ids)
        assert late.headers["x-agentkv-decision"] == "miss"
