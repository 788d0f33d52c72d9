"""What the router tests' agent sends: its tools, a long system prompt and its scripted turns
(shared by the in-process tests and the subprocess e2e tests)."""

from __future__ import annotations

from typing import Any

import agentkv
from tests._support.tools import function_tool

TOOLS = [function_tool("read_file", "Read a file", path="string")]
SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(40))


def agent_step(i: int) -> tuple[dict[str, Any], str | None]:
    """Turn ``i`` of a tool-using agent: its scripted answer (a tool call on even turns, an
    answer on odd ones) and what follows it (the tool's result; None: a new question)."""
    if i % 2 == 0:
        call = {"name": "read_file", "arguments": {"path": f"src/mod{i}.py"}}
        script = {"reasoning": f"I should read file {i}.", "content": "", "tool_calls": [call]}
        return script, f"def f{i}():\n    return {i}\n" * 4
    return {"reasoning": f"Done with {i}.", "content": f"File {i} defines f{i - 1}. " * 6}, None


def agent_turns(conv: Any, n: int, start: int = 0) -> None:
    """n turns of a tool-using agent: a tool call, its result, an answer, a new question."""
    for i in range(start, start + n):
        script, tool_result = agent_step(i)
        completion = conv.create(max_tokens=400, extra_body={"agentkv_sim": script})
        if tool_result is not None:
            call = completion.choices[0].message.tool_calls[0]
            conv.add_tool_result(call.id, tool_result)
        else:
            conv.add_user(f"Now look at module {i + 1}.")


def client(s: Any) -> agentkv.Client:
    """An SDK client of the stack's router."""
    return agentkv.Client(base_url=f"{s.router.url}/v1", api_key="k")


LONG = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Start."}]
