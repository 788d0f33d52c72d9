"""The SDK over real HTTP against a simulator process."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

import agentkv
from agentkv.sim.launch import SimProcess
from tests._support.tools import function_tool

TOOLS = [function_tool("get_weather", "Weather", city="string")]


SLEPT: list[float] = []
NO_SLEEP = agentkv.RetryPolicy(retries=2, sleep=SLEPT.append)
"""Retries that record their waits instead of sleeping."""


@pytest.fixture
def client(sim: SimProcess) -> Iterator[agentkv.Client]:
    with agentkv.Client(base_url=f"{sim.url}/v1", api_key="k", retries=NO_SLEEP) as c:
        yield c


def run_turns(conv, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        conv.add_user(f"question {i}")
        conv.create(max_tokens=24)
        prompts.append(conv._ledger.last_prompt_ids)
    return prompts


def test_exact_turns_extend_previous_prompt_and_output(client):
    conv = client.conversation(model="sim", system="You are terse.")
    history: list[int] = []
    for i in range(4):
        conv.add_user(f"question {i}")
        completion = conv.create(max_tokens=24)
        sent = conv._ledger.last_prompt_ids
        assert sent[: len(history)] == history
        assert completion.model_extra["prompt_token_ids"] == sent  # the server used our ids
        history = conv.token_ids
        assert history == sent + completion.choices[0].model_extra["token_ids"]
    receipt = conv.last_receipt
    assert receipt.turn == 4 and receipt.mode == "exact" and receipt.epoch == 0
    assert receipt.cached_tokens >= 16 * ((len(sent) - 40) // 16)  # prefix cache hit on history


def test_stream_turn_is_recorded_and_usage_chunk_hidden(client):
    conv = client.conversation(model="sim")
    conv.add_user("hi")
    stream = conv.create(max_tokens=12, stream=True)
    chunks = list(stream)
    assert all(ch.choices for ch in chunks)  # the forced usage chunk is not shown
    assert stream.receipt is not None and stream.receipt.completion_tokens == 12
    assert stream.receipt.ttft_s is not None
    assert len(conv.messages) == 2 and conv.token_ids is not None
    conv.add_user("again")
    stream = conv.create(max_tokens=5, stream=True, stream_options={"include_usage": True})
    assert list(stream)[-1].usage.completion_tokens == 5


def test_tool_calls_are_kept_as_generated(client):
    conv = client.conversation(model="sim", tools=TOOLS)
    conv.add_user("Weather in Paris?")
    script = {
        "reasoning": "Need weather.",
        "content": "",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    }
    completion = conv.create(max_tokens=200, extra_body={"agentkv_sim": script})
    call = completion.choices[0].message.tool_calls[0]
    assert completion.choices[0].finish_reason == "tool_calls"
    kept = conv.messages[-1]
    assert kept["reasoning"] == "Need weather."
    assert kept["tool_calls"][0]["id"] == call.id
    assert kept["tool_calls"][0]["function"]["arguments"] == call.function.arguments
    with pytest.raises(agentkv.ConversationError):
        conv.add_tool_result("not-a-call", "x")
    conv.add_tool_result(call.id, "sunny, 21 C")
    conv.create(max_tokens=10)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]


def test_strip_reasoning_rewrites_and_next_turn_renders_fresh(client):
    conv = client.conversation(model="sim", system="s")
    run_turns(conv, 2)
    before = conv.token_ids
    report = conv.strip_reasoning()
    assert report.epoch == 1 and report.surviving_messages == 2  # system + first question
    assert 0 < report.surviving_tokens < len(before)
    assert conv.token_ids is None
    conv.add_user("after the rewrite")
    completion = conv.create(max_tokens=8)
    sent = completion.model_extra["prompt_token_ids"]
    assert sent != before[: len(sent)]  # the reasoning is gone from the prompt
    assert conv.last_receipt.rewrite == report and conv.last_receipt.epoch == 1


def test_compact_keeps_last_messages(client):
    conv = client.conversation(model="sim", system="s")
    run_turns(conv, 3)
    report = conv.compact(lambda msgs: f"{len(msgs)} messages about questions", keep_last=2)
    assert report.reason == "compact"
    assert [m["role"] for m in conv.messages] == ["system", "user", "user", "assistant"]
    conv.add_user("next")
    conv.create(max_tokens=4)
    assert conv.last_receipt.rewrite.reason == "compact"


def test_state_resumes_token_identically(client):
    conv = client.conversation(model="sim")
    run_turns(conv, 2)
    state = conv.to_state()
    again = client.resume(state)
    assert again.id == conv.id and again.token_ids == conv.token_ids
    again.add_user("resumed")
    again.create(max_tokens=4)
    assert again._ledger.last_prompt_ids[: len(conv.token_ids)] == conv.token_ids


def test_retries_503_without_double_append(client, faults):
    conv = client.conversation(model="sim")
    conv.add_user("hi")
    faults.post("/_sim/faults", json={"fail_next": 2, "fail_status": 503})
    conv.create(max_tokens=4)
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]


def test_retry_waits_are_jittered_in_proportion(client, faults):
    conv = client.conversation(model="sim")
    conv.add_user("hi")
    SLEPT.clear()
    faults.post("/_sim/faults", json={"fail_next": 2, "fail_status": 503})
    conv.create(max_tokens=4)
    first, second = SLEPT
    assert 0.05 <= first < 0.15 and 0.1 <= second < 0.3


def test_client_errors_pass_through_and_change_nothing(client, faults):
    conv = client.conversation(model="sim")
    conv.add_user("hi")
    faults.post("/_sim/faults", json={"fail_next": 1, "fail_status": 400})
    with pytest.raises(openai.BadRequestError):
        conv.create(max_tokens=4)
    assert conv.messages == [{"role": "user", "content": "hi"}] and conv.receipts == []
    conv.create(max_tokens=4)
    assert conv.last_receipt.turn == 1


def test_broken_stream_records_nothing(client, faults):
    conv = client.conversation(model="sim")
    conv.add_user("hi")
    faults.post("/_sim/faults", json={"cut_stream_after": 3})
    with pytest.raises(openai.APIConnectionError):
        list(conv.create(max_tokens=20, stream=True))
    assert len(conv.messages) == 1 and conv.token_ids is None


def test_exact_mode_without_tokenize_is_a_clear_error(sim):
    with agentkv.Client(base_url=f"{sim.url}/nothing/v1", api_key="k") as c:
        conv = c.conversation(model="sim")
        conv.add_user("hi")
        with pytest.raises(agentkv.ServerCapabilityError, match="mode='messages'"):
            conv.create(max_tokens=4)
        assert conv.receipts == []


def test_unknown_model_is_the_servers_404(client):
    conv = client.conversation(model="nope")
    conv.add_user("hi")
    with pytest.raises(openai.NotFoundError):
        conv.create(max_tokens=4)


@pytest.mark.parametrize("suffix", ["", "/"])
def test_a_base_url_without_v1_says_so(sim, suffix):
    """The first turn's 404 names the /v1 the base URL lacks (sync and async alike)."""
    with agentkv.Client(base_url=f"{sim.url}{suffix}", api_key="k") as c:
        conv = c.conversation(model="sim")
        conv.add_user("hi")
        with pytest.raises(agentkv.ServerCapabilityError) as caught:
            conv.create(max_tokens=4)
    message = str(caught.value)
    assert f"the base URL {sim.url} has no /v1" in message, message
    assert f"use base_url='{sim.url}/v1'" in message and "answered 404" in message
    assert isinstance(caught.value.__cause__, openai.NotFoundError)
    assert conv.receipts == [] and caught.value.conversation_id == conv.id


