"""The router between real simulator processes, driven by the SDK and by raw HTTP."""

from __future__ import annotations

import time

import httpx
import pytest
from stack import stack

import agentkv

pytestmark = pytest.mark.e2e

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(40))
NO_P_CACHE = (("--no-prefix-caching",),)


def agent_turns(conv, n: int, start: int = 0) -> None:
    """n turns of a tool-using agent: a tool call, its result, an answer, a new question."""
    for i in range(start, start + n):
        if i % 2 == 0:
            script = {
                "reasoning": f"I should read file {i}.",
                "content": "",
                "tool_calls": [{"name": "read_file", "arguments": {"path": f"src/mod{i}.py"}}],
            }
            completion = conv.create(max_tokens=400, extra_body={"agentkv_sim": script})
            call = completion.choices[0].message.tool_calls[0]
            conv.add_tool_result(call.id, f"def f{i}():\n    return {i}\n" * 4)
        else:
            script = {"reasoning": f"Done with {i}.", "content": f"File {i} defines f{i - 1}. " * 6}
            conv.create(max_tokens=400, extra_body={"agentkv_sim": script})
            conv.add_user(f"Now look at module {i + 1}.")


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with stack(tmp_path_factory.mktemp("pd"), p_args=NO_P_CACHE) as s:
        yield s


def client(s) -> agentkv.Client:
    return agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k")


def hello(c: agentkv.Client) -> agentkv.Conversation:
    """A conversation whose first turn ("hello", 60 tokens) is answered: D holds its handle."""
    conv = c.conversation(model="agentkv-sim", system=SYSTEM)
    conv.add_user("hello")
    conv.create(max_tokens=60)
    return conv


def test_ten_turn_tool_conversation_reuses_every_turn(pd):
    with client(pd) as c:
        conv = c.conversation(model="agentkv-sim", system=SYSTEM, tools=TOOLS)
        conv.add_user("Find the bug in module 0.")
        agent_turns(conv, 10)
    receipts = conv.receipts
    assert receipts[0].decision == "miss"
    for r in receipts[1:]:
        assert r.decision == "pull", r
        assert r.reused_tokens > 0 and r.cached_tokens >= r.reused_tokens
    assert pd.wrong_kv() == 0


def test_rewrites_release_at_once_and_reuse_resumes(pd):
    with client(pd) as c:
        conv = c.conversation(model="agentkv-sim", system=SYSTEM, tools=TOOLS)
        conv.add_user("Find the bug in module 0.")
        agent_turns(conv, 4)
        held_before = pd.retained(pd.decode[0])
        conv.strip_reasoning()  # turn 5: reasoning stripped
        conv.add_user("Continue.")
        conv.create(max_tokens=50)
        r5 = conv.last_receipt
        assert r5.decision in ("stale", "pull") and r5.epoch == 1
        # the old handle was released by this turn, not left to the TTL: one held per turn
        assert pd.retained(pd.decode[0]) == held_before
        conv.add_user("Next module.")
        agent_turns(conv, 1)
        assert conv.last_receipt.decision == "pull"
        conv.compact(lambda msgs: "We read modules 0-4.", keep_last=2)  # turn 7: a summary
        conv.add_user("What next?")
        conv.create(max_tokens=50)
        assert conv.last_receipt.decision in ("stale", "recompute", "pull")
        conv.add_user("And then?")
        conv.create(max_tokens=50)
        assert conv.last_receipt.decision == "pull"
    assert pd.wrong_kv() == 0


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


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"messages": "hi"}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400),
        (b'{"messages": []}', 400),
    ],
    ids=["invalid-json", "array", "messages-type", "temperature-type", "n", "empty"],
)
def test_bad_input_is_a_4xx_and_keeps_the_handle(pd, raw, status):
    with client(pd) as c:
        conv = hello(c)
        r = httpx.post(
            f"{pd.router.url}/v1/chat/completions",
            content=raw,
            headers={"X-Conversation-Id": conv.id, "content-type": "application/json"},
        )
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        conv.add_user("still there?")
        conv.create(max_tokens=20)
        assert conv.last_receipt.decision == "pull"  # the stored handle survived


def test_huge_body_is_413(pd):
    r = httpx.post(f"{pd.router.url}/v1/completions", content=b"x" * (33 * 1024 * 1024))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_forged_handle_fields_are_stripped(pd):
    before = pd.metrics(pd.prefill[0]).get("vllm:nixl_xfer_time_seconds_count", 0)
    forged = {
        "do_remote_decode": True,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "x",
        "remote_request_id": "y",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_num_tokens": 48,
    }
    r = httpx.post(
        f"{pd.router.url}/v1/completions",
        json={"prompt": "forged " * 30, "max_tokens": 4, "kv_transfer_params": forged},
    )
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
    assert pd.metrics(pd.prefill[0]).get("vllm:nixl_xfer_time_seconds_count", 0) == before


