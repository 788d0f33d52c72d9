"""OpenAI chat messages from LlamaIndex's and back: the messages agentkv's ledger holds, the
chat responses (whole and streamed) LlamaIndex expects."""

from __future__ import annotations

import json
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from agentkv.adapters import reasoning_text, turn_metadata
from agentkv.pool import Turn

__all__ = [
    "StreamAccumulator",
    "assistant_message",
    "chat_response",
    "openai_tool_choice",
    "raw_call",
    "to_openai_message",
]


def openai_tool_choice(choice: str | dict[str, Any] | None, required: bool) -> str | dict[str, Any]:
    if choice is None:
        return "required" if required else "auto"
    if isinstance(choice, dict) or choice in ("none", "auto", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def raw_call(call: Any) -> dict[str, Any]:
    data = call.model_dump() if hasattr(call, "model_dump") else dict(call)
    fn = data.get("function") or {}
    args = fn.get("arguments")
    return {
        "id": data.get("id"),
        "type": "function",
        "function": {
            "name": fn.get("name"),
            "arguments": args if isinstance(args, str) else json.dumps(args or {}),
        },
    }


def to_openai_message(message: ChatMessage) -> dict[str, Any]:
    """A LlamaIndex chat message as an OpenAI chat message (what agentkv's ledger holds)."""
    role = message.role.value
    if role in ("chatbot", "model"):
        role = "assistant"
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolCallBlock):
            args = block.tool_kwargs
            calls.append(
                {
                    "id": block.tool_call_id,
                    "type": "function",
                    "function": {
                        "name": block.tool_name,
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
        elif isinstance(block, ImageBlock) and block.url is not None:
            parts.append({"type": "image_url", "image_url": {"url": str(block.url)}})
        elif isinstance(block, ThinkingBlock):
            continue  # the ledger keeps the reasoning as generated
        else:
            raise TypeError(f"AgentKV cannot send a {type(block).__name__}")
    text = "\n".join(texts)
    if role == "tool":
        call_id = message.additional_kwargs.get("tool_call_id")
        return {"role": "tool", "tool_call_id": call_id, "content": text}
    if not calls and role == "assistant":
        calls = [raw_call(c) for c in message.additional_kwargs.get("tool_calls") or []]
    if calls:
        return {"role": "assistant", "content": text or None, "tool_calls": calls}
    if role == "user" and len(parts) != len(texts):
        return {"role": "user", "content": parts}
    return {"role": role, "content": text}


def assistant_message(
    content: str, reasoning: str | None, calls: list[dict[str, Any]]
) -> ChatMessage:
    blocks: list[Any] = []
    if reasoning:
        blocks.append(ThinkingBlock(content=reasoning))
    if content:
        blocks.append(TextBlock(text=content))
    for call in calls:
        blocks.append(
            ToolCallBlock(
                tool_call_id=call["id"],
                tool_name=call["function"]["name"],
                tool_kwargs=call["function"]["arguments"],
            )
        )
    extra: dict[str, Any] = {"tool_calls": calls} if calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def chat_response(completion: ChatCompletion, turn: Turn) -> ChatResponse:
    msg = completion.choices[0].message
    calls = [raw_call(c) for c in msg.tool_calls or []]
    usage = completion.usage.model_dump() if completion.usage else {}
    return ChatResponse(
        message=assistant_message(msg.content or "", reasoning_text(msg), calls),
        raw=completion,
        additional_kwargs={"agentkv": turn_metadata(turn), "usage": usage},
    )


class StreamAccumulator:
    """A streamed turn as LlamaIndex streams it: the whole message so far, plus the delta."""

    def __init__(self) -> None:
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] = {}
        self.usage_chunk: ChatCompletionChunk | None = None

    def _calls(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]

    def add(self, chunk: ChatCompletionChunk) -> ChatResponse | None:
        if chunk.usage is not None:
            self.usage = chunk.usage.model_dump()
            self.usage_chunk = chunk
        if not chunk.choices:
            return None
        delta = chunk.choices[0].delta
        text = delta.content or ""
        thinking = reasoning_text(delta) or ""
        self.content += text
        self.reasoning += thinking
        for call in delta.tool_calls or []:
            slot = self.calls.setdefault(
                call.index,
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            slot["id"] = call.id or slot["id"]
            if call.function is not None:
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
        return ChatResponse(
            message=assistant_message(self.content, self.reasoning or None, self._calls()),
            delta=text,
            raw=chunk,
            additional_kwargs={"thinking_delta": thinking} if thinking else {},
        )

    def final(self, turn: Turn) -> ChatResponse:
        """The whole message, the receipt and the usage (``raw``: the usage chunk, where
        LlamaIndex's token counting reads ``usage``)."""
        return ChatResponse(
            message=assistant_message(self.content, self.reasoning or None, self._calls()),
            delta="",
            raw=self.usage_chunk,
            additional_kwargs={"agentkv": turn_metadata(turn), "usage": self.usage},
        )
