"""``ChatAgentKV``: a LangChain chat model whose turns run through agentkv conversations."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

import agentkv
from agentkv.pool import (
    AnyConversation,
    ConversationPool,
    StateStore,
    Turn,
    TurnCallback,
    client_factories,
)

__all__ = ["ChatAgentKV"]

_SAMPLING = ("temperature", "max_tokens", "top_p", "seed", "frequency_penalty", "presence_penalty")
_LANGCHAIN_ONLY = ("ls_structured_output_format", "stream_usage")


class ChatAgentKV(BaseChatModel):
    """A LangChain chat model backed by agentkv conversations.

    Each call's whole message list is matched to the conversation of its thread with
    ``Conversation.sync``: new messages are appended (the prompt stays token-identical to the
    previous prompt + the generated tokens), a trimmed or summarized history is a rewrite (the
    epoch moves on, so the router never reads stale KV for it).

    The thread is, in this order: the ``conversation_id`` call argument, LangGraph's
    ``config["configurable"]["thread_id"]``, the ``conversation_id`` field, else one id per model
    instance.

    Args:
        model: the served model name.
        base_url, api_key: connection settings (else ``$AGENTKV_BASE_URL`` /
            ``$AGENTKV_API_KEY``, default ``http://127.0.0.1:8000/v1``); or pass ``client`` /
            ``async_client`` (an existing :class:`agentkv.Client` / :class:`agentkv.AsyncClient`).
        mode: ``"exact"`` (send token ids; default) or ``"messages"``.
        store: keep each thread's ledgers in a :class:`~langchain_agentkv.StateStore` (for
            example :class:`~langchain_agentkv.LangGraphStore`) as well as in memory.
        on_turn: called with the agentkv conversation and the receipt after every turn.
        extra_body: body fields sent with every request.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str = Field(alias="model_name")
    base_url: str | None = None
    api_key: SecretStr | None = None
    client: agentkv.Client | None = Field(default=None, exclude=True)
    async_client: agentkv.AsyncClient | None = Field(default=None, exclude=True)
    timeout: float | None = None
    retries: int = 2
    mode: Literal["exact", "messages"] = "exact"
    chat_template_kwargs: dict[str, Any] | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    extra_body: dict[str, Any] | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    streaming: bool = False
    conversation_id: str | None = None
    store: StateStore | None = Field(default=None, exclude=True)
    max_threads: int = 1024
    max_lanes: int = 4
    lease_s: float | None = None
    """Hold each thread's KV while this process lives: a retention lease renewed in the
    background (``agentkv.Client(lease_s=...)``), released soon after the process is gone."""
    on_turn: TurnCallback | None = Field(default=None, exclude=True)

    _pool: ConversationPool = PrivateAttr()
    _default_id: str = PrivateAttr(default_factory=lambda: str(uuid.uuid4()))

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        make_client, make_async_client, owns = client_factories(
            base_url=self.base_url,
            api_key=self.api_key.get_secret_value() if self.api_key else None,
            client=self.client,
            async_client=self.async_client,
            timeout=self.timeout,
            retries=self.retries,
            lease_s=self.lease_s,
        )
        self._pool = ConversationPool(
            model=self.model,
            client=make_client,
            async_client=make_async_client,
            mode=self.mode,
            chat_template_kwargs=self.chat_template_kwargs,
            store=self.store,
            max_keys=self.max_threads,
            max_lanes=self.max_lanes,
            on_turn=self.on_turn,
            owns_clients=owns,
        )

    # -- LangChain's required surface ----------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "agentkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "mode": self.mode, **self._sampling({})}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "agentkv"
        params["ls_model_name"] = self.model
        return params

    # -- conversations ---------------------------------------------------------------------------
    @property
    def pool(self) -> ConversationPool:
        """The threads' agentkv conversations (see ``ConversationPool``)."""
        return self._pool

    def conversation(self, thread_id: str) -> AnyConversation | None:
        """The agentkv conversation of a thread (its id is the thread id), once it has run."""
        return self._pool.conversation(thread_id)

    def to_state(self, thread_id: str) -> dict[str, Any] | None:
        """A thread's conversations as JSON-able state, to keep with the app's own state."""
        return self._pool.to_state(thread_id)

    def from_state(self, state: Mapping[str, Any]) -> None:
        """Take over a thread's conversations saved with :meth:`to_state`."""
        self._pool.from_state(state)

    def close(self) -> None:
        """Close the sync HTTP client this model created."""
        self._pool.close()

    async def aclose(self) -> None:
        """Close the HTTP clients this model created."""
        await self._pool.aclose()

    # -- turns ---------------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            chunks = self._stream(messages, stop, run_manager, **kwargs)
            return _from_chunks(list(chunks))
        key, wire, tools, params = self._request(messages, stop, run_manager, kwargs)
        turn = self._pool.run(key, wire, tools, **params)
        return self._result(turn)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
            return _from_chunks(chunks)
        key, wire, tools, params = self._request(messages, stop, run_manager, kwargs)
        turn = await self._pool.arun(key, wire, tools, **params)
        return self._result(turn)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        key, wire, tools, params = self._request(messages, stop, run_manager, kwargs)
        turn, chunks = self._pool.stream(key, wire, tools, **params)
        for raw in chunks:
            chunk = _chunk(raw)
            if chunk is not None:
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield self._last_chunk(turn)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        key, wire, tools, params = self._request(messages, stop, run_manager, kwargs)
        turn, chunks = await self._pool.astream(key, wire, tools, **params)
        async for raw in chunks:
            chunk = _chunk(raw)
            if chunk is not None:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield self._last_chunk(turn)

    # -- tools and structured output -------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind OpenAI-format tools (functions, pydantic models, LangChain tools, dicts).

        ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` (or ``"any"`` / ``True``), or a
        tool's name."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _tool_choice(tool_choice)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    # -- helpers ---------------------------------------------------------------------------------
    def _request(
        self,
        messages: Sequence[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
        key = self._thread(run_manager, kwargs.pop("conversation_id", None))
        tools = kwargs.pop("tools", None) or None
        for name in _LANGCHAIN_ONLY:
            kwargs.pop(name, None)
        params = self._sampling(kwargs)
        stop = stop or kwargs.pop("stop", None) or self.stop
        if stop:
            params["stop"] = list(stop)
        extra_body = {**(self.extra_body or {}), **(kwargs.pop("extra_body", None) or {})}
        if extra_body:
            params["extra_body"] = extra_body
        params.update({**self.model_kwargs, **kwargs})
        return key, [to_openai_message(m) for m in messages], tools, params

    def _sampling(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        params = {}
        for name in _SAMPLING:
            value = kwargs.pop(name, None)
            if value is None:
                value = getattr(self, name)
            if value is not None:
                params[name] = value
        return params

    def _thread(
        self,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        explicit: Any,
    ) -> str:
        if explicit:
            return str(explicit)
        metadata = run_manager.metadata if run_manager is not None else {}
        thread = metadata.get("thread_id")
        if not thread:
            thread = (ensure_config().get("configurable") or {}).get("thread_id")
        if thread:
            return str(thread)
        return self.conversation_id or self._default_id

    def _result(self, turn: Turn) -> ChatResult:
        assert turn.completion is not None
        message = _ai_message(turn.completion)
        message.response_metadata["agentkv"] = _receipt(turn)
        return ChatResult(
            generations=[ChatGeneration(message=message)],
            llm_output={"model_name": turn.completion.model},
        )

    def _last_chunk(self, turn: Turn) -> ChatGenerationChunk:
        metadata = {"agentkv": _receipt(turn), "model_name": self.model}
        message = AIMessageChunk(content="", response_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message)


# -- conversions ---------------------------------------------------------------------------------
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


def _tool_choice(choice: str | bool | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return choice
    if choice is True or choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return str(choice)
    return {"type": "function", "function": {"name": choice}}


def _usage(usage: Any) -> UsageMetadata | None:
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


def _reasoning(message: Any) -> str | None:
    extra = getattr(message, "model_extra", None) or {}
    value = getattr(message, "reasoning", None) or extra.get("reasoning")
    value = value or getattr(message, "reasoning_content", None) or extra.get("reasoning_content")
    return value if isinstance(value, str) and value else None


def _ai_message(completion: ChatCompletion) -> AIMessage:
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
    if reasoning := _reasoning(msg):
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
        usage_metadata=_usage(completion.usage),
        id=completion.id,
    )


def _chunk(raw: ChatCompletionChunk) -> ChatGenerationChunk | None:
    if not raw.choices:
        usage = _usage(raw.usage)
        if usage is None:
            return None
        return ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=usage))
    choice = raw.choices[0]
    delta = choice.delta
    additional: dict[str, Any] = {}
    if reasoning := _reasoning(delta):
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
        metadata["model_name"] = raw.model
    message = AIMessageChunk(
        content=delta.content or "",
        tool_call_chunks=calls,
        additional_kwargs=additional,
        response_metadata=metadata,
        usage_metadata=_usage(raw.usage),
        id=raw.id,
    )
    return ChatGenerationChunk(message=message)


def _from_chunks(chunks: Sequence[ChatGenerationChunk]) -> ChatResult:
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
    return ChatResult(generations=[ChatGeneration(message=final)])


def _receipt(turn: Turn) -> dict[str, Any]:
    data: dict[str, Any] = {"conversation_id": turn.conversation_id, "sync": turn.kind}
    if turn.receipt is not None:
        data.update(turn.receipt.to_dict())
    return data
