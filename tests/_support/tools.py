"""OpenAI tool definitions for the tests' scripted agents."""

from __future__ import annotations

from typing import Any


def chat_tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat function tool: ``parameters`` is its JSON schema."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def function_tool(name: str, description: str, **params: str) -> dict[str, Any]:
    """A function tool whose parameters are an object of ``params`` (name: JSON type)."""
    properties = {key: {"type": kind} for key, kind in params.items()}
    return chat_tool(name, description, {"type": "object", "properties": properties})
