"""What the router tests' agent sends: its tools and a long system prompt (shared by the
in-process tests and the subprocess e2e tests)."""

from __future__ import annotations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
SYSTEM = "You are a coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(40))
