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

from _common import arguments, connection, conversation_id, print_receipt, print_summary
from langchain_agentkv import ChatAgentKV
from langchain_core.messages import AnyMessage, HumanMessage, RemoveMessage, SystemMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.prebuilt import ToolNode, tools_condition
from weather import QUESTIONS, SYSTEM, add, get_weather, scripted

SYSTEM_MESSAGE = SystemMessage(SYSTEM)
SUMMARIZE_AFTER = 8  # messages in the state before the summary step runs


def build(model: ChatAgentKV) -> Any:
    tools = [tool(get_weather), tool(add)]
    agent_model = model.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [agent_model.invoke([SYSTEM_MESSAGE, *state["messages"]])]}

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
    scripts = scripted(
        "The user asked about the weather in Paris and Rome, and 19 + 23.",  # the summary
        "You asked about Paris, Rome and a sum.",
    )
    model = ChatAgentKV(
        model=args.model, max_tokens=256, on_turn=print_receipt, **connection(args, scripts)
    )
    app = build(model)
    config: Any = {"configurable": {"thread_id": conversation_id("langgraph-example")}}
    for question in (*QUESTIONS, "What did I ask you so far?"):
        print(f"user: {question}")
        state = app.invoke({"messages": [HumanMessage(question)]}, config)
        print(f"assistant: {state['messages'][-1].text}")
    model.close()
    print_summary()


if __name__ == "__main__":
    main()
