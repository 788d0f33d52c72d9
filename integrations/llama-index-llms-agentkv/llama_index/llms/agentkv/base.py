"""``AgentKV``: a LlamaIndex LLM whose turns run through agentkv conversations."""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, SecretStr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.llms.agentkv._convert import StreamAccumulator, chat_response, openai_tool_choice
from llama_index.llms.agentkv._convert import to_openai_message as to_openai_message  # re-exported

import agentkv
from agentkv.adapters import PoolMethods, bind_conversation, pool_for
from agentkv.pool import AnyConversation, ConversationPool, StateStore, TurnCallback, served_models

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["AgentKV", "session", "to_openai_message"]

FALLBACK_CONTEXT_WINDOW = 32768
"""``context_window`` while the server's ``max_model_len`` cannot be read."""
_RETRY_LOOKUP_S = 30.0

_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llama_index_llms_agentkv_session", default=None
)


def _session_id(memory_or_id: Any) -> str:
    if isinstance(memory_or_id, str):
        return memory_or_id
    for name in ("session_id", "chat_store_key"):
        value = getattr(memory_or_id, name, None)
        if isinstance(value, str) and value:
            return value
    raise TypeError(
        "session() takes a session id or a memory with a session_id (llama_index Memory) or a "
        f"chat_store_key (ChatMemoryBuffer), not {type(memory_or_id).__name__}"
    )


def session(memory_or_id: Any) -> contextlib.AbstractContextManager[str]:
    """Run the calls inside the block as the conversation of a chat session.

    Takes a session id, or the memory in use (``Memory.session_id``,
    ``ChatMemoryBuffer.chat_store_key``). Agents and chat engines started inside the block (their
    workflow steps are tasks that copy the context) use it."""
    return bind_conversation(_SESSION, _session_id(memory_or_id))


