"""Schema typing of ``qwen3_coder`` tool-call arguments, as vLLM 0.33 does it
(``ParserEngine._fix_arg_types`` with ``coerce_to_schema_type`` of ``vllm/tool_parsers/utils.py``):
every value is a string unless the request's tool schema types it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["fix_arg_types"]

_TYPE_ALIASES = {
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "int": "integer",
    "int32": "integer",
    "int64": "integer",
    "uint": "integer",
    "uint32": "integer",
    "uint64": "integer",
    "long": "integer",
    "short": "integer",
    "unsigned": "integer",
    "float": "number",
    "float32": "number",
    "float64": "number",
    "double": "number",
    "bool": "boolean",
    "dict": "object",
    "arr": "array",
    "list": "array",
    "sequence": "array",
}
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")
# An enum value's JSON type, the first that matches (bool before int: True is an int).
_VALUE_TYPES: tuple[tuple[type, str], ...] = (
    (type(None), "null"),
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _json_type(value: object) -> str | None:
    return next((name for kind, name in _VALUE_TYPES if isinstance(value, kind)), None)


def _schema_types(schema: object) -> list[str]:
    """``extract_types_from_schema``."""
    if not isinstance(schema, Mapping):
        return ["string"]
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            json_type = _json_type(value)
            if json_type is not None:
                types.add(json_type)
    for choice in ("anyOf", "oneOf", "allOf"):
        options = schema.get(choice)
        if isinstance(options, list):
            for option in options:
                types.update(_schema_types(option))
    return list(types) if types else ["string"]


def _json_finite(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def _coerce(value: str, types: Sequence[str]) -> Any:
    """``coerce_to_schema_type``: the first type in priority order that ``value`` reads as."""
    wanted = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _TYPE_PRIORITY:
        if kind not in wanted:
            continue
        if kind == "null":
            if value.lower() == "null":
                return None
        elif kind == "string":
            return value
        elif kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        elif kind == "number":
            try:
                return int(value)
            except ValueError:
                pass
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        elif kind == "boolean":
            lowered = value.lower().strip()
            if lowered in ("true", "1"):
                return True
            if lowered in ("false", "0"):
                return False
        else:  # object, array
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _json_finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _json_finite(parsed) else value


def _coerce_value(value: Any, schema: Mapping[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        coerced = _coerce(value, _schema_types(schema))
        return coerced, coerced is not value
    if isinstance(value, dict):
        nested = schema.get("properties")
        if isinstance(nested, Mapping):
            return value, _coerce_dict(value, nested)
        return value, False
    if isinstance(value, list):
        items = schema.get("items")
        changed = False
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                coerced, item_changed = _coerce_value(item, items)
                if item_changed:
                    value[i] = coerced
                    changed = True
        return value, changed
    coerced = _coerce(json.dumps(value, ensure_ascii=False), _schema_types(schema))
    if type(coerced) is not type(value) or coerced != value:
        return coerced, True
    return value, False


def _coerce_dict(args: dict[str, Any], properties: Mapping[str, Any]) -> bool:
    changed = False
    for key, value in args.items():
        prop = properties.get(key)
        if not isinstance(prop, Mapping):
            continue
        coerced, value_changed = _coerce_value(value, prop)
        if value_changed:
            args[key] = coerced
            changed = True
    return changed


def _tool_properties(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    """``find_tool_properties`` over chat-completions tools (``{"type": "function", ...}``)."""
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties", {}) if isinstance(parameters, Mapping) else {}
            return properties if isinstance(properties, Mapping) else {}
    return {}


def fix_arg_types(arguments: str, name: str, tools: Sequence[Mapping[str, Any]] | None) -> str:
    if not tools:
        return arguments
    properties = _tool_properties(tools, name)
    args = json.loads(arguments)
    if not properties or not isinstance(args, dict):
        return arguments
    if _coerce_dict(args, properties):
        return json.dumps(args, ensure_ascii=False)
    return arguments
