"""An OpenAI Agents SDK agent with a session, on agentkv.

    python examples/openai_agents_session.py --base-url http://127.0.0.1:8000/v1 --model MODEL

The one-line change is the run configuration:
``RunConfig(model_provider=AgentKVModelProvider(...))``. Inside
``agentkv_openai_agents.conversation(session)`` the session's id is the agentkv conversation
id; its turns stay token-exact, and when the session hands back only its last items
(``SessionSettings(limit=...)``), agentkv sees a rewrite and moves to a new epoch.

Tracing is the Agents SDK's own, and by default it exports every run's traces to OpenAI (with
``OPENAI_API_KEY``; without one it logs "OPENAI_API_KEY is not set, skipping trace export").
This example turns it off (``set_tracing_disabled(True)``). To keep traces instead: export them
to OpenAI with a key of their own, ``set_tracing_export_api_key("sk-...")``; or send them to
your own backend with ``set_trace_processors([MyProcessor()])`` (a ``TracingProcessor``; the
generation spans carry the served model and the usage, cached tokens included).
``RunConfig(tracing_disabled=True)`` turns it off for one run, ``OPENAI_AGENTS_DISABLE_TRACING=1``
for the process.
"""

from __future__ import annotations

import asyncio

from _common import arguments, connection, conversation_id, print_receipt, print_summary
from agentkv_openai_agents import AgentKVModelProvider, conversation
from agents import Agent, RunConfig, Runner, SQLiteSession, function_tool, set_tracing_disabled
from agents.memory import SessionSettings
from weather import QUESTIONS, SYSTEM, add, get_weather, scripted


async def run(provider: AgentKVModelProvider, model: str) -> None:
    tools = [function_tool(get_weather), function_tool(add)]
    agent = Agent(name="assistant", instructions=SYSTEM, tools=tools, model=model)
    session = SQLiteSession(conversation_id("agents-example"))
    config = RunConfig(model_provider=provider)
    with conversation(session):
        for question in QUESTIONS:
            print(f"user: {question}")
            result = await Runner.run(agent, question, session=session, run_config=config)
            print(f"assistant: {result.final_output}")
        # The session hands back only its last items: a rewrite, seen by agentkv.
        question = "What did I ask you last?"
        print(f"user: {question}")
        trimmed = RunConfig(model_provider=provider, session_settings=SessionSettings(limit=4))
        result = await Runner.run(agent, question, session=session, run_config=trimmed)
        print(f"assistant: {result.final_output}")
    session.close()
    await provider.aclose()


def main() -> None:
    args = arguments(__doc__ or "")
    # No trace export to OpenAI from a local example (see the module docstring for how to
    # export with set_tracing_export_api_key or to a processor of your own).
    set_tracing_disabled(True)
    scripts = scripted("You asked about the weather in Rome.")
    provider = AgentKVModelProvider(
        model=args.model, on_turn=print_receipt, **connection(args, scripts)
    )
    asyncio.run(run(provider, args.model))
    print_summary()


if __name__ == "__main__":
    main()
