"""The tools of an OpenAI Responses request as Chat Completions tools, as vLLM 0.33 shows them
to the model (``get_function_tools`` in ``tool_parsers/utils.py``: namespace tools flattened to
``<namespace>__<name>``, custom tools shown as a one-string function, hosted tools dropped), and
its ``tool_choice``. The rest of the request is :mod:`agentkv.protocol.responses`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentkv.protocol.errors import APIError

__all__ = ["CUSTOM_TOOL_INPUT_KEY", "NAMESPACE_SEPARATOR", "Tools", "tool_choice", "tools_of"]

NAMESPACE_SEPARATOR = "__"
"""vLLM's ``_NAMESPACE_TOOL_SEPARATOR``: a namespace's functions are ``<namespace>__<name>``."""
CUSTOM_TOOL_INPUT_KEY = "input"
"""The one parameter of the function a ``custom`` tool is shown as (vLLM's name)."""
_CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        CUSTOM_TOOL_INPUT_KEY: {
            "type": "string",
            "description": "The freeform text payload for this tool.",
        }
    },
    "required": [CUSTOM_TOOL_INPUT_KEY],
    "additionalProperties": False,
}


@dataclass
class Tools:
    """A request's tools as the model sees them, and the way back from a call's name."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Flat name -> (namespace, name)."""
    custom: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    """Every name the model can call (flat)."""

    def resolve(self, name: str) -> tuple[str, str | None]:
        """A called flat name as (name, namespace) (vLLM ``resolve_responses_tool_call_name``)."""
        if name in self.namespaced:
            namespace, local = self.namespaced[name]
            return local, namespace
        return name, None


def _function(name: Any, tool: Mapping[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise APIError(400, "A function tool needs a `name` (a string).", param=param)
    fn: dict[str, Any] = {"name": name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def tools_of(raw: Any) -> Tools:
    """vLLM ``get_function_tools``: function tools as they are, namespace functions flattened,
    custom tools as a one-string function; other (built-in) tool types dropped."""
    out = Tools()
    if raw is None:
        return out
    if not isinstance(raw, list):
        raise APIError(400, "`tools` must be a list.", param="tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise APIError(400, "Each tool must be an object.", param=f"tools[{i}]")
        kind = tool.get("type")
        if kind == "function":
            out.chat.append(_function(tool.get("name"), tool, f"tools[{i}]"))
        elif kind == "namespace":
            namespace = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(inner, list):
                raise APIError(
                    400,
                    "A namespace tool needs a `name` and a list of `tools`.",
                    param=f"tools[{i}]",
                )
            for j, sub in enumerate(inner):
                if not isinstance(sub, dict) or sub.get("type") != "function":
                    continue
                local = sub.get("name")
                flat = f"{namespace}{NAMESPACE_SEPARATOR}{local}"
                out.chat.append(_function(flat, sub, f"tools[{i}].tools[{j}]"))
                out.namespaced[flat] = (namespace, str(local))
        elif kind == "custom":
            fmt = tool.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                raise APIError(
                    400,
                    "Custom tools with a grammar format are not supported; only free-form text "
                    "custom tools are accepted.",
                    param="tools",
                )
            shim = {"description": tool.get("description"), "parameters": _CUSTOM_TOOL_PARAMETERS}
            out.chat.append(_function(tool.get("name"), shim, f"tools[{i}]"))
            out.custom.add(str(tool.get("name")))
        elif not isinstance(kind, str):
            raise APIError(400, "Each tool needs a `type`.", param=f"tools[{i}]")
        # any other type is a built-in tool: never shown to the model (as vLLM)
    out.names = {t["function"]["name"] for t in out.chat}
    return out


def tool_choice(choice: Any, tools: Tools, has_tools: bool) -> Any:
    """vLLM ``check_tool_usage`` and ``_resolve_named_tool_choice``, in chat's form."""
    if choice is None or choice == "auto":
        return "auto" if has_tools else "none"
    if choice in ("none", "required"):
        if choice == "required" and not has_tools:
            raise APIError(
                400,
                "Tool choice 'required' must be specified with 'tools' parameter.",
                param="tool_choice",
            )
        if choice == "required" and not tools.chat:
            raise APIError(
                400,
                "tool_choice requires a function call, but tools contains no function tool the "
                "model can call.",
                param="tool_choice",
            )
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str) or not name or not has_tools:
            raise APIError(
                400, "Tool choice 'function' not found in 'tools' parameter.", param="tool_choice"
            )
        if name not in tools.names:
            local = [flat for flat, (_, n) in tools.namespaced.items() if n == name]
            if len(local) > 1:
                raise APIError(
                    400,
                    f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
                    f"({', '.join(local)}). Select it by its full '<namespace>__<name>' name.",
                    param="tool_choice",
                )
            if not local:
                raise APIError(
                    400,
                    "Tool choice 'function' not found in 'tools' parameter.",
                    param="tool_choice",
                )
            name = local[0]
        return {"type": "function", "function": {"name": name}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise APIError(
        400,
        f"tool_choice {kind!r} is not supported: the engine runs no built-in tools; offer a "
        "function tool instead.",
        param="tool_choice",
    )
