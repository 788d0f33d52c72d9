"""agentkv-openai-agents with the real OpenAI Agents SDK (Runner, sessions), over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _sim import Scripts, answer, tool_call
from agentkv_openai_agents import AgentKVModelProvider, conversation
from agents import (
    Agent,
    RunConfig,
    Runner,
    SQLiteSession,
    function_tool,
    set_tracing_disabled,
)
from agents.memory import SessionSettings
from integration_support import MODEL, Recorder
from stack import Stack

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(20))


@pytest.fixture(autouse=True)
def _no_trace_export() -> None:
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 C in {city}."


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


AGENT = Agent(name="assistant", instructions=SYSTEM, tools=[get_weather, add], model=MODEL)


def tool_round(city: str, a: int, b: int, text: str) -> list[dict[str, Any]]:
    return [tool_call("get_weather", city=city), tool_call("add", a=a, b=b), answer(text)]


def provider_for(sdk_clients: Any, recorder: Recorder) -> AgentKVModelProvider:
    _client, async_client = sdk_clients
    return AgentKVModelProvider(async_client=async_client, on_turn=recorder)


def test_sessions_keep_one_conversation_each_token_exact(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    provider = provider_for(sdk_clients, recorder)
    config = RunConfig(model_provider=provider)

    async def run() -> None:
        named, keyed = SQLiteSession("oa-named"), SQLiteSession("oa-keyed")
        for i in range(2):
            scripts.extend(tool_round(f"City{i}", i, 2, f"named answer {i}"))
            with conversation(named):  # the session id verbatim
                result = await Runner.run(AGENT, f"question {i}", session=named, run_config=config)
            assert result.final_output == f"named answer {i}"
            scripts.extend(tool_round(f"Town{i}", i, 3, f"keyed answer {i}"))
            # without a block: the Runner's own per-session key
            result = await Runner.run(AGENT, f"question {i}", session=keyed, run_config=config)
            assert result.final_output == f"keyed answer {i}"
        named.close()
        keyed.close()
        await provider.aclose()

    asyncio.run(run())
    ids = recorder.ids()
    assert len(ids) == 2 and ids[0] == "oa-named"
    assert ids[1].startswith("agents-sdk:session:")
    for key in ids:
        turns = recorder.of(key)
        assert len(turns) == 6 and {t.receipt.epoch for t in turns} == {0}
        recorder.assert_exact(key)
    assert provider.conversation("oa-named") is not None
    assert pd.wrong_kv() == 0


def test_session_limit_is_a_rewrite_and_streaming_runs(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    provider = provider_for(sdk_clients, recorder)
    full = RunConfig(model_provider=provider)
    trimmed = RunConfig(model_provider=provider, session_settings=SessionSettings(limit=4))

    async def run() -> None:
        session = SQLiteSession("oa-trim")
        with conversation(session):
            scripts.extend(tool_round("Oslo", 1, 1, "Oslo answer. " * 4))
            await Runner.run(AGENT, "Oslo weather and 1+1?", session=session, run_config=full)
            # streamed, with a tool call
            scripts.extend([tool_call("get_weather", city="Rome"), answer("Rome answer.")])
            streamed = Runner.run_streamed(AGENT, "And Rome?", session=session, run_config=full)
            async for _event in streamed.stream_events():
                pass
            assert streamed.final_output == "Rome answer."
            # the session hands back only its last 4 items: a rewrite
            scripts.extend([answer("Trimmed answer.")])
            result = await Runner.run(AGENT, "Short?", session=session, run_config=trimmed)
            assert result.final_output == "Trimmed answer."
            scripts.extend([answer("Next answer.")])
            await Runner.run(AGENT, "Next?", session=session, run_config=trimmed)
        session.close()
        await provider.aclose()

    asyncio.run(run())
    turns = recorder.of("oa-trim")
    assert [t.receipt.epoch for t in turns] == [0, 0, 0, 0, 0, 1, 2]
    assert turns[5].receipt.rewrite is not None
    assert turns[3].receipt.ttft_s is not None  # the streamed turns
    recorder.assert_exact("oa-trim")
    assert recorder.ids() == ["oa-trim"]
    assert pd.wrong_kv() == 0