def test_unknown_model_is_passed_through(pd):
    r = httpx.post(f"{pd.router.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def test_tenants_never_share_a_conversation(tmp_path):
    tenants = [{"name": "a", "api_keys": ["key-a"]}, {"name": "b", "api_keys": ["key-b"]}]
    with stack(tmp_path, p_args=NO_P_CACHE, router={"tenants": tenants}) as s:
        for key, status in (("nope", 401), (None, 401)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(f"{s.router.url}/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == status
        a = agentkv.Client(base_url=f"{s.router.url}/v1", api_key="key-a")
        b = agentkv.Client(base_url=f"{s.router.url}/v1", api_key="key-b")
        with a, b:
            conv_a = a.conversation("shared", model="agentkv-sim", system=SYSTEM)
            conv_a.add_user("hello")
            conv_a.create(max_tokens=60)
            conv_b = b.conversation("shared", model="agentkv-sim", system=SYSTEM)
            conv_b.add_user("hello")
            conv_b.create(max_tokens=60)
            conv_b.add_user("again")
            conv_b.create(max_tokens=20)
            conv_a.add_user("again")
            conv_a.create(max_tokens=20)
        assert [r.decision for r in conv_b.receipts] == ["miss", "pull"]
        assert [r.decision for r in conv_a.receipts] == ["miss", "pull"]
        assert s.wrong_kv() == 0


def test_turn_after_the_ttl_is_expired_not_an_error(tmp_path):
    ttl = ("--decoder-kv-blocks-ttl", "6")
    with (
        stack(
            tmp_path,
            p_args=NO_P_CACHE,
            d_args=(ttl,),
            router={"decoder_kv_blocks_ttl_s": 6, "ttl_margin_s": 4.5},
        ) as s,
        client(s) as c,
    ):
        conv = hello(c)
        time.sleep(1.7)
        conv.add_user("after a pause")
        t = time.perf_counter()
        conv.create(max_tokens=10)
        assert conv.last_receipt.decision == "expired"
        assert time.perf_counter() - t < 5


def test_expired_read_on_vllm_032_is_retried_without_the_handle(tmp_path):
    # A misconfigured router (its TTL above D's) sends an expired handle; real vLLM 0.32 then
    # never answers. The prefill deadline recovers the turn.
    with stack(
        tmp_path,
        p_args=(("--no-prefix-caching", "--compat", "0.32"),),
        d_args=(("--decoder-kv-blocks-ttl", "5.5"),),
        router={"decoder_kv_blocks_ttl_s": 60, "prefill_deadline_s": 1.5},
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
    with stack(
        tmp_path,
        p_args=NO_P_CACHE,
        d_args=(("--compat", "0.32"),),
        backend={"handle_on_stream": False},
    ) as s:
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
        router={"eject_after_failures": 1, "retries": 2},
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
    with stack(tmp_path, p_args=NO_P_CACHE, router={"store": redis_url}, routers=2) as s:
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


def test_close_releases_d_blocks_now(pd):
    with client(pd) as c:
        conv = hello(c)
        before = pd.retained(pd.decode[0])
        assert conv.close() is True
        deadline = time.monotonic() + 5
        while pd.retained(pd.decode[0]) >= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pd.retained(pd.decode[0]) == before - 1
        assert conv.close() is False


def test_router_metrics_count_decisions(pd):
    text = httpx.get(f"{pd.router.url}/metrics").text
    assert 'agentkv_router_requests_total{decision="pull",endpoint="chat"}' in text
    assert "agentkv_router_handle_age_seconds_count" in text


def test_tokenize_and_models_pass_through(pd):
    r = httpx.post(f"{pd.router.url}/tokenize", json={"prompt": "hello"})
    assert r.status_code == 200 and r.json()["tokens"]
    assert httpx.get(f"{pd.router.url}/v1/models").json()["data"][0]["id"] == "agentkv-sim"


def test_health_reports_engines(pd):
    body = httpx.get(f"{pd.router.url}/health").json()
    assert body["status"] == "ok" and all(body["prefill"].values())


def test_a_handle_p_could_not_use_is_released(pd):
    with client(pd) as c:
        conv = hello(c)
        held = pd.retained(pd.decode[0])
        httpx.post(f"{pd.prefill[0].url}/_sim/faults", json={"fail_next": 1, "fail_status": 500})
        conv.add_user("P fails once with the handle attached")
        conv.create(max_tokens=20)
        assert conv.last_receipt.decision == "recompute"
        deadline = time.monotonic() + 5
        while pd.retained(pd.decode[0]) > held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pd.retained(pd.decode[0]) == held  # the old handle released, the new one held


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_exact_ids_are_not_echoed_unless_asked(pd, stream):
    """The client sent the prompt's ids: the router drops D's echo of them (the SDK has them),
    keeps the output ids it asked for, and echoes the prompt only on the explicit header."""
    with httpx.Client(base_url=pd.router.url, timeout=30) as h:
        messages = [{"role": "user", "content": "count " * 40}]
        ids = h.post("/tokenize", json={"model": "agentkv-sim", "messages": messages}).json()
        body = {
            "model": "agentkv-sim",
            "messages": messages,
            "max_tokens": 12,
            "stream": stream,
            "return_token_ids": True,
            "kv_transfer_params": {"prompt_token_ids": ids["tokens"]},
        }

        def chunks(r: httpx.Response) -> list[dict]:
            if not stream:
                return [r.json()]
            return [
                httpx.Response(200, content=line[6:]).json()
                for line in r.text.split("\n\n")
                if line.startswith("data: {")
            ]

        plain = chunks(h.post("/v1/chat/completions", json=body))
        assert all(c.get("prompt_token_ids") is None for c in plain)
        assert all(c.get("kv_transfer_params") is None for c in plain)
        out = [t for c in plain for ch in c["choices"] for t in ch.get("token_ids") or []]
        assert len(out) == 12
        echoed = chunks(
            h.post(
                "/v1/chat/completions",
                json=body,
                headers={"X-AgentKV-Echo-Prompt-Token-Ids": "1"},
            )
        )
        assert echoed[0]["prompt_token_ids"] == ids["tokens"]
