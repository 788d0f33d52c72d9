"""Chat messages as vLLM 0.33 and transformers prepare them for a template: vLLM's
preprocessing (content parts, tool calls, system messages) and transformers' normalisation.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from agentkv.chat.content_format import ContentFormat

logger = logging.getLogger("agentkv.chat.template")

# Names a message's reasoning goes under; the first is the one templates read (transformers).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Text-like content part types (vLLM ``TEXT_PART_TYPES``) and the key holding their text.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Keys of vLLM's content part types; the others are kept on text parts in "openai" format.
_KNOWN_PART_KEYS = frozenset(
    {
        "type", "text", "refusal", "thinking", "closed", "image_url", "input_audio", "file",
        "audio_url", "video_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds",
        "data", "uuid", "name",
    }
)  # fmt: skip
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


# --------------------------------------------------------------------------------------------
# vLLM message preprocessing


def preprocess_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    content_format: ContentFormat,
) -> list[dict[str, Any]]:
    """vLLM's ``parse_chat_messages`` for text content; returns new dicts, never edits inputs.

    Each message keeps ``role`` and ``content`` plus: ``tool_calls`` and the reasoning
    (``reasoning``, else the deprecated ``reasoning_content``, copied to both names) on
    assistant messages, ``tool_call_id`` on tool messages, ``name`` and ``task`` when strings,
    ``tools`` on developer messages. Other fields are dropped, as vLLM drops them.

    Content: in ``"string"`` format, ``None`` becomes ``""`` and text parts are joined with
    ``"\\n"``; in ``"openai"`` format a string becomes ``[{"type": "text", "text": ...}]`` and
    ``None`` ``[]``. Tool results made only of text parts become one string in both formats.
    Tool-call ``arguments`` strings are ``json.loads``-ed; invalid JSON, non-objects and empty
    values become ``{}`` (vLLM logs a warning and goes on), and an empty ``tool_calls`` list is
    removed. Non-text content parts (images, audio, ...) raise ``ValueError``.
    """
    conversation = [_parse_message(m, content_format) for m in messages]
    _postprocess_tool_calls(conversation)
    return conversation


def _parse_message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message["role"]
    content = message.get("content")
    # ChatCompletionRequest renames the deprecated ``reasoning_content`` to ``reasoning``.
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")

    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list | tuple):
        parts = list(content)
    else:
        raise ValueError(
            f"Message content must be a string or a list of content parts, "
            f"not {type(content).__name__}."
        )
    if role == "system":
        parts = _strip_billing_header(parts)
    wrap = content_format == "openai"
    parsed = [p for p in (_parse_part(part, wrap) for part in parts) if p]
    result: dict[str, Any] = {
        "role": role,
        "content": parsed if wrap else "\n".join(parsed),
    }
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            result["tool_calls"] = copy.deepcopy(list(tool_calls))
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        items = result["content"]
        if isinstance(items, list) and not any(
            isinstance(i, dict) and i.get("type") != "text" for i in items
        ):
            texts = [i.get("text", "") for i in items if isinstance(i, dict)]
            result["content"] = "\n".join(texts) if texts else ""
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if isinstance(message.get("task"), str):
        result["task"] = message["task"]
    if role == "developer":
        result["tools"] = copy.deepcopy(message.get("tools"))
    return result


def _parse_part(part: Any, wrap: bool) -> Any:
    """One content part as vLLM's ``parse_chat_message_content_part`` (text-only)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, Mapping):
        raise ValueError(f"Invalid content part: {part!r}")
    part_type = part.get("type")
    if part_type is None:
        if "tool_reference" in part:
            part_type = "tool_reference"
        else:
            raise ValueError("Missing 'type' field in multimodal part.")
    if part_type == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if wrap else name
    if part_type not in _TEXT_PARTS:
        raise ValueError(
            f"Unsupported content part type for the simulator (text only): {part_type!r}"
        )
    text = part.get(_TEXT_PARTS[part_type])
    if text is None and part_type in ("text", "refusal"):
        logger.warning("Skipping content part %r with empty content.", part_type)
        return None
    if not wrap:
        return text
    extra = {k: copy.deepcopy(v) for k, v in part.items() if k not in _KNOWN_PART_KEYS}
    return {"type": "text", "text": text, **extra}


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Drop Claude Code's per-request ``x-anthropic-billing-header`` line from system text."""
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            text: object = part
        elif isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _postprocess_tool_calls(conversation: list[dict[str, Any]]) -> None:
    """vLLM ``_postprocess_messages``: tool-call arguments become dicts."""
    for message in conversation:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        tool_calls = message["tool_calls"]
        if not isinstance(tool_calls, list):
            continue
        if not tool_calls:
            del message["tool_calls"]  # keeps templates on the plain assistant path
            continue
        for item in tool_calls:
            if not isinstance(item, dict):
                raise ValueError("assistant tool_calls entries must be objects.")
            function = item.get("function")
            if item.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError(
                    "chat completions only support assistant tool_calls of type 'function'."
                )
            arguments = function.get("arguments")
            parsed: Any = {}
            if isinstance(arguments, dict) and arguments:
                parsed = arguments
            elif isinstance(arguments, str) and arguments:
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    logger.warning(
                        "Tool call has arguments that are not valid JSON (%d chars); "
                        "coercing to an empty object so the conversation can continue.",
                        len(arguments),
                    )
                    parsed = None
            elif arguments:
                parsed = arguments
            if not isinstance(parsed, dict):
                if parsed is not None:
                    logger.warning(
                        "Tool call arguments decoded to %s, not a JSON object; "
                        "coercing to an empty object.",
                        type(parsed).__name__,
                    )
                parsed = {}
            function["arguments"] = parsed


def developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        out.append(msg)
    return out


def consolidate_system_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge all system messages into one at position 0 (vLLM)."""
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    needed = False
    for i, msg in enumerate(conversation):
        if msg["role"] != "system":
            others.append(msg)
            continue
        if i > 0 or contents:
            needed = True
        content = msg.get("content", "")
        if isinstance(content, list):
            texts = [
                p["text"] if isinstance(p, dict) else p
                for p in content
                if (isinstance(p, dict) and "text" in p) or isinstance(p, str)
            ]
            content = "\n".join(texts)
        if content:
            contents.append(content)
    if not needed:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


# --------------------------------------------------------------------------------------------
# transformers' input normalisation


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``_normalize_chat_messages``: objects to dicts, then drop keys whose value is ``None``."""
    out = []
    for message in _objects_to_dicts(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(
                "Chat messages should be dicts, dataclasses or pydantic models, "
                f"but got {message!r}."
            )
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _objects_to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _objects_to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def plain(value: Any) -> Any:
    """``_plain_template_data``: rebuild what the template sees from plain JSON types."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return plain(value.item())  # numpy scalars (``np.generic``)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def alias_reasoning_fields(chat: list[Any]) -> list[Any]:
    """Fill ``reasoning_content`` (and ``thinking``, read by gpt-oss) from any reasoning name."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next(
                (message[k] for k in REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def error_reason(exc: BaseException) -> str:
    """vLLM ``_template_error_reason``: the innermost Jinja error's text, else ``str(exc)``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)
