"""What the router tests' agent sends: its tools, a long system prompt and its scripted turns
(shared by the in-process tests and the subprocess e2e tests)."""

from __future__ import annotations

from typing import Any

from tools_support import function_tool

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
