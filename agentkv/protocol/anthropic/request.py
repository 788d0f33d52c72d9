"""A Messages request as the Chat Completions body vLLM 0.33 runs for it
(``vllm/entrypoints/anthropic/serving.py``, ``to_chat_completion_request`` and its helpers)."""

from __future__ import annotations

import json
import time
from typing import Any

from agentkv.protocol.anthropic.models import (
    BadRequest,
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolDefinition,
    parse_request,
)
from agentkv.protocol.names import BODY_CONVERSATION_ID, BODY_SIM_SCRIPT

__all__ = ["BILLING_HEADER", "PASSED_THROUGH", "count_tokens_body", "messages_to_chat", "to_chat"]

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's first system block (``cc_version=…; cc_entrypoint=…; cch=<nonce>``): a
per-request value that would defeat prefix caching; vLLM drops it (PR #36829)."""
PASSED_THROUGH = (BODY_CONVERSATION_ID, BODY_SIM_SCRIPT)
"""agentkv's own body fields, kept on the chat body (vLLM would ignore them)."""


def messages_to_chat(
    body: dict[str, Any],
    *,
    count_tokens: bool = False,
    merge_inline_system: bool = False,
    disabled_thinking_effort: str = "none",
) -> dict[str, Any]:
    """The Chat Completions body vLLM runs for an Anthropic ``body`` (:class:`BadRequest`)."""
    request = parse_request(body, count_tokens=count_tokens)
    return to_chat(
        request,
        body,
        merge_inline_system=merge_inline_system,
        disabled_thinking_effort=disabled_thinking_effort,
    )


def to_chat(
    request: CountTokensRequest,
    body: dict[str, Any] | None = None,
    *,
    merge_inline_system: bool = False,
    disabled_thinking_effort: str = "none",
) -> dict[str, Any]:
    """vLLM's ``to_chat_completion_request``, as the JSON body of that request.

    Args:
        request: the parsed request; a ``count_tokens`` one gives model, messages, tools and
            template arguments only (vLLM's ``_build_base_request``).
        body: the raw body, for agentkv's own fields (:data:`PASSED_THROUGH`).
        merge_inline_system: the chat template wants the system prompt first (vLLM probes the
            template: ``_detect_merge_inline_system``): ``system`` messages inside ``messages``
            join the leading system message instead of staying where they are.
        disabled_thinking_effort: the ``reasoning_effort`` of ``thinking: disabled`` (vLLM
            probes the template: ``none``, or ``low`` when the template ignores ``none``).
    """
    messages: list[dict[str, Any]] = []
    _system_message(request, messages, merge_inline_system)
    _messages(request.messages, messages, merge_inline_system)
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    if isinstance(request, MessagesRequest):
        chat["max_tokens"] = request.max_tokens
        chat["max_completion_tokens"] = request.max_tokens
        for name, value in (
            ("stop", request.stop_sequences),
            ("temperature", request.temperature),
            ("top_p", request.top_p),
            ("top_k", request.top_k),
            ("watermarking", request.watermarking),
            ("cache_salt", request.cache_salt),
            ("kv_transfer_params", request.kv_transfer_params),
            ("ec_transfer_params", request.ec_transfer_params),
            ("vllm_xargs", request.vllm_xargs),
        ):
            if value is not None:
                chat[name] = value
        if request.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if request.chat_template_kwargs is not None:
        chat["chat_template_kwargs"] = request.chat_template_kwargs
    _output_config(request, chat)
    _thinking(request, chat, disabled_thinking_effort)
    _tool_choice(request, chat)
    _tools(request, chat)
    _fold_effort(chat)
    for name in PASSED_THROUGH:
        if body is not None and name in body:
            chat[name] = body[name]
    return chat


def count_tokens_body(chat: dict[str, Any]) -> dict[str, Any]:
    """``/tokenize``'s body for a chat body: the prompt vLLM's chat path renders for it."""
    keys = ("model", "messages", "tools", "chat_template_kwargs")
    return {k: chat[k] for k in keys if k in chat}


def _billing(text: str) -> bool:
    return text.startswith(BILLING_HEADER)


def _system_message(
    request: CountTokensRequest, out: list[dict[str, Any]], merge_inline_system: bool
) -> None:
    """``_convert_system_message``: the top-level ``system`` (text blocks joined with no
    separator, the billing header dropped), then the inline ones when merging."""
    parts: list[str] = []
    if request.system:
        if isinstance(request.system, str):
            parts.append(request.system)
        else:
            parts.extend(
                b.text
                for b in request.system
                if b.type == "text" and b.text and not _billing(b.text)
            )
    if merge_inline_system:
        for msg in request.messages:
            if msg.role == "system" and (text := _system_text(msg)):
                parts.append(text)
    if parts:
        out.append({"role": "system", "content": "".join(parts)})


def _system_text(msg: Message) -> str | None:
    """``_extract_system_text``."""
    if isinstance(msg.content, str):
        return None if _billing(msg.content) else msg.content
    parts = [b.text for b in msg.content if b.type == "text" and b.text and not _billing(b.text)]
    return "".join(parts) if parts else None


def _messages(
    messages: list[Message], out: list[dict[str, Any]], merge_inline_system: bool
) -> None:
    """``_convert_messages``: a user message left without content is dropped (its tool results
    went out as ``tool`` messages before it); an assistant one is kept."""
    for msg in messages:
        if msg.role == "system":
            if not merge_inline_system and (text := _system_text(msg)):
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": msg.role}
        if isinstance(msg.content, str):
            converted["content"] = msg.content
        else:
            _content(msg, converted, out)
        if not (msg.role == "user" and "content" not in converted):
            out.append(converted)


def _content(msg: Message, converted: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """``_convert_message_content`` and ``_convert_block``."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    assert not isinstance(msg.content, str)
    for block in msg.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            calls.append(
                {
                    "id": block.id or f"call_{int(time.time())}",
                    "type": "function",
                    # json.dumps as vLLM writes them: these bytes are what the template renders
                    "function": {
                        "name": block.name or "",
                        "arguments": json.dumps(block.input or {}),
                    },
                }
            )
        elif block.type == "tool_result":
            if msg.role == "user":
                _user_tool_result(block, out)
            else:
                result = str(block.content) if block.content else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
        # redacted_thinking (opaque), tool_reference, tool_addition/removal: nothing here
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        if len(parts) == 1 and parts[0]["type"] == "text":
            converted["content"] = parts[0]["text"]
        else:
            converted["content"] = parts


def _image_url(source: dict[str, Any]) -> str:
    """``_convert_image_source_to_url``: a URL as is, base64 data as a data URI."""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _user_tool_result(block: ContentBlock, out: list[dict[str, Any]]) -> None:
    """``_convert_user_tool_result``: a ``tool`` message (text parts joined by newlines), then
    its images as a user message, then its tool references as another ``tool`` message."""
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(block.content, str):
        text = block.content
    elif isinstance(block.content, list):
        texts: list[str] = []
        for item in block.content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image" and (url := _image_url(item.get("source", {}))):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.tool_use_id or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        out.append({"role": "user", "content": parts})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _output_config(request: CountTokensRequest, chat: dict[str, Any]) -> None:
    """``_handle_output_config``: a JSON schema as ``response_format``, the effort as
    ``reasoning_effort``."""
    config = request.output_config
    if config is None:
        return
    if config.format is not None and config.format.json_schema:
        chat["response_format"] = {
            "type": config.format.type,
            "json_schema": {"name": config.format.type, "schema": config.format.json_schema},
        }
    if config.effort is not None:
        chat["reasoning_effort"] = config.effort


def _thinking(request: CountTokensRequest, chat: dict[str, Any], disabled_effort: str) -> None:
    """``_handle_thinking``: disabled sets the effort that turns thinking off, enabled its
    budget; adaptive pins nothing (``display`` is ignored: reasoning is always returned)."""
    thinking = request.thinking
    if isinstance(thinking, ThinkingDisabled):
        chat["reasoning_effort"] = disabled_effort
    elif isinstance(thinking, ThinkingEnabled):
        chat["thinking_token_budget"] = thinking.budget_tokens


def _tool_choice(request: CountTokensRequest, chat: dict[str, Any]) -> None:
    """``_convert_tool_choice``: auto, any → required, none, tool → a named function."""
    choice = request.tool_choice
    if choice is None:
        return
    chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _resolved_tools(request: CountTokensRequest) -> list[Tool] | None:
    """``_resolve_tools``: the tools in effect after the ``tool_addition``/``tool_removal``
    blocks of system messages."""
    changes = [
        block
        for msg in request.messages
        if not isinstance(msg.content, str)
        for block in msg.content
        if block.type in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return request.tools
    tools = {tool.name: tool for tool in request.tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block.tool
        assert change is not None
        if isinstance(change, ToolDefinition):
            name = change.definition.name
            tools[name] = change.definition
        else:
            name = change.name
            if name not in tools:
                raise BadRequest(
                    f"{block.type} references tool {name!r}, which is not declared in tools"
                )
            if block.type == "tool_addition":
                tools[name] = tools[name].model_copy(update={"defer_loading": None})
        if block.type == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]


def _tools(request: CountTokensRequest, chat: dict[str, Any]) -> None:
    """``_convert_tools``: OpenAI function tools as vLLM serializes them for the template
    (``description`` always, ``strict``/``defer_loading`` when set); ``tool_choice`` auto
    unless given."""
    tools = _resolved_tools(request)
    if tools is None:
        return
    out = []
    for tool in tools:
        function: dict[str, Any] = {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.input_schema,
        }
        if tool.strict is not None:
            function["strict"] = tool.strict
        if tool.defer_loading is not None:
            function["defer_loading"] = tool.defer_loading
        out.append({"type": "function", "function": function})
    chat.setdefault("tool_choice", "auto")
    chat["tools"] = out


def _fold_effort(chat: dict[str, Any]) -> None:
    """vLLM's ``build_chat_params``: a ``reasoning_effort`` reaches the template as itself and
    as ``enable_thinking`` (unless the client set that). Done here so ``/tokenize``, which
    ignores ``reasoning_effort``, renders the prompt the chat endpoint does."""
    effort = chat.get("reasoning_effort")
    if effort is None:
        return
    given = chat.get("chat_template_kwargs") or {}
    kwargs = {**given, "reasoning_effort": effort}
    if "enable_thinking" not in given:
        kwargs["enable_thinking"] = effort != "none"
    chat["chat_template_kwargs"] = kwargs
