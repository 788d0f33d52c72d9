"""llama-index-llms-agentkv with the real LlamaIndex agents and memory, over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _sim import Scripts, answer
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.memory import FactExtractionMemoryBlock, Memory
from llama_index.llms.agentkv import AgentKV, session
from sqlalchemy.ext.asyncio import create_async_engine
from weather import add, get_weather, tool_round  # the examples' tools

from tests._support.integration import MODEL, REUSED, SYSTEM, Recorder, adapter_settings
from tests._support.stack import Stack

pytestmark = [
    pytest.mark.e2e,
    # llama-index-workflows finds an agent's steps with inspect.getmembers(), which touches
    # pydantic's deprecated instance attributes (__fields__, model_computed_fields, ...):
    # third-party, and only warnings raised from the inspect module are ignored.
    pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning:inspect"),
]

MEMORY_DB = "sqlite+aiosqlite:///:memory:"  # LlamaIndex Memory's own default store


def llm_for(sdk_clients: Any, recorder: Recorder, **kwargs: Any) -> AgentKV:
    return AgentKV(**adapter_settings(sdk_clients, recorder), **kwargs)


@pytest.mark.parametrize("streaming", [True, False])
def test_function_agent_keeps_one_conversation_per_session_token_exact(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder, streaming: bool
) -> None:
    llm = llm_for(sdk_clients, recorder)
    agent = FunctionAgent(
        tools=[get_weather, add], llm=llm, system_prompt=SYSTEM, streaming=streaming
    )
    names = [f"li-{streaming}-a", f"li-{streaming}-b"]

    async def run() -> None:
        engine = create_async_engine(MEMORY_DB)
        memories = {
            name: Memory.from_defaults(session_id=name, async_engine=engine) for name in names
        }
        for i in range(2):
            for name, memory in memories.items():
                scripts.extend(tool_round(f"City{i}", i, 2, f"{name} answer {i}"))
                with session(memory):
                    response = await agent.run(f"question {i}", memory=memory)
                assert str(response) == f"{name} answer {i}"
                assert [c.tool_name for c in response.tool_calls] == ["get_weather", "add"]
        await engine.dispose()
        await llm.aclose()

    asyncio.run(run())
    assert recorder.ids() == names
    for name in names:
        turns = recorder.of(name)
        assert len(turns) == 6 and {t.receipt.epoch for t in turns} == {0}
        assert turns[0].receipt.decision == "miss"
        recorder.assert_exact(name)
    assert {r["headers"]["x-conversation-id"] for r in scripts.requests} == set(names)
    assert pd.wrong_kv() == 0


def test_memory_flush_with_fact_extraction_is_a_rewrite(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    llm = llm_for(sdk_clients, recorder)
    agent = FunctionAgent(tools=[get_weather, add], llm=llm, system_prompt=SYSTEM)
    facts = FactExtractionMemoryBlock(name="facts", llm=llm, priority=1)
    scripts.when(
        "precise fact extraction system",
        answer("<facts><fact>The user asks about towns and sums.</fact></facts>"),
    )

    async def run() -> None:
        engine = create_async_engine(MEMORY_DB)
        memory = Memory.from_defaults(
            session_id="li-facts",
            async_engine=engine,
            token_limit=400,
            chat_history_token_ratio=0.5,
            token_flush_size=100,
            memory_blocks=[facts],
        )
        with session(memory):
            for i in range(4):
                scripts.extend(tool_round(f"Town{i}", i, i, f"Town answer {i}. " * 4))
                await agent.run(f"Weather in Town{i} and {i}+{i}?", memory=memory)
        await engine.dispose()
        await llm.aclose()

    asyncio.run(run())
    assert scripts.left == 0
    assert facts.facts == ["The user asks about towns and sums."]
    main = recorder.of("li-facts")
    assert len(main) == 12
    rewrites = [t for t in main if t.receipt.rewrite is not None]
    assert rewrites, "the memory never flushed"
    assert main[-1].receipt.epoch == len(rewrites)
    recorder.assert_exact("li-facts")
    # planner v2: the flush keeps the system prompt and what precedes the dropped messages, and
    # that verified prefix is reused — every turn after the first, rewrites included
    assert all(t.receipt.decision in REUSED for t in main[1:]), main
    assert all(t.receipt.trim_cause == "rewrite" for t in rewrites)
    # the fact extractor reads old messages: a conversation of its own, not a rewrite of ours
    asides = [i for i in recorder.ids() if i != "li-facts"]
    assert asides and all(i.startswith("li-facts#") for i in asides)
    assert pd.wrong_kv() == 0


# llama-index-core's ReActAgent still calls the workflow Context.is_running it deprecated.
@pytest.mark.filterwarnings("ignore:is_running called from within a step:DeprecationWarning")
def test_react_agent_and_plain_calls(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    llm = llm_for(sdk_clients, recorder)
    agent = ReActAgent(tools=[get_weather], llm=llm, system_prompt=SYSTEM, streaming=False)
    scripts.extend(
        [
            answer(
                'Thought: I need the weather.\nAction: get_weather\nAction Input: {"city": "Lima"}'
            ),
            answer("Thought: I can answer without using any more tools.\nAnswer: Lima is sunny."),
        ]
    )

    async def run() -> str:
        with session("li-react"):
            return str(await agent.run("Weather in Lima?"))

    assert asyncio.run(run()) == "Lima is sunny."
    assert len(recorder.of("li-react")) == 2
    recorder.assert_exact("li-react")

    # the plain sync API: chat, then a streamed follow-up in the same session
    history = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content="Hi")]
    scripts.extend([answer("Hello."), answer("Still here. " * 4)])
    first = llm.chat(history, conversation_id="li-plain")
    assert first.message.content == "Hello."
    history += [first.message, ChatMessage(role="user", content="Again?")]
    *_, last = llm.stream_chat(history, conversation_id="li-plain")
    assert last.message.content == "Still here. " * 4
    assert last.additional_kwargs["agentkv"]["sync"] == "append"
    assert llm.complete("One word?").text
    recorder.assert_exact("li-plain")
    assert pd.wrong_kv() == 0


# -- issue 14 §2, framework fidelity ----------------------------------------------------------
def test_fidelity_streamed_usage_reaches_token_counting_handler(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    # a whitespace tokenizer: its counts differ from the server's, so equal counts are usage
    counter = TokenCountingHandler(tokenizer=str.split)
    llm = llm_for(sdk_clients, recorder, callback_manager=CallbackManager([counter]))
    history = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content="Hi")]
    scripts.extend([answer("Hello there. " * 4), answer("Again here. " * 4), answer("Done.")])
    *_, last = llm.stream_chat(history, conversation_id="li-usage")
    history += [last.message, ChatMessage(role="user", content="Again?")]

    async def second() -> Any:
        out = None
        async for response in await llm.astream_chat(history, conversation_id="li-usage"):
            out = response
        return out

    final = asyncio.run(second())
    *_, completed = llm.stream_complete("One word?")
    turns = recorder.of("li-usage")
    assert len(turns) == 2 and turns[1].receipt.decision in REUSED
    events = counter.llm_token_counts
    assert len(events) == 4  # stream_complete: its completion event and its chat event
    for event, seen in zip(events[:2], turns, strict=True):
        assert event.prompt_token_count == seen.receipt.prompt_tokens > 0
        assert event.completion_token_count == seen.receipt.completion_tokens > 0
    assert {e.prompt_token_count for e in events[2:]} == {completed.raw.usage.prompt_tokens}
    assert {e.completion_token_count for e in events[2:]} == {completed.raw.usage.completion_tokens}
    assert final.additional_kwargs["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert final.raw.usage.prompt_tokens == turns[1].receipt.prompt_tokens
    # non-streamed chat still counts the server's tokens
    scripts.extend([answer("Plain.")])
    plain = llm.chat(history, conversation_id="li-usage-plain")
    assert counter.llm_token_counts[-1].prompt_token_count == plain.raw.usage.prompt_tokens
    assert pd.wrong_kv() == 0


def test_fidelity_context_window_is_the_served_max_model_len(
    pd: Stack, base_url: str, sdk_clients: Any, recorder: Recorder
) -> None:
    import httpx
    from llama_index.llms.agentkv.base import FALLBACK_CONTEXT_WINDOW

    served = httpx.get(f"{base_url}/models", headers={"Authorization": "Bearer k"}).json()
    max_model_len = served["data"][0]["max_model_len"]
    assert served["data"][0]["id"] == MODEL and max_model_len != FALLBACK_CONTEXT_WINDOW
    llm = llm_for(sdk_clients, recorder)
    assert llm.metadata.context_window == max_model_len
    assert llm.metadata.context_window == max_model_len  # read once, kept
    # one given wins
    assert llm_for(sdk_clients, recorder, context_window=4096).metadata.context_window == 4096
    # an unreachable server: the fallback, with a warning naming the setting
    from agentkv import AgentKVWarning
    from agentkv.sim.launch import free_port

    away = AgentKV(model=MODEL, base_url=f"http://127.0.0.1:{free_port()}/v1")
    with pytest.warns(AgentKVWarning, match="context_window="):
        assert away.metadata.context_window == FALLBACK_CONTEXT_WINDOW
    # no second try (and warning) within the next 30 s
    assert away.metadata.context_window == FALLBACK_CONTEXT_WINDOW
