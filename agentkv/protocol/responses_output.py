"""A Chat Completions answer as an OpenAI Responses ``response`` object and its output items
(vLLM 0.33: ``build_response_output_items`` in ``entrypoints/openai/responses/utils.py``,
``ResponsesResponse.from_request`` and the usage of ``responses_full_generator`` in
``responses/serving.py``). The request side is :mod:`agentkv.protocol.responses`; the streamed
answer, event by event, :mod:`agentkv.protocol.responses_stream`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from agentkv.protocol.responses import LOGPROBS, ItemIds, new_response_id
from agentkv.protocol.responses_tools import CUSTOM_TOOL_INPUT_KEY, Tools, tools_of

__all__ = [
    "base_response",
    "call_item",
    "chat_to_response",
    "finish_response",
    "item_status",
    "reasoning_item",
    "response_logprobs",
    "response_usage",
    "text_part",
]


def response_usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": prompt + completion,
    }


def response_logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` as the Responses ``output_text.logprobs``."""
    content = (chat_logprobs or {}).get("content") if isinstance(chat_logprobs, dict) else None
    out = []
    for lp in content or []:
        top = [
            {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes")}
            for t in lp.get("top_logprobs") or []
        ]
        out.append(
            {
                "token": lp.get("token"),
                "logprob": lp.get("logprob"),
                "bytes": lp.get("bytes"),
                "top_logprobs": top,
            }
        )
    return out


def base_response(
    request: Mapping[str, Any], response_id: str, created_at: int, model: str | None
) -> dict[str, Any]:
    """``ResponsesResponse.from_request`` without output, status and usage."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata"),
        "model": model or request.get("model") or "",
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "temperature": _or(request.get("temperature"), 1.0),
        "tool_choice": request.get("tool_choice") or ("auto" if request.get("tools") else "none"),
        "tools": list(request.get("tools") or []),
        "top_p": _or(request.get("top_p"), 1.0),
        "background": False,
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "previous_response_id": request.get("previous_response_id"),
        "prompt": None,
        "prompt_cache_key": request.get("prompt_cache_key"),
        "prompt_cache_retention": request.get("prompt_cache_retention"),
        "reasoning": request.get("reasoning"),
        "safety_identifier": request.get("safety_identifier"),
        "service_tier": request.get("service_tier") or "auto",
        "store": request.get("store") is not False,
        "text": request.get("text"),
        "top_logprobs": request.get("top_logprobs"),
        "truncation": request.get("truncation") or "disabled",
        "usage": None,
        "user": request.get("user"),
    }


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def item_status(finish_reason: Any) -> str:
    """vLLM ``response_item_status``: a ``length`` cut is ``incomplete``."""
    return "incomplete" if finish_reason == "length" else "completed"


def finish_response(response: dict[str, Any], finish_reason: Any) -> dict[str, Any]:
    status = item_status(finish_reason)
    response["status"] = status
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    return response


def reasoning_item(text: str, status: str | None, item_id: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(
    tools: Tools, name: str, arguments: str, call_id: str, status: str, item_id: str
) -> dict[str, Any]:
    if name in tools.custom:
        return {
            "id": item_id,
            "type": "custom_tool_call",
            "call_id": call_id,
            "name": name,
            "input": _custom_input(arguments),
        }
    local, namespace = tools.resolve(name)
    item: dict[str, Any] = {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": local,
        "arguments": arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _custom_input(arguments: str) -> str:
    """vLLM ``decode_custom_tool_input``: the shim's ``input``, or the text as it is."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def _tool_calls_of(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    return [c for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)]


def chat_to_response(
    chat: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    response_id: str | None = None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """A non-streamed Chat Completions answer as a ``response`` object (vLLM
    ``build_response_output_items`` and ``ResponsesResponse.from_request``)."""
    response_id = response_id or new_response_id()
    ids = ItemIds(response_id)
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    last_status = item_status(finish)
    tools = tools_of(request.get("tools"))
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning and request.get("include_reasoning", True) is not False:
        output.append(reasoning_item(reasoning, None, ids("rs")))
    calls = _tool_calls_of(message)
    content = message.get("content")
    if content:
        logprobs = (
            response_logprobs(choice.get("logprobs"))
            if LOGPROBS in (request.get("include") or [])
            else []
        )
        output.append(
            {
                "id": ids("msg"),
                "type": "message",
                "role": "assistant",
                "status": "completed" if calls else last_status,
                "content": [text_part(content, logprobs)],
            }
        )
    for i, call in enumerate(calls):
        fn = call["function"]
        status = last_status if i == len(calls) - 1 else "completed"
        call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
        name = str(fn.get("name"))
        item_id = ids("ctc" if name in tools.custom else "fc")
        output.append(call_item(tools, name, fn.get("arguments") or "", call_id, status, item_id))
    response = base_response(
        request,
        response_id,
        created_at if created_at is not None else int(chat.get("created") or time.time()),
        chat.get("model"),
    )
    response["output"] = output
    response["usage"] = response_usage(chat.get("usage"))
    if chat.get("kv_transfer_params") is not None:  # vLLM's own field (the router strips it)
        response["kv_transfer_params"] = chat["kv_transfer_params"]
    return finish_response(response, finish)
