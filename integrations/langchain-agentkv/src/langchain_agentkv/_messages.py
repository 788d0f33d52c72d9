"""LangChain messages and options as the OpenAI request fields agentkv sends (its ledger holds
OpenAI chat messages)."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.utils.function_calling import convert_to_openai_function

__all__ = ["openai_tool_choice", "response_format", "to_openai_message"]


def response_format(schema: dict[str, Any] | type, strict: bool | None) -> dict[str, Any]:
    """``response_format`` for ``method="json_schema"`` (as langchain-openai builds it)."""
    if isinstance(schema, dict) and schema.get("type") == "json_schema" and "json_schema" in schema:
        return schema
    if isinstance(schema, dict) and "name" in schema and "schema" in schema:
        return {"type": "json_schema", "json_schema": schema}
    if strict is None:
        given = schema.get("strict") if isinstance(schema, dict) else None
        strict = given if isinstance(given, bool) else False
    function = dict(convert_to_openai_function(schema, strict=strict))
    function["schema"] = function.pop("parameters")
    return {"type": "json_schema", "json_schema": function}


def _text(content: str | list[str | dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif part.get("type") == "text":
            parts.append(str(part.get("text", "")))
    return "".join(parts)


def _user_content(content: str | list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if all(isinstance(p, str) or p.get("type") == "text" for p in content):
        return _text(content)
    return [{"type": "text", "text": p} if isinstance(p, str) else dict(p) for p in content]


def to_openai_message(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as an OpenAI chat message (what agentkv's ledger holds)."""
    if isinstance(message, SystemMessage):
        role = "developer" if message.additional_kwargs.get("__openai_role__") else "system"
        return {"role": role, "content": _text(message.content)}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": _user_content(message.content)}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
        raw = {c.get("id"): c for c in message.additional_kwargs.get("tool_calls") or []}
        calls: list[dict[str, Any]] = []
        for call in message.tool_calls:
            original = raw.get(call.get("id"))
            arguments = (original or {}).get("function", {}).get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(call["args"])
            calls.append(
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {"name": call["name"], "arguments": arguments},
                }
            )
        for bad in message.invalid_tool_calls:
            calls.append(
                {
                    "id": bad.get("id"),
                    "type": "function",
                    "function": {"name": bad.get("name"), "arguments": bad.get("args") or ""},
                }
            )
        if calls:
            out["tool_calls"] = calls
            out["content"] = out["content"] or None
        return out
    if isinstance(message, ToolMessage):
        return {
            "role": "tool",
            "tool_call_id": message.tool_call_id,
            "content": _text(message.content),
        }
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": _text(message.content)}
    raise TypeError(f"ChatAgentKV cannot send a {type(message).__name__}")


def openai_tool_choice(choice: str | bool | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return choice
    if choice is True or choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return str(choice)
    return {"type": "function", "function": {"name": choice}}