@pytest.mark.anyio
async def test_a_base_url_without_v1_says_so_async(sim):
    async with agentkv.AsyncClient(base_url=sim.url, api_key="k") as c:
        conv = c.conversation(model="sim")
        conv.add_user("hi")
        with pytest.raises(agentkv.ServerCapabilityError, match=r"has no /v1"):
            await conv.create(max_tokens=4, stream=True)


def test_close_without_router_returns_false(client):
    conv = client.conversation(model="sim")
    assert conv.close() is False


def test_wrap_an_existing_openai_client(sim):
    oc = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="k")
    with agentkv.wrap(oc) as c:
        conv = c.conversation(model="sim")
        conv.add_user("hi")
        conv.create(max_tokens=4)
        assert conv.last_receipt.completion_tokens == 4
    oc.close()


def test_stream_close_and_with_record_nothing_unfinished(client):
    conv = client.conversation(model="sim")
    conv.add_user("hi")
    with conv.create(max_tokens=20, stream=True) as stream:
        next(iter(stream))
    assert stream.receipt is None and len(conv.messages) == 1 and conv.token_ids is None
    with conv.create(max_tokens=4, stream=True) as stream:
        list(stream)
    assert stream.receipt is not None and len(conv.messages) == 2


@pytest.mark.anyio
async def test_async_stream_aclose_and_async_with(sim):
    async def no_sleep(_s: float) -> None:
        return None

    policy = agentkv.RetryPolicy(retries=1, async_sleep=no_sleep)
    async with agentkv.AsyncClient(base_url=f"{sim.url}/v1", api_key="k", retries=policy) as c:
        conv = c.conversation(model="sim")
        conv.add_user("hi")
        async with await conv.create(max_tokens=20, stream=True) as stream:
            async for _ in stream:
                break
        assert stream.receipt is None and conv.token_ids is None
        stream = await conv.create(max_tokens=4, stream=True)
        async for _ in stream:
            pass
        await stream.aclose()
        assert stream.receipt is not None and len(conv.messages) == 2


@pytest.mark.anyio
async def test_async_twin(sim):
    async with agentkv.AsyncClient(base_url=f"{sim.url}/v1", api_key="k") as c:
        conv = c.conversation(model="sim")
        conv.add_user("hi")
        await conv.create(max_tokens=8)
        first = conv.token_ids
        conv.add_user("more")
        stream = await conv.create(max_tokens=6, stream=True)
        async for _ in stream:
            pass
        assert stream.receipt.completion_tokens == 6
        assert conv._ledger.last_prompt_ids[: len(first)] == first
        assert await conv.close() is False


def test_failed_append_turn_leaves_token_history_unchanged(client, faults):
    conv = client.conversation(model="sim")
    conv.add_user("hi")
    conv.create(max_tokens=4)
    before = conv.token_ids
    conv.add_user("second")
    faults.post("/_sim/faults", json={"fail_next": 1, "fail_status": 422})
    with pytest.raises(openai.UnprocessableEntityError):
        conv.create(max_tokens=4)
    assert conv.token_ids == before
    faults.post("/_sim/faults", json={"cut_stream_after": 2})
    with pytest.raises(openai.APIConnectionError):
        list(conv.create(max_tokens=8, stream=True))
    assert conv.token_ids == before
    faults.post("/_sim/faults", json={"cut_stream_after": None})
    conv.create(max_tokens=4)
    assert conv._ledger.last_prompt_ids[: len(before)] == before
