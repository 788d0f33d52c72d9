"""agentkv-openai-agents with the real OpenAI Agents SDK (Runner, sessions), over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import weather
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
from weather import tool_round

from tests._support.integration import MODEL, REUSED, SYSTEM, Recorder
from tests._support.stack import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _no_trace_export() -> None:
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise


TOOLS = [function_tool(weather.get_weather), function_tool(weather.add)]  # the examples' tools
AGENT = Agent(name="assistant", instructions=SYSTEM, tools=TOOLS, model=MODEL)


@pytest.fixture
def provider(sdk_clients: Any, recorder: Recorder) -> AgentKVModelProvider:
    """The provider over the suite's async client, its turns to ``recorder``."""
    _client, async_client = sdk_clients
    return AgentKVModelProvider(async_client=async_client, on_turn=recorder)


def test_sessions_keep_one_conversation_each_token_exact(
    pd: Stack, provider: AgentKVModelProvider, scripts: Scripts, recorder: Recorder
) -> None:
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
    pd: Stack, provider: AgentKVModelProvider, scripts: Scripts, recorder: Recorder
) -> None:
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
    recorder.assert_only_exact("oa-trim")
    assert pd.wrong_kv() == 0


# -- issue 14 §2, framework fidelity ----------------------------------------------------------
def test_fidelity_run_streamed_reports_input_and_cached_tokens(
    pd: Stack, provider: AgentKVModelProvider, scripts: Scripts, recorder: Recorder
) -> None:
    from agents import ModelSettings

    config = RunConfig(model_provider=provider)
    usages: list[Any] = []

    async def run() -> None:
        session = SQLiteSession("oa-usage")
        with conversation(session):
            for text in ("First answer. " * 4, "Second answer. " * 4):
                scripts.extend([answer(text)])
                streamed = Runner.run_streamed(AGENT, "Go on?", session=session, run_config=config)
                async for _event in streamed.stream_events():
                    pass
                assert streamed.final_output == text
                usages.append(streamed.context_wrapper.usage)
            # an agent that turns the usage chunk off gets none
            quiet = AGENT.clone(model_settings=ModelSettings(include_usage=False))
            scripts.extend([answer("Quiet.")])
            streamed = Runner.run_streamed(quiet, "Quiet?", session=session, run_config=config)
            async for _event in streamed.stream_events():
                pass
            usages.append(streamed.context_wrapper.usage)
        session.close()
        await provider.aclose()

    asyncio.run(run())
    turns = recorder.of("oa-usage")
    assert len(turns) == 3 and turns[1].receipt.decision in REUSED
    for usage, seen in zip(usages[:2], turns, strict=False):
        assert usage.requests == 1
        assert usage.input_tokens == seen.receipt.prompt_tokens > 0
        assert usage.output_tokens == seen.receipt.completion_tokens > 0
        assert usage.input_tokens_details.cached_tokens == (seen.receipt.cached_tokens or 0)
    assert usages[1].input_tokens_details.cached_tokens > 0
    assert usages[2].input_tokens == 0
    # on the wire agentkv always asks (its receipts need it); the SDK gets it when it asks
    requests = [r["body"] for r in scripts.requests]
    assert [r.get("stream_options") for r in requests] == [{"include_usage": True}] * 3
    assert pd.wrong_kv() == 0


def test_fidelity_no_default_model_the_served_one_or_the_given_one(
    pd: Stack, sdk_clients: Any, provider: AgentKVModelProvider, scripts: Scripts
) -> None:
    from agents.exceptions import UserError

    from agentkv.sim.launch import free_port

    bare = Agent(name="assistant", instructions=SYSTEM)  # names no model

    async def run(agent: Agent[Any], provider: AgentKVModelProvider) -> Any:
        return await Runner.run(agent, "Hi?", run_config=RunConfig(model_provider=provider))

    # neither the agent nor the provider: the server's model (GET /v1/models)
    scripts.extend([answer("Served.")])
    assert asyncio.run(run(bare, provider)).final_output == "Served."
    assert provider.default_model == MODEL
    assert scripts.requests[-1]["body"]["model"] == MODEL
    # the provider's model= for agents that name none; an agent's own model wins
    named = AgentKVModelProvider(async_client=sdk_clients[1], model="other-model")
    assert named.served_model() == "other-model"
    assert named.get_model(MODEL).model == MODEL  # type: ignore[attr-defined]
    # a server that cannot be reached: an error that says what to pass
    away = AgentKVModelProvider(base_url=f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(UserError, match="pass model="):
        away.get_model(None)
    assert away.get_model(MODEL).model == MODEL  # type: ignore[attr-defined]


def test_fidelity_tracing_is_the_sdks_own_processors_get_the_turns(
    provider: AgentKVModelProvider, scripts: Scripts, recorder: Recorder
) -> None:
    """Tracing as the docs configure it: set_trace_processors([...]) sends the spans to a
    processor of one's own (instead of OpenAI's exporter); the generation spans carry the
    served model and the usage."""
    from agents import set_trace_processors
    from agents.tracing import TracingProcessor
    from agents.tracing.processors import default_processor
    from agents.tracing.span_data import GenerationSpanData

    class Collect(TracingProcessor):
        def __init__(self) -> None:
            self.spans: list[Any] = []

        def on_trace_start(self, trace: Any) -> None:
            pass

        def on_trace_end(self, trace: Any) -> None:
            pass

        def on_span_start(self, span: Any) -> None:
            pass

        def on_span_end(self, span: Any) -> None:
            self.spans.append(span)

        def shutdown(self) -> None:
            pass

        def force_flush(self) -> None:
            pass

    collect = Collect()
    set_trace_processors([collect])
    set_tracing_disabled(False)
    try:
        scripts.extend([answer("Traced.")])
        config = RunConfig(model_provider=provider, workflow_name="agentkv-trace")
        result = asyncio.run(Runner.run(AGENT, "Trace?", run_config=config))
        assert result.final_output == "Traced."
    finally:
        set_tracing_disabled(True)
        set_trace_processors([default_processor()])
    generations = [
        s.span_data for s in collect.spans if isinstance(s.span_data, GenerationSpanData)
    ]
    assert len(generations) == 1
    assert generations[0].model == MODEL
    assert generations[0].usage["input_tokens"] == recorder.turns[-1].receipt.prompt_tokens
