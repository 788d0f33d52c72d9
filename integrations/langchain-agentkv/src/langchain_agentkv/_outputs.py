"""OpenAI completions, stream chunks and usage as LangChain's results (messages, chunks,
``usage_metadata``, ``llm_output``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import agentkv
from agentkv.adapters import reasoning_text

__all__ = [
    "add_usage",
    "ai_message",
    "generation_chunk",
    "result_from_chunks",
    "to_usage_metadata",
]


def add_usage(total: Any, value: Any) -> Any:
    if isinstance(value, Mapping):
        base = total if isinstance(total, Mapping) else {}
        return {k: add_usage(base.get(k), v) for k, v in {**base, **value}.items()}
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (total if isinstance(total, int | float) else 0) + value
    return value if total is None else total


def to_usage_metadata(usage: Any) -> UsageMetadata | None:
    if usage is None:
        return None
    data: Mapping[str, Any] = usage if isinstance(usage, Mapping) else usage.model_dump()
    cached = (data.get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt = int(data.get("prompt_tokens") or 0)
    completion = int(data.get("completion_tokens") or 0)
    meta: dict[str, Any] = {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        meta["input_token_details"] = {"cache_read": int(cached)}
    return cast(UsageMetadata, meta)


def ai_message(completion: ChatCompletion) -> AIMessage:
    choice = completion.choices[0]
    msg = choice.message
    calls, invalid = [], []
    for raw in msg.tool_calls or []:
        fn = getattr(raw, "function", None)
        if fn is None:
            continue
        try:
            args = json.loads(fn.arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("tool arguments must be a JSON object")
            calls.append(tool_call(name=fn.name, args=args, id=raw.id))
        except ValueError as exc:
            invalid.append(
                invalid_tool_call(name=fn.name, args=fn.arguments, id=raw.id, error=str(exc))
            )
    additional: dict[str, Any] = {}
    if msg.tool_calls:
        additional["tool_calls"] = [c.model_dump(exclude_none=True) for c in msg.tool_calls]
    if reasoning := reasoning_text(msg):
        additional["reasoning_content"] = reasoning
    return AIMessage(
        content=msg.content or "",
        tool_calls=calls,
        invalid_tool_calls=invalid,
        additional_kwargs=additional,
        response_metadata={
            "model_name": completion.model,
            "model_provider": "agentkv",
            "finish_reason": choice.finish_reason,
        },
        usage_metadata=to_usage_metadata(completion.usage),
        id=completion.id,
    )


def generation_chunk(raw: ChatCompletionChunk) -> ChatGenerationChunk | None:
    """A delta as a LangChain chunk (None for the usage chunk: the last chunk carries it)."""
    if not raw.choices:
        return None
    choice = raw.choices[0]
    delta = choice.delta
    additional: dict[str, Any] = {}
    if reasoning := reasoning_text(delta):
        additional["reasoning_content"] = reasoning
    calls = [
        tool_call_chunk(
            name=c.function.name if c.function else None,
            args=c.function.arguments if c.function else None,
            id=c.id,
            index=c.index,
        )
        for c in delta.tool_calls or []
    ]
    metadata: dict[str, Any] = {"model_provider": "agentkv"}
    if choice.finish_reason:
        metadata["finish_reason"] = choice.finish_reason
    message = AIMessageChunk(
        content=delta.content or "",
        tool_call_chunks=calls,
        additional_kwargs=additional,
        response_metadata=metadata,
        id=raw.id,
    )
    return ChatGenerationChunk(message=message)


def result_from_chunks(chunks: Sequence[ChatGenerationChunk]) -> ChatResult:
    if not chunks:
        raise agentkv.AgentKVError("the stream ended without a chunk")
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    message = total.message
    assert isinstance(message, AIMessageChunk)
    final = AIMessage(
        content=message.content,
        tool_calls=message.tool_calls,
        invalid_tool_calls=message.invalid_tool_calls,
        additional_kwargs=message.additional_kwargs,
        response_metadata=message.response_metadata,
        usage_metadata=message.usage_metadata,
        id=message.id,
    )
    usage = message.usage_metadata
    token_usage = None
    if usage is not None:
        token_usage = {
            "prompt_tokens": usage["input_tokens"],
            "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"],
        }
        cached = (usage.get("input_token_details") or {}).get("cache_read")
        if cached is not None:
            token_usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return ChatResult(
        generations=[ChatGeneration(message=final)],
        llm_output={"token_usage": token_usage, "model_provider": "agentkv"},
    )
