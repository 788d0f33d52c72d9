"""A LlamaIndex ``FunctionAgent`` with memory, on agentkv.

    python examples/llamaindex_function_agent.py --base-url http://127.0.0.1:8000/v1 --model MODEL

The one-line change is the LLM: ``AgentKV(...)``. Each chat session is one agentkv conversation
(``llama_index.llms.agentkv.session(memory)`` names it after the memory's ``session_id``); its
turns stay token-exact, and when the memory drops old messages to stay under its token limit,
agentkv sees a rewrite and moves the conversation to a new epoch.
"""

from __future__ import annotations

import asyncio

from _common import arguments, connection, conversation_id, print_receipt, print_summary
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.memory import Memory
from llama_index.llms.agentkv import AgentKV, session
from weather import QUESTIONS, SYSTEM, add, get_weather, scripted


async def run(llm: AgentKV) -> None:
    agent = FunctionAgent(tools=[get_weather, add], llm=llm, system_prompt=SYSTEM)
    # A small short-term memory, so that old messages are flushed during the example.
    memory = Memory.from_defaults(
        session_id=conversation_id("llamaindex-example"),
        token_limit=300,
        chat_history_token_ratio=0.5,
        token_flush_size=60,
    )
    with session(memory):
        for question in (*QUESTIONS, "What did I ask you so far?"):
            print(f"user: {question}")
            response = await agent.run(question, memory=memory)
            print(f"assistant: {response}")
    await llm.aclose()


def main() -> None:
    args = arguments(__doc__ or "")
    scripts = scripted("You asked about Paris, Rome and a sum.")
    llm = AgentKV(
        model=args.model, max_tokens=256, on_turn=print_receipt, **connection(args, scripts)
    )
    asyncio.run(run(llm))
    print_summary()


if __name__ == "__main__":
    main()
