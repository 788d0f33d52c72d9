"""langchain-agentkv with the real LangChain, LangGraph and langchain agents, over HTTP."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
import weather
from _sim import Scripts, answer, tool_call
from langchain_agentkv import ChatAgentKV, LangGraphStore
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.utils import trim_messages
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.store.memory import InMemoryStore
from pydantic import BaseModel
from weather import tool_round

from tests._support.integration import (
    LOWER_BOUNDS,
    MODEL,
    REUSED,
    SYSTEM,
    Recorder,
    adapter_settings,
)
from tests._support.stack import Stack

pytestmark = pytest.mark.e2e


get_weather, add = tool(weather.get_weather), tool(weather.add)  # the examples' tools
TOOLS = [get_weather, add]


def react_graph(
    model: ChatAgentKV, *, keep_tokens: int | None = None, checkpointer: Any = None
) -> Any:
    """A ReAct graph; with ``keep_tokens`` the agent node trims the history it sends."""
    bound = model.bind_tools(TOOLS)

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        messages: list[AnyMessage] = list(state["messages"])
        if keep_tokens is not None:
            messages = trim_messages(
                messages,
                max_tokens=keep_tokens,
                token_counter="approximate",
                strategy="last",
                start_on="human",
                end_on=("human", "tool"),
            )
        return {"messages": [bound.invoke([SystemMessage(SYSTEM), *messages])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer or InMemorySaver())


def model_for(sdk_clients: Any, recorder: Recorder, **kwargs: Any) -> ChatAgentKV:
    return ChatAgentKV(**adapter_settings(sdk_clients, recorder), **kwargs)


def test_react_agent_keeps_one_conversation_per_thread_token_exact(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    app = react_graph(model_for(sdk_clients, recorder))
    threads = {"lc-a": {"configurable": {"thread_id": "lc-a"}}, "lc-b": {}}
    threads["lc-b"] = {"configurable": {"thread_id": "lc-b"}}
    for i in range(2):  # two threads, interleaved, two questions each
        for name, config in threads.items():
            scripts.extend(tool_round(f"City{i}", i, 2, f"{name} answer {i}"))
            state = app.invoke({"messages": [HumanMessage(f"question {i}")]}, config)
            assert state["messages"][-1].text == f"{name} answer {i}"
            assert [m.name for m in state["messages"] if m.type == "tool"][-2:] == [
                "get_weather",
                "add",
            ]
    assert recorder.ids() == ["lc-a", "lc-b"]
    for thread in threads:
        turns = recorder.of(thread)
        assert len(turns) == 6
        assert turns[0].receipt.decision == "miss"
        assert {t.receipt.epoch for t in turns} == {0}
        recorder.assert_exact(thread)
    # the receipt travels with the framework's own message
    last = state["messages"][-1]
    assert isinstance(last, AIMessage)
    assert last.response_metadata["agentkv"]["conversation_id"] == "lc-b"
    assert last.response_metadata["agentkv"]["sync"] == "append"
    assert last.usage_metadata is not None
    assert last.usage_metadata["input_token_details"]["cache_read"] > 0
    # the router saw the thread id as the conversation id on every request
    sent = {r["headers"]["x-conversation-id"] for r in scripts.requests}
    assert sent == {"lc-a", "lc-b"}
    assert pd.wrong_kv() == 0


def test_trim_messages_is_a_rewrite_with_no_wrong_kv(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    app = react_graph(model_for(sdk_clients, recorder), keep_tokens=220)
    config: Any = {"configurable": {"thread_id": "lc-trim"}}
    for i in range(4):
        scripts.extend(tool_round(f"Town{i}", i, i, f"Answer number {i}. " * 6))
        app.invoke({"messages": [HumanMessage(f"Weather in Town{i} and {i}+{i}?")]}, config)
    turns = recorder.of("lc-trim")
    assert len(turns) == 12
    rewrites = [t for t in turns if t.receipt.rewrite is not None]
    assert rewrites, "trim_messages never dropped a message"
    assert all(t.receipt.rewrite and t.receipt.rewrite.reason == "sync" for t in rewrites)
    assert turns[-1].receipt.epoch == len(rewrites)
    recorder.assert_only_exact("lc-trim")
    assert pd.wrong_kv() == 0


def test_summarization_middleware_rewrites_the_thread_and_summarizes_aside(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    # imported here: `langchain` (agents, middleware) is a test dependency of this test only, so
    # the rest of the module also runs at the frameworks' lower bounds (.ci/lower-bounds.txt),
    # where no langchain release fits: there, and only there, it is absent and this test skips
    if LOWER_BOUNDS and importlib.util.find_spec("langchain") is None:
        pytest.skip("lower-bounds stage: every langchain >= 1.1 needs langchain-core >= 1.2.7")
    from langchain.agents import create_agent
    from langchain.agents.middleware import SummarizationMiddleware

    model = model_for(sdk_clients, recorder)
    agent = create_agent(
        model,
        tools=TOOLS,
        system_prompt=SYSTEM,
        middleware=[SummarizationMiddleware(model, trigger=("messages", 8), keep=("messages", 3))],
        checkpointer=InMemorySaver(),
    )
    config: Any = {"configurable": {"thread_id": "lc-sum"}}
    scripts.when("Context Extraction Assistant", answer("The user asked about villages and sums."))
    for i in range(3):
        scripts.extend(tool_round(f"Village{i}", i, 1, f"Village answer {i}."))
        agent.invoke({"messages": [HumanMessage(f"Village{i} weather and {i}+1?")]}, config)
    assert scripts.left == 0
    main = recorder.of("lc-sum")
    assert len(main) == 9
    epochs = [t.receipt.epoch for t in main]
    assert epochs == sorted(epochs) and epochs[-1] >= 1, epochs
    recorder.assert_exact("lc-sum")
    # the summarizer's prompt carries the history as text: a conversation of its own
    asides = [i for i in recorder.ids() if i != "lc-sum"]
    assert asides and all(i.startswith("lc-sum#") for i in asides)
    assert len(recorder.turns) == 9 + epochs[-1]
    assert model.conversation("lc-sum") is not None
    assert pd.wrong_kv() == 0


def test_streaming_sync_and_async_with_tool_calls(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    model = model_for(sdk_clients, recorder)
    bound = model.bind_tools(TOOLS)
    history: list[AnyMessage] = [SystemMessage(SYSTEM), HumanMessage("Weather in Oslo?")]
    scripts.extend([tool_call("get_weather", city="Oslo"), answer("Oslo is sunny. " * 5)])
    chunks = list(bound.stream(history, conversation_id="lc-stream"))
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert isinstance(total, AIMessage)
    assert total.tool_calls[0]["name"] == "get_weather"
    assert total.tool_calls[0]["args"] == {"city": "Oslo"}
    assert total.response_metadata["agentkv"]["decision"] == "miss"
    history += [total, get_weather.invoke(total.tool_calls[0])]

    async def second() -> AIMessage:
        out = None
        async for chunk in bound.astream(history, conversation_id="lc-stream"):
            out = chunk if out is None else out + chunk
        assert isinstance(out, AIMessage)
        return out

    reply = asyncio.run(second())
    assert reply.text == "Oslo is sunny. " * 5
    assert reply.response_metadata["agentkv"]["sync"] == "append"
    recorder.assert_exact("lc-stream")

    # an abandoned stream records nothing and frees the conversation for the next call
    scripts.extend([answer("word " * 80)])
    stream = bound.stream([*history, reply, HumanMessage("More?")], conversation_id="lc-stream")
    next(stream)
    stream.close()
    assert len(recorder.of("lc-stream")) == 2
    scripts.extend([answer("Short.")])
    again = bound.invoke([*history, reply, HumanMessage("More?")], conversation_id="lc-stream")
    assert again.response_metadata["agentkv"]["conversation_id"] == "lc-stream"
    # the abandoned turn took the stored handle (single use); whether D's new one was stored
    # before the client left depends on timing, so the next turn pulls or misses — never worse
    prev, cur = recorder.of("lc-stream")[-2:]
    assert cur.token_ids[: len(prev.token_ids)] == prev.token_ids
    assert cur.receipt.decision in ("pull", "decode", "miss"), cur.receipt
    assert pd.wrong_kv() == 0


class Weather(BaseModel):
    city: str
    temperature_c: int


def test_structured_output_and_async_invoke(
    sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    model = model_for(sdk_clients, recorder)
    structured = model.with_structured_output(Weather)
    scripts.extend([tool_call("Weather", city="Lima", temperature_c=19)])
    parsed = structured.invoke("Weather in Lima as JSON", conversation_id="lc-struct")
    assert parsed == Weather(city="Lima", temperature_c=19)
    assert scripts.requests[-1]["body"]["tool_choice"] == "required"

    scripts.extend([answer("Fine.")])
    reply = asyncio.run(model.ainvoke("Hello", conversation_id="lc-async"))
    assert reply.text == "Fine."
    assert recorder.ids() == ["lc-struct", "lc-async"]


def test_ledgers_kept_in_a_langgraph_store_survive_a_new_model(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    store = LangGraphStore(InMemoryStore())
    saver = InMemorySaver()
    config: Any = {"configurable": {"thread_id": "lc-store"}}
    first = model_for(sdk_clients, recorder, store=store)
    app = react_graph(first, checkpointer=saver)
    scripts.extend(tool_round("Quito", 1, 1, "Quito answer."))
    app.invoke({"messages": [HumanMessage("Quito?")]}, config)

    # a new process: a new model on the same store and checkpointer continues the thread
    second = model_for(sdk_clients, recorder, store=store)
    app2 = react_graph(second, checkpointer=saver)
    scripts.extend([answer("Still Quito.")])
    app2.invoke({"messages": [HumanMessage("And now?")]}, config)
    turns = recorder.of("lc-store")
    assert len(turns) == 4
    assert turns[-1].receipt.turn == 4 and turns[-1].receipt.epoch == 0
    recorder.assert_exact("lc-store")
    state = store.load("lc-store")
    assert state is not None and state["lanes"][0]["state"]["turns"] == 4
    assert pd.wrong_kv() == 0


def test_a_framework_that_renames_tool_call_ids_gets_a_rewrite_not_an_error(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    model = model_for(sdk_clients, recorder).bind_tools(TOOLS)
    history: list[AnyMessage] = [SystemMessage(SYSTEM), HumanMessage("Weather in Bern?")]
    scripts.extend([tool_call("get_weather", city="Bern"), answer("Bern is sunny.")])
    first = model.invoke(history, conversation_id="lc-reid")
    assert isinstance(first, AIMessage)
    renamed = first.model_copy(
        update={
            "tool_calls": [{**first.tool_calls[0], "id": "call_renamed"}],
            "additional_kwargs": {},
        }
    )
    result = ToolMessage("It is sunny.", tool_call_id="call_renamed")
    second = model.invoke([*history, renamed, result], conversation_id="lc-reid")
    receipt = second.response_metadata["agentkv"]
    assert receipt["sync"] == "rewrite" and receipt["epoch"] == 1
    # pull or decode: the verified prefix
    assert receipt["decision"] in ("stale", "recompute", "pull", "decode")
    assert pd.wrong_kv() == 0


def test_two_models_on_one_thread_both_pull(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    """A graph with two ChatAgentKV nodes (a planner and a writer, their own system prompts) on
    one thread: both send the thread id, and each branch's later calls read its own KV back."""
    planner = model_for(sdk_clients, recorder)
    writer = model_for(sdk_clients, recorder)

    def plan(state: MessagesState) -> dict[str, list[AnyMessage]]:
        reply = planner.invoke([SystemMessage("You plan. " * 40), *state["messages"]])
        return {"messages": [reply]}

    def write(state: MessagesState) -> dict[str, list[AnyMessage]]:
        reply = writer.invoke([SystemMessage("You write. " * 40), *state["messages"]])
        return {"messages": [reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("plan", plan)
    graph.add_node("write", write)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "write")
    app = graph.compile(checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "lc-branches"}}
    for i in range(3):
        scripts.extend([answer(f"Plan {i}. " * 8), answer(f"Draft {i}. " * 8)])
        app.invoke({"messages": [HumanMessage(f"Step {i}?")]}, config)
    sent = {r["headers"]["x-conversation-id"] for r in scripts.requests}
    assert sent == {"lc-branches"}
    turns = recorder.of("lc-branches")
    assert len(turns) == 6
    decisions = [t.receipt.decision for t in turns]
    # planner, writer, planner, writer, ...: after each branch's first call, every call reuses
    assert decisions[0] == "miss" and decisions[1] in ("miss", "stale"), decisions
    assert all(d in REUSED for d in decisions[2:]), decisions
    assert pd.wrong_kv() == 0


