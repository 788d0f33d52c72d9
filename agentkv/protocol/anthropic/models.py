"""The Messages API request as vLLM 0.33 validates it (``vllm/entrypoints/anthropic/protocol.py``):
the same pydantic models, so the same requests are refused. Unknown fields are ignored, as there
(Claude Code's ``context_management``, a block's ``cache_control``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

__all__ = [
    "EFFORTS",
    "MAX_STOP_STRINGS",
    "BadRequest",
    "ContentBlock",
    "CountTokensRequest",
    "Message",
    "MessagesRequest",
    "ThinkingDisabled",
    "ThinkingEnabled",
    "Tool",
    "ToolDefinition",
    "parse_request",
]

EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""``output_config.effort`` values (vLLM ``AnthropicEffort``), in order."""
MAX_STOP_STRINGS = 4
"""vLLM's ``VLLM_MAX_STOP_STRINGS`` default: the most ``stop_sequences`` it accepts."""


class BadRequest(ValueError):
    """A request vLLM refuses with 400 (``invalid_request_error``)."""


class Tool(BaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_by_default(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "type" not in v:
            v["type"] = "object"
        return v


class ToolReference(BaseModel):
    type: Literal["tool_reference"]
    name: str


class ToolDefinition(BaseModel):
    type: Literal["tool_definition"]
    definition: Tool


ToolChange = Annotated[ToolReference | ToolDefinition, Field(discriminator="type")]


class ContentBlock(BaseModel):
    """One content block (every type's fields in one model, as vLLM has it)."""

    type: Literal[
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    ]
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    tool: ToolChange | None = None

    @model_validator(mode="after")
    def _tool_change(self) -> ContentBlock:
        if self.type not in ("tool_addition", "tool_removal"):
            return self
        if self.tool is None:
            raise ValueError(f"tool is required for {self.type} blocks")
        if self.type == "tool_removal" and self.tool.type != "tool_reference":
            raise ValueError("tool_removal only accepts a tool_reference")
        return self


def _reject_tool_changes(content: str | list[ContentBlock] | None) -> None:
    if content is None or isinstance(content, str):
        return
    for block in content:
        if block.type in ("tool_addition", "tool_removal"):
            raise ValueError(f'{block.type} blocks are only allowed in messages with role "system"')


class Message(BaseModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _tool_changes_in_system_only(self) -> Message:
        if self.role != "system":
            _reject_tool_changes(self.content)
        return self


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name is required when type is 'tool'")
        return self


class JsonOutputFormat(BaseModel):
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    type: Literal["json_schema"] = "json_schema"


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class ThinkingEnabled(BaseModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted", "updates"] | None = None


class ThinkingDisabled(BaseModel):
    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted", "updates"] | None = None


Thinking = Annotated[
    ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")
]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens`` (vLLM ``AnthropicCountTokensRequest``)."""

    model: str
    messages: list[Message]
    output_config: OutputConfig | None = None
    system: str | list[ContentBlock] | None = None
    thinking: Thinking | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not v:
            raise ValueError("Model is required")
        return v

    @field_validator("system")
    @classmethod
    def _system(cls, v: str | list[ContentBlock] | None) -> str | list[ContentBlock] | None:
        _reject_tool_changes(v)
        return v

    @property
    def thinking_disabled(self) -> bool:
        """Whether :func:`to_chat` needs the effort of ``thinking: disabled``."""
        return isinstance(self.thinking, ThinkingDisabled)


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (vLLM ``AnthropicMessagesRequest``); ``metadata`` is dropped."""

    max_tokens: int
    metadata: dict[str, Any] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    # vLLM's own fields
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    watermarking: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_tokens must be positive")
        return v

    @model_validator(mode="after")
    def _budget_below_max(self) -> MessagesRequest:
        # P/D prefill legs are sent with max_tokens=1 and never decode (vLLM's comment)
        if self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"):
            return self
        if isinstance(self.thinking, ThinkingEnabled) and (
            self.thinking.budget_tokens >= self.max_tokens
        ):
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


def parse_request(body: dict[str, Any], *, count_tokens: bool = False) -> CountTokensRequest:
    """A ``/v1/messages`` body (a :class:`MessagesRequest`), or a ``count_tokens`` one, validated
    as vLLM validates it (:class:`BadRequest` with the first problem)."""
    model = CountTokensRequest if count_tokens else MessagesRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"Invalid `{loc}`: {first['msg']}." if loc else first["msg"]) from None
