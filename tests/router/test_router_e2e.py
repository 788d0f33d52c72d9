"""The router between real simulator processes, driven by the SDK and by raw HTTP: what needs
real processes (streams relayed as they come, a hung engine, killed engines, Redis shared by two
routers). Everything else runs in-process in ``test_router_inprocess.py``."""

from __future__ import annotations

import time

import httpx
import pytest

import agentkv
from tests._support.agents import SYSTEM, client
from tests._support.stack import NO_P_CACHE, stack, vllm_032_stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with stack(tmp_path_factory.mktemp("pd"), p_args=NO_P_CACHE) as s:
        yield s


def hello(c: agentkv.Client) -> agentkv.Conversation:
    """A conversation whose first turn ("hello", 60 tokens) is answered: D holds its handle."""
    conv = c.conversation(model="agentkv-sim", system=SYSTEM)
    conv.add_user("hello")
    conv.create(max_tokens=60)
    return conv


def test_streaming_clients_get_reuse_and_no_internal_fields(pd):
    with httpx.Client(base_url=pd.router.url, timeout=30) as h:
        body = {
            "model": "agentkv-sim",
            "messages": [{"role": "user", "content": "hi " * 50}],
            "max_tokens": 80,
            "stream": True,
        }
        headers = {"X-Conversation-Id": "stream-1"}
        first = h.post("/v1/chat/completions", json=body, headers=headers)
        assert 'kv_transfer_params":{' not in first.text and 'token_ids":[' not in first.text
        assert first.text.endswith("data: [DONE]\n\n")
        answer = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in (
                httpx.Response(200, content=line[6:]).json()
                for line in first.text.split("\n\n")
                if line.startswith("data: {")
            )
            if c["choices"]
        )
        body["messages"] += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "more"},
        ]
        second = h.post("/v1/chat/completions", json=body, headers=headers)
        assert second.headers["x-agentkv-decision"] in ("pull", "stale")
        assert second.status_code == 200


def test_expired_read_on_vllm_032_is_retried_without_the_handle(tmp_path):
    # A misconfigured router (its TTL above D's) sends an expired handle; real vLLM 0.32 then
    # never answers. The prefill deadline recovers the turn.
    with stack(
        tmp_path,
        p_args=(("--no-prefix-caching", "--compat", "0.32"),),
        d_args=(("--decoder-kv-blocks-ttl", "5.5"),),
        router={
            "retention": {"decoder_kv_blocks_ttl_s": 60},
            "upstream": {"prefill_deadline_s": 1.5},
        },
    ) as s:
        with client(s) as c:
            conv = hello(c)
            time.sleep(1.0)  # within 5 s of D's expiry: P declines the read and hangs
            conv.add_user("late")
            t = time.perf_counter()
            conv.create(max_tokens=10)
            assert time.perf_counter() - t < 10
            assert conv.last_receipt.decision == "recompute"
        assert s.wrong_kv() == 0


def test_vllm_032_streams_keep_reuse_with_buffered_decode(tmp_path):
    with vllm_032_stack(tmp_path) as s:
        with client(s) as c:
            conv = c.conversation(model="agentkv-sim", system=SYSTEM)
            for i in range(3):
                conv.add_user(f"question {i}")
                list(conv.create(max_tokens=60, stream=True))
        assert [r.decision for r in conv.receipts] == ["miss", "pull", "pull"]
        assert all(r.completion_tokens > 0 for r in conv.receipts)


def test_killed_engines_degrade_to_recompute(tmp_path):
    with stack(
        tmp_path,
        p_args=NO_P_CACHE * 2,
        d_args=((), ()),
        router={"upstream": {"eject_after_failures": 1, "retries": 2}},
    ) as s:
        with client(s) as c:
            convs = [c.conversation(model="agentkv-sim", system=SYSTEM) for _ in range(4)]
            for conv in convs:
                conv.add_user("hello")
                conv.create(max_tokens=40)
            s.prefill[0].process.kill()
            s.decode[0].process.kill()
            for turn in range(2):
                for conv in convs:
                    conv.add_user(f"turn {turn}")
                    conv.create(max_tokens=20)
                    assert conv.last_receipt.completion_tokens > 0
        health = httpx.get(f"{s.router.url}/health").json()
        assert list(health["prefill"].values()).count(False) == 1


def test_two_routers_share_handles_through_redis(tmp_path, redis_url):
    with stack(
        tmp_path, p_args=NO_P_CACHE, router={"store": {"backend": redis_url}}, routers=2
    ) as s:
        clients = [agentkv.Client(base_url=f"{r.url}/v1", api_key="k") for r in s.routers]
        ledger_state = None
        decisions = []
        for turn in range(4):
            c = clients[turn % 2]
            conv = (
                c.resume(ledger_state)
                if ledger_state
                else c.conversation("shared-redis", model="agentkv-sim", system=SYSTEM)
            )
            conv.add_user(f"turn {turn}")
            conv.create(max_tokens=60)
            decisions.append(conv.last_receipt.decision)
            ledger_state = conv.to_state()
        for c in clients:
            c.close()
        assert decisions == ["miss", "pull", "pull", "pull"]
        assert s.wrong_kv() == 0
