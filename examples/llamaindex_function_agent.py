"""A LlamaIndex ``FunctionAgent`` with memory, on agentkv.

    python examples/llamaindex_function_agent.py --base-url http://127.0.0.1:8000/v1 --model MODEL

The one-line change is the LLM: ``AgentKV(...)``. Each chat session is one agentkv conversation
(``llama_index.llms.agentkv.session(memory)`` names it after the memory's ``session_id``); its
turns stay token-exact, and when the memory drops old messages to stay under its token limit,
agentkv sees a rewrite and moves the conversation to a new epoch.
"""

from __future__ import annotations

import asyncio
from typing import Any

from _common import arguments, conversation_id, print_receipt, print_summary
from _sim import Scripts, answer, clients, tool_call
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.memory import Memory
from llama_index.llms.agentkv import AgentKV, session


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny and 21 C in {city}."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def run(llm: AgentKV) -> None:
    agent = FunctionAgent(
        tools=[get_weather, add],
        llm=llm,
        system_prompt="You are a helpful assistant. Use the tools.",
    )
    # A small short-term memory, so that old messages are flushed during the example.
    memory = Memory.from_defaults(
        session_id=conversation_id("llamaindex-example"),
        token_limit=300,
        chat_history_token_ratio=0.5,
        token_flush_size=60,
    )
    with session(memory):
        for question in (
            "What is the weather in Paris, and what is 19 + 23?",
            "And in Rome?",
            "What did I ask you so far?",
        ):
            print(f"user: {question}")
            response = await agent.run(question, memory=memory)
            print(f"assistant: {response}")
    await llm.aclose()


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
                answer("You asked about Paris, Rome and a sum."),
            ]
        )
        client, async_client = clients(args.base_url, scripts, args.api_key)
        llm = AgentKV(client=client, async_client=async_client, **settings)
    else:
        llm = AgentKV(base_url=args.base_url, api_key=args.api_key, **settings)
    asyncio.run(run(llm))
    print_summary()


if __name__ == "__main__":
    main()