def test_lease_s_holds_the_threads_kv_while_the_model_lives(pd: Stack) -> None:
    import time

    model = ChatAgentKV(
        model=MODEL, base_url=f"{pd.router.url}/v1", api_key="k", max_tokens=30, lease_s=1.0
    )
    held = pd.retained(pd.decode[0])
    try:
        model.invoke([HumanMessage("hello")], conversation_id="lc-lease")
        time.sleep(2.5)  # longer than the lease: the model's client renews it
        assert pd.retained(pd.decode[0]) == held + 1
    finally:
        model.close()  # renewals stop: the lease lapses and D's blocks are released
    deadline = time.monotonic() + 5
    while pd.retained(pd.decode[0]) > held and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pd.retained(pd.decode[0]) == held


# -- issue 14 §2, framework fidelity ----------------------------------------------------------
def _one_node_graph(model: ChatAgentKV) -> Any:
    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_edge(START, "agent")
    return graph.compile(checkpointer=InMemorySaver())


def test_fidelity_streamed_usage_on_the_last_chunk(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    from langchain_core.messages import AIMessageChunk

    model = model_for(sdk_clients, recorder)
    history: list[AnyMessage] = [SystemMessage(SYSTEM), HumanMessage("Hi?")]
    # stream(): only the last chunk carries usage_metadata (default on, as agentkv has it)
    scripts.extend([answer("Hello there. " * 3)])
    chunks = list(model.stream(history, conversation_id="lc-usage"))
    last = chunks[-1]
    assert isinstance(last, AIMessageChunk) and last.chunk_position == "last"
    assert last.usage_metadata is not None
    assert last.usage_metadata["input_tokens"] > 0 and last.usage_metadata["output_tokens"] > 0
    assert all(c.usage_metadata is None for c in chunks[:-1])
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert total.usage_metadata == last.usage_metadata
    assert last.response_metadata["agentkv"]["prompt_tokens"] == last.usage_metadata["input_tokens"]
    history += [AIMessage(total.text), HumanMessage("Again?")]

    # astream() with stream_usage=True: the second turn's usage has the cached tokens
    async def second() -> AIMessageChunk:
        out = [
            c async for c in model.astream(history, conversation_id="lc-usage", stream_usage=True)
        ]
        assert all(c.usage_metadata is None for c in out[:-1])
        return out[-1]

    scripts.extend([answer("Again. " * 3)])
    last = asyncio.run(second())
    assert last.usage_metadata is not None
    assert last.usage_metadata["input_token_details"]["cache_read"] > 0
    assert recorder.of("lc-usage")[-1].receipt.decision in REUSED

    # stream_usage=False (call, or the field) leaves it off; the call wins over the field
    scripts.extend([answer("No usage."), answer("Usage again.")])
    off = list(model.stream("Plain?", conversation_id="lc-usage-off", stream_usage=False))
    assert all(c.usage_metadata is None for c in off)
    quiet = model_for(sdk_clients, recorder, stream_usage=False)
    on = list(quiet.stream("Plain?", conversation_id="lc-usage-on", stream_usage=True))
    assert on[-1].usage_metadata is not None
    scripts.extend([answer("Options.")])
    opts = list(quiet.stream("Opt?", stream_options={"include_usage": True}))
    assert opts[-1].usage_metadata is not None

    # LangGraph stream_mode="messages": the model's last chunk carries it
    app = _one_node_graph(model)
    config: Any = {"configurable": {"thread_id": "lc-usage-graph"}}
    scripts.extend([answer("Graph answer. " * 3)])
    streamed = [
        m
        for m, _meta in app.stream(
            {"messages": [HumanMessage("Q?")]}, config, stream_mode="messages"
        )
    ]
    ai = [m for m in streamed if isinstance(m, AIMessageChunk)]
    assert ai and ai[-1].usage_metadata is not None
    assert ai[-1].usage_metadata["input_tokens"] > 0
    assert ai[-1].response_metadata["agentkv"]["conversation_id"] == "lc-usage-graph"

    # astream_events: the last on_chat_model_stream chunk, and on_chat_model_end's output
    async def events() -> list[dict[str, Any]]:
        return [e async for e in model.astream_events("Events?", version="v2")]

    scripts.extend([answer("Evented. " * 3)])
    seen = asyncio.run(events())
    stream_chunks = [e["data"]["chunk"] for e in seen if e["event"] == "on_chat_model_stream"]
    assert stream_chunks[-1].usage_metadata is not None
    end = next(e for e in seen if e["event"] == "on_chat_model_end")
    assert end["data"]["output"].usage_metadata["output_tokens"] > 0

    # the non-streamed path still has it
    scripts.extend([answer("Invoked.")])
    assert model.invoke("Invoke?").usage_metadata is not None
    assert pd.wrong_kv() == 0


def test_fidelity_invoke_config_thread_id_is_the_conversation(
    pd: Stack, sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    model = model_for(sdk_clients, recorder)
    config: Any = {"configurable": {"thread_id": "lc-config-thread"}}
    history: list[AnyMessage] = [SystemMessage(SYSTEM), HumanMessage("One?")]
    scripts.extend([answer("First. " * 4), answer("Second. " * 4), answer("Third."), answer("4")])
    first = model.invoke(history, config=config)
    assert first.response_metadata["agentkv"]["conversation_id"] == "lc-config-thread"
    history += [first, HumanMessage("Two?")]
    chunks = list(model.stream(history, config=config))
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert total.response_metadata["agentkv"]["conversation_id"] == "lc-config-thread"
    assert total.response_metadata["agentkv"]["sync"] == "append"
    history += [AIMessage(total.text), HumanMessage("Three?")]
    third = asyncio.run(model.ainvoke(history, config=config))
    assert third.response_metadata["agentkv"]["conversation_id"] == "lc-config-thread"
    # batch() runs each input with its own config
    other: Any = {"configurable": {"thread_id": "lc-config-other"}}
    (fourth,) = model.batch([[HumanMessage("Four?")]], config=[other])
    assert fourth.response_metadata["agentkv"]["conversation_id"] == "lc-config-other"
    sent = [r["headers"]["x-conversation-id"] for r in scripts.requests]
    assert sent == ["lc-config-thread"] * 3 + ["lc-config-other"]
    assert len(recorder.of("lc-config-thread")) == 3
    recorder.assert_exact("lc-config-thread")
    assert pd.wrong_kv() == 0


def test_fidelity_structured_output_json_schema_and_json_mode_send_response_format(
    sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    model = model_for(sdk_clients, recorder)
    # json_schema: the schema goes as response_format (the engine decodes to it), no tools
    scripts.extend([answer('{"city": "Lima", "temperature_c": 19}')])
    structured = model.with_structured_output(Weather, method="json_schema", strict=True)
    assert structured.invoke("Weather in Lima?", conversation_id="lc-js") == Weather(
        city="Lima", temperature_c=19
    )
    body = scripts.requests[-1]["body"]
    assert body["response_format"]["type"] == "json_schema"
    schema = body["response_format"]["json_schema"]
    assert schema["name"] == "Weather" and schema["strict"] is True
    assert set(schema["schema"]["properties"]) == {"city", "temperature_c"}
    assert "tools" not in body and "tool_choice" not in body

    # json_mode: response_format json_object; a dict schema parses to a dict; include_raw
    scripts.extend([answer('{"city": "Oslo", "temperature_c": 3}')])
    raw = model.with_structured_output(Weather, method="json_mode", include_raw=True).invoke(
        "Weather in Oslo as JSON?", conversation_id="lc-jm"
    )
    assert scripts.requests[-1]["body"]["response_format"] == {"type": "json_object"}
    assert raw["parsed"] == Weather(city="Oslo", temperature_c=3)
    assert raw["parsing_error"] is None and isinstance(raw["raw"], AIMessage)
    dict_schema = {
        "title": "Place",
        "description": "A place.",
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    }
    scripts.extend([answer('{"name": "Bern"}')])
    assert model.with_structured_output(dict_schema, method="json_schema").invoke("Place?") == {
        "name": "Bern"
    }
    assert scripts.requests[-1]["body"]["response_format"]["json_schema"]["name"] == "Place"
    # function_calling (the default) still forces a tool call
    scripts.extend([tool_call("Weather", city="Rome", temperature_c=25)])
    assert model.with_structured_output(Weather).invoke("Rome?") == Weather(
        city="Rome", temperature_c=25
    )
    assert "response_format" not in scripts.requests[-1]["body"]


def test_fidelity_on_llm_end_carries_token_usage(
    sdk_clients: Any, scripts: Scripts, recorder: Recorder
) -> None:
    from langchain_core.callbacks import BaseCallbackHandler, get_usage_metadata_callback
    from langchain_core.outputs import LLMResult

    class Ends(BaseCallbackHandler):
        def __init__(self) -> None:
            self.results: list[LLMResult] = []

        def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
            self.results.append(response)

    ends = Ends()
    model = model_for(sdk_clients, recorder)
    history: list[AnyMessage] = [SystemMessage(SYSTEM), HumanMessage("Hi?")]
    scripts.extend([answer("Hello. " * 4), answer("Again. " * 4)])
    first = model.invoke(history, conversation_id="lc-end", config={"callbacks": [ends]})
    second = model.invoke(
        [*history, first, HumanMessage("More?")],
        conversation_id="lc-end",
        config={"callbacks": [ends]},
    )
    usages = [r.llm_output["token_usage"] for r in ends.results if r.llm_output]
    assert len(usages) == 2
    receipts = [first.response_metadata["agentkv"], second.response_metadata["agentkv"]]
    for usage, receipt in zip(usages, receipts, strict=True):
        assert usage["prompt_tokens"] == receipt["prompt_tokens"] > 0
        assert usage["completion_tokens"] == receipt["completion_tokens"] > 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert ends.results[0].llm_output["model_name"] == MODEL
    # generate(): the calls' usage summed
    scripts.extend([answer("A."), answer("B.")])
    both = model.generate([[HumanMessage("a?")], [HumanMessage("b?")]])
    assert both.llm_output is not None
    summed = both.llm_output["token_usage"]
    parts = [g[0].message.usage_metadata for g in both.generations]  # type: ignore[attr-defined]
    assert summed["prompt_tokens"] == sum(p["input_tokens"] for p in parts)
    # streamed: on_llm_end's generation carries usage_metadata (what usage callbacks read)
    scripts.extend([answer("Streamed. " * 3)])
    with get_usage_metadata_callback() as counted:
        list(model.stream("Stream?", config={"callbacks": [ends]}))
    streamed_end = ends.results[-1].generations[0][0]
    assert streamed_end.message.usage_metadata is not None  # type: ignore[attr-defined]
    assert counted.usage_metadata[MODEL]["input_tokens"] > 0