class AgentKV(FunctionCallingLLM, PoolMethods):
    """A LlamaIndex function-calling LLM backed by agentkv conversations.

    Every call's whole message list is matched to the session's conversation with
    ``Conversation.sync``: new messages are appended (the prompt stays token-identical), a
    history the memory flushed, truncated or summarized is a rewrite (the epoch moves on, so the
    router never reads stale KV for it).

    The session is, in this order: the ``conversation_id`` call argument, the innermost
    :func:`session` block, the ``conversation_id`` field, else one id per LLM instance.
    """

    model: str = Field(description="The served model name.")
    base_url: str | None = Field(default=None, description="agentkv's OpenAI-compatible URL.")
    api_key: SecretStr | None = Field(default=None)
    timeout: float | None = Field(default=None)
    retries: int = Field(default=2)
    lease_s: float | None = Field(
        default=None,
        description="Hold each session's KV while this process lives: a retention lease "
        "renewed in the background (agentkv.Client(lease_s=...)).",
    )
    mode: Literal["exact", "messages"] = Field(default="exact")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None)
    temperature: float | None = Field(default=None)
    max_tokens: int | None = Field(default=None)
    context_window: int | None = Field(
        default=None,
        description="The model's context window; None: the server's max_model_len "
        "(GET /v1/models), else 32768 while the server cannot be reached.",
    )
    extra_body: dict[str, Any] | None = Field(default=None)
    additional_kwargs: dict[str, Any] = Field(default_factory=dict)
    conversation_id: str | None = Field(default=None)
    max_sessions: int = Field(default=1024)
    max_lanes: int = Field(default=4)

    _pool: ConversationPool = PrivateAttr()
    _default_id: str = PrivateAttr(default_factory=lambda: str(uuid.uuid4()))
    _served_window: int | None = PrivateAttr(default=None)
    _lookup_failed_at: float | None = PrivateAttr(default=None)

    def __init__(
        self,
        *,
        client: agentkv.Client | None = None,
        async_client: agentkv.AsyncClient | None = None,
        store: StateStore | None = None,
        on_turn: TurnCallback | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._pool = pool_for(
            self,
            max_keys=self.max_sessions,
            client=client,
            async_client=async_client,
            store=store,
            on_turn=on_turn,
        )

    @classmethod
    def class_name(cls) -> str:
        return "AgentKV"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self.served_context_window(),
            num_output=self.max_tokens or -1,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model,
        )

    def served_context_window(self) -> int:
        """The served model's ``max_model_len`` (``GET /v1/models``: the card whose id is
        ``model``, else the first), read once; while the server cannot be reached,
        ``FALLBACK_CONTEXT_WINDOW`` with a warning, and another try 30 s later."""
        if self._served_window is not None:
            return self._served_window
        failed = self._lookup_failed_at
        if failed is not None and time.monotonic() - failed < _RETRY_LOOKUP_S:
            return FALLBACK_CONTEXT_WINDOW
        problem = "no max_model_len in its model list"
        try:
            cards = served_models(self._pool.client)
        except Exception as exc:  # unreachable, refused, not an OpenAI-compatible server
            cards, problem = [], f"{type(exc).__name__}: {exc}"
        card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else {})
        value = card.get("max_model_len")
        if isinstance(value, int) and value > 0:
            self._served_window = value
            return value
        self._lookup_failed_at = time.monotonic()
        warnings.warn(
            f"AgentKV: cannot read the context window of {self.model!r} from the server "
            f"({problem}); using {FALLBACK_CONTEXT_WINDOW} (pass context_window= to set it).",
            agentkv.AgentKVWarning,
            stacklevel=2,
        )
        return FALLBACK_CONTEXT_WINDOW

    # -- conversations (pool, from_state, close, aclose: PoolMethods) -----------------------
    def conversation(self, session_id: str) -> AnyConversation | None:
        """The agentkv conversation of a session (its id is the session id), once it has run."""
        return self._pool.conversation(session_id)

    def to_state(self, session_id: str) -> dict[str, Any] | None:
        return self._pool.to_state(session_id)

    # -- chat ------------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        key, wire, tools, params = self._request(messages, kwargs)
        turn = self._pool.run(key, wire, tools, **params)
        assert turn.completion is not None
        return chat_response(turn.completion, turn)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        key, wire, tools, params = self._request(messages, kwargs)
        turn = await self._pool.arun(key, wire, tools, **params)
        assert turn.completion is not None
        return chat_response(turn.completion, turn)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        key, wire, tools, params = self._request(messages, kwargs, stream=True)

        def gen() -> ChatResponseGen:
            turn, chunks = self._pool.stream(key, wire, tools, **params)
            acc = StreamAccumulator()
            for chunk in chunks:
                if (response := acc.add(chunk)) is not None:
                    yield response
            yield acc.final(turn)

        return gen()

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        key, wire, tools, params = self._request(messages, kwargs, stream=True)

        async def gen() -> ChatResponseAsyncGen:
            turn, chunks = await self._pool.astream(key, wire, tools, **params)
            acc = StreamAccumulator()
            async for chunk in chunks:
                if (response := acc.add(chunk)) is not None:
                    yield response
            yield acc.final(turn)

        return gen()

    # -- completion (a one-message chat) ---------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_to_completion_decorator(self.chat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)

    # -- function calling ------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        prepared: dict[str, Any] = {"messages": messages, **kwargs}
        if specs:
            prepared["tools"] = specs
            prepared["tool_choice"] = openai_tool_choice(tool_choice, tool_required)
        return prepared

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            if len(calls) > 1:
                first = calls[0]
                response.message.blocks = [
                    b for b in response.message.blocks if not isinstance(b, ToolCallBlock)
                ] + [first]
                raw = response.message.additional_kwargs.get("tool_calls") or []
                response.message.additional_kwargs["tool_calls"] = raw[:1]
        return response

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> list[ToolSelection]:
        calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but got 0 tool calls.")
        selections = []
        for call in calls:
            args: Any = call.tool_kwargs
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    args = {}
            selections.append(
                ToolSelection(
                    tool_id=call.tool_call_id or "",
                    tool_name=call.tool_name,
                    tool_kwargs=args if isinstance(args, dict) else {},
                )
            )
        return selections

    # -- helpers ---------------------------------------------------------------------------------
    def _request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], *, stream: bool = False
    ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
        key = str(
            kwargs.pop("conversation_id", None)
            or _SESSION.get()
            or self.conversation_id
            or self._default_id
        )
        tools = kwargs.pop("tools", None) or None
        params: dict[str, Any] = {}
        for name in ("temperature", "max_tokens"):
            value = kwargs.pop(name, None)
            value = getattr(self, name) if value is None else value
            if value is not None:
                params[name] = value
        extra_body = {**(self.extra_body or {}), **(kwargs.pop("extra_body", None) or {})}
        if extra_body:
            params["extra_body"] = extra_body
        if kwargs.get("tool_choice") is None:
            kwargs.pop("tool_choice", None)
        params.update({**self.additional_kwargs, **kwargs})
        if stream:  # the usage chunk: the final response carries it (TokenCountingHandler)
            options = params.get("stream_options") or {}
            params["stream_options"] = {**options, "include_usage": True}
        return key, [to_openai_message(m) for m in messages], tools, params
