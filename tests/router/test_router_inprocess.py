"""The router between simulator instances, all in-process (``inprocess_stack``), driven by the
SDK and by raw HTTP. Streaming relays, killed engines and Redis stay on real processes
(``test_router_e2e.py``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

import agentkv
from tests._support.agents import SYSTEM, TOOLS, agent_step
from tests._support.inprocess_stack import InProcessStack, inprocess_stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.anyio, pytest.mark.paths_pull]

NO_P_CACHE = ({"prefix_caching": False},)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def agent_turns(conv: agentkv.AsyncConversation, n: int, start: int = 0) -> None:
    """n turns of a tool-using agent: a tool call, its result, an answer, a new question."""
    for i in range(start, start + n):
        script, tool_result = agent_step(i)
        completion = await conv.create(max_tokens=400, extra_body={"agentkv_sim": script})
        if tool_result is not None:
            call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
            conv.add_tool_result(call.id, tool_result)
        else:
            conv.add_user(f"Now look at module {i + 1}.")


@pytest.fixture(scope="module")
async def pd(anyio_backend: str) -> AsyncIterator[InProcessStack]:
    async with inprocess_stack(p_args=NO_P_CACHE) as s:
        yield s


async def hello(c: agentkv.AsyncClient) -> agentkv.AsyncConversation:
    """A conversation whose first turn ("hello", 60 tokens) is answered: D holds its handle."""
    conv = c.conversation(model="agentkv-sim", system=SYSTEM)
    conv.add_user("hello")
    await conv.create(max_tokens=60)
    return conv


async def test_ten_turn_tool_conversation_reuses_every_turn(pd):
    async with pd.client() as c:
        conv = c.conversation(model="agentkv-sim", system=SYSTEM, tools=TOOLS)
        conv.add_user("Find the bug in module 0.")
        await agent_turns(conv, 10)
    receipts = conv.receipts
    assert receipts[0].decision == "miss"
    for r in receipts[1:]:
        assert r.decision == "pull", r
        assert r.reused_tokens > 0 and r.cached_tokens >= r.reused_tokens
    assert pd.wrong_kv() == 0


async def test_rewrites_release_at_once_and_reuse_resumes(pd):
    async with pd.client() as c:
        conv = c.conversation(model="agentkv-sim", system=SYSTEM, tools=TOOLS)
        conv.add_user("Find the bug in module 0.")
        await agent_turns(conv, 4)
        held_before = pd.retained(pd.decode[0])
        conv.strip_reasoning()  # turn 5: reasoning stripped
        conv.add_user("Continue.")
        await conv.create(max_tokens=50)
        r5 = conv.last_receipt
        assert r5.decision in ("stale", "pull") and r5.epoch == 1
        # the old handle was released by this turn, not left to the TTL: one held per turn
        assert pd.retained(pd.decode[0]) == held_before
        conv.add_user("Next module.")
        await agent_turns(conv, 1)
        assert conv.last_receipt.decision == "pull"
        await conv.compact(lambda msgs: "We read modules 0-4.", keep_last=2)  # turn 7: a summary
        conv.add_user("What next?")
        await conv.create(max_tokens=50)
        assert conv.last_receipt.decision in ("stale", "recompute", "pull")
        conv.add_user("And then?")
        await conv.create(max_tokens=50)
        assert conv.last_receipt.decision == "pull"
    assert pd.wrong_kv() == 0


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
async def test_bad_input_is_a_4xx_and_keeps_the_handle(pd, raw, status):
    async with pd.client() as c:
        conv = await hello(c)
        r = await pd.http.post(
            f"{pd.router.url}/v1/chat/completions",
            content=raw,
            headers={"X-Conversation-Id": conv.id, "content-type": "application/json"},
        )
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        conv.add_user("still there?")
        await conv.create(max_tokens=20)
        assert conv.last_receipt.decision == "pull"  # the stored handle survived


async def test_huge_body_is_413(pd):
    r = await pd.http.post(f"{pd.router.url}/v1/completions", content=b"x" * (33 * 1024 * 1024))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


async def test_forged_handle_fields_are_stripped(pd):
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
    r = await pd.http.post(
        f"{pd.router.url}/v1/completions",
        json={"prompt": "forged " * 30, "max_tokens": 4, "kv_transfer_params": forged},
    )
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None
    assert pd.metrics(pd.prefill[0]).get("vllm:nixl_xfer_time_seconds_count", 0) == before


async def test_unknown_model_is_passed_through(pd):
    r = await pd.http.post(f"{pd.router.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


async def test_tenants_never_share_a_conversation():
    tenants = [{"name": "a", "api_keys": ["key-a"]}, {"name": "b", "api_keys": ["key-b"]}]
    async with inprocess_stack(p_args=NO_P_CACHE, router={"tenancy": {"tenants": tenants}}) as s:
        for key, status in (("nope", 401), (None, 401)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = await s.http.post(
                f"{s.router.url}/v1/completions", json={"prompt": "x"}, headers=headers
            )
            assert r.status_code == status
        async with s.client("key-a") as a, s.client("key-b") as b:
            conv_a = a.conversation("shared", model="agentkv-sim", system=SYSTEM)
            conv_a.add_user("hello")
            await conv_a.create(max_tokens=60)
            conv_b = b.conversation("shared", model="agentkv-sim", system=SYSTEM)
            conv_b.add_user("hello")
            await conv_b.create(max_tokens=60)
            conv_b.add_user("again")
            await conv_b.create(max_tokens=20)
            conv_a.add_user("again")
            await conv_a.create(max_tokens=20)
        assert [r.decision for r in conv_b.receipts] == ["miss", "pull"]
        assert [r.decision for r in conv_a.receipts] == ["miss", "pull"]
        assert s.wrong_kv() == 0


async def test_turn_after_the_ttl_is_expired_not_an_error():
    ttl = {"decoder_kv_blocks_ttl": 6}
    async with (
        inprocess_stack(
            p_args=NO_P_CACHE,
            d_args=(ttl,),
            router={"retention": {"decoder_kv_blocks_ttl_s": 6, "ttl_margin_s": 4.5}},
        ) as s,
        s.client() as c,
    ):
        conv = await hello(c)
        s.advance(1.7)  # the router's store and the engines: past the router's 1.5 s of use
        conv.add_user("after a pause")
        t = time.perf_counter()
        await conv.create(max_tokens=10)
        assert conv.last_receipt.decision == "expired"
        assert time.perf_counter() - t < 5


async def test_close_releases_d_blocks_now(pd):
    async with pd.client() as c:
        conv = await hello(c)
        before = pd.retained(pd.decode[0])
        assert await conv.close() is True
        deadline = time.monotonic() + 5
        while pd.retained(pd.decode[0]) >= before and time.monotonic() < deadline:  # noqa: ASYNC110
            await anyio.sleep(0.05)
        assert pd.retained(pd.decode[0]) == before - 1
        assert await conv.close() is False


async def test_router_metrics_count_decisions(pd):
    text = (await pd.http.get(f"{pd.router.url}/metrics")).text
    assert 'agentkv_router_requests_total{decision="pull",endpoint="chat"}' in text
    assert "agentkv_router_handle_age_seconds_count" in text


async def test_tokenize_and_models_pass_through(pd):
    r = await pd.http.post(f"{pd.router.url}/tokenize", json={"prompt": "hello"})
    assert r.status_code == 200 and r.json()["tokens"]
    models = await pd.http.get(f"{pd.router.url}/v1/models")
    assert models.json()["data"][0]["id"] == "agentkv-sim"


async def test_health_reports_engines(pd):
    body = (await pd.http.get(f"{pd.router.url}/health")).json()
    assert body["status"] == "ok" and all(body["prefill"].values())


async def test_a_handle_p_could_not_use_is_released(pd):
    async with pd.client() as c:
        conv = await hello(c)
        held = pd.retained(pd.decode[0])
        await pd.http.post(
            f"{pd.prefill[0].url}/_sim/faults", json={"fail_next": 1, "fail_status": 500}
        )
        conv.add_user("P fails once with the handle attached")
        await conv.create(max_tokens=20)
        assert conv.last_receipt.decision == "recompute"
        deadline = time.monotonic() + 5
        while pd.retained(pd.decode[0]) > held and time.monotonic() < deadline:  # noqa: ASYNC110
            await anyio.sleep(0.05)
        assert pd.retained(pd.decode[0]) == held  # the old handle released, the new one held


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_exact_ids_are_not_echoed_unless_asked(pd, stream):
    """The client sent the prompt's ids: the router drops D's echo of them (the SDK has them),
    keeps the output ids it asked for, and echoes the prompt only on the explicit header."""
    h = pd.http
    url = pd.router.url
    messages = [{"role": "user", "content": "count " * 40}]
    ids = (
        await h.post(f"{url}/tokenize", json={"model": "agentkv-sim", "messages": messages})
    ).json()
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

    plain = chunks(await h.post(f"{url}/v1/chat/completions", json=body))
    assert all(c.get("prompt_token_ids") is None for c in plain)
    assert all(c.get("kv_transfer_params") is None for c in plain)
    out = [t for c in plain for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert len(out) == 12
    echoed = chunks(
        await h.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"X-AgentKV-Echo-Prompt-Token-Ids": "1"},
        )
    )
    assert echoed[0]["prompt_token_ids"] == ids["tokens"]
