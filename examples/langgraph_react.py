"""A LangGraph ReAct agent with two tools and a summarization step, on agentkv.

    python examples/langgraph_react.py --base-url http://127.0.0.1:8000/v1 --model MODEL

The one-line change is the model: ``ChatAgentKV(...)`` instead of another chat model. Each
LangGraph thread (``config["configurable"]["thread_id"]``) is one agentkv conversation: its
turns stay token-exact, and when the ``summarize`` node replaces old messages with a summary,
agentkv sees a rewrite and moves the conversation to a new epoch, so the router never reads KV
computed for the messages that are gone.
"""

from __future__ import annotations

from typing import Any

from _common import arguments, conversation_id, print_receipt, print_summary
from _sim import Scripts, answer, clients, tool_call
from langchain_agentkv import ChatAgentKV
from langchain_core.messages import AnyMessage, HumanMessage, RemoveMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.prebuilt import ToolNode, tools_condition

SYSTEM = SystemMessage("You are a helpful assistant. Use the tools.")
SUMMARIZE_AFTER = 8  # messages in the state before the summary step runs


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 C in {city}."


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def build(model: ChatAgentKV) -> Any:
    tools = [get_weather, add]
    agent_model = model.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [agent_model.invoke([SYSTEM, *state["messages"]])]}

    def summarize(state: MessagesState) -> dict[str, list[Any]]:
        # Keep the last exchange (from the last user message on); summarize what is before it.
        messages = state["messages"]
        cut = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
        transcript = "\n".join(f"{m.type}: {m.text}" for m in messages[:cut])
        summary = model.invoke(f"Summarize this conversation in two sentences:\n{transcript}")
        note = HumanMessage(f"Summary of the conversation so far: {summary.text}")
        reset = RemoveMessage(id=REMOVE_ALL_MESSAGES)
        return {"messages": [reset, note, *messages[cut:]]}

    def after_agent(state: MessagesState) -> str:
        if tools_condition(dict(state)) == "tools":
            return "tools"
        return "summarize" if len(state["messages"]) > SUMMARIZE_AFTER else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_node("summarize", summarize)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", after_agent, ["tools", "summarize", END])
    graph.add_edge("tools", "agent")
    graph.add_edge("summarize", END)
    return graph.compile(checkpointer=InMemorySaver())


def main() -> None:
    args = arguments(__doc__ or "")
    settings: dict[str, Any] = {"model": args.model, "max_tokens": 256, "on_turn": print_receipt}
    if args.simulate_tools:
        scripts = Scripts(
            [
                tool_call("get_weather", city="Paris"),
                tool_call("add", a=19, b=23),
                answer("Paris is sunny, and 19 + 23 = 42."),
                tool_call("get_weather", city="Rome"),
                answer("Rome is sunny too."),
                answer("The user asked about the weather in Paris and Rome, and 19 + 23."),
                answer("You asked about Paris, Rome and a sum."),
            ]
        )
        client, async_client = clients(args.base_url, scripts, args.api_key)
        model = ChatAgentKV(client=client, async_client=async_client, **settings)
    else:
        model = ChatAgentKV(base_url=args.base_url, api_key=args.api_key, **settings)
    app = build(model)
    config: Any = {"configurable": {"thread_id": conversation_id("langgraph-example")}}
    for question in (
        "What is the weather in Paris, and what is 19 + 23?",
        "And in Rome?",
        "What did I ask you so far?",
    ):
        print(f"user: {question}")
        state = app.invoke({"messages": [HumanMessage(question)]}, config)
        print(f"assistant: {state['messages'][-1].text}")
    model.close()
    print_summary()


if __name__ == "__main__":
    main()
