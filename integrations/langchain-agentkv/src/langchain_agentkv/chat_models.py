"""``ChatAgentKV``: a LangChain chat model whose turns run through agentkv conversations."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

import agentkv
from agentkv.adapters import PoolMethods, pool_for, turn_metadata
from agentkv.pool import AnyConversation, ConversationPool, StateStore, Turn, TurnCallback
from langchain_agentkv._messages import openai_tool_choice, response_format
from langchain_agentkv._messages import to_openai_message as to_openai_message  # re-exported here
from langchain_agentkv._outputs import (
    add_usage,
    ai_message,
    generation_chunk,
    result_from_chunks,
    to_usage_metadata,
)

__all__ = ["ChatAgentKV"]

_SAMPLING = ("temperature", "max_tokens", "top_p", "seed", "frequency_penalty", "presence_penalty")
_LANGCHAIN_ONLY = ("ls_structured_output_format", "stream_usage")
_StructuredMethod = Literal["function_calling", "json_mode", "json_schema"]


class ChatAgentKV(BaseChatModel, PoolMethods):
    """A LangChain chat model backed by agentkv conversations.

    Each call's whole message list is matched to the conversation of its thread with
    ``Conversation.sync``: new messages are appended (the prompt stays token-identical to the
    previous prompt + the generated tokens), a trimmed or summarized history is a rewrite (the
    epoch moves on, so the router never reads stale KV for it).

    The thread is, in this order: the ``conversation_id`` call argument, the
    ``config["configurable"]["thread_id"]`` of the call or of the graph it runs in (LangGraph's
    thread), the ``conversation_id`` field, else one id per model instance.

    Streams end with a chunk that carries ``usage_metadata`` (``stream_usage``, default on:
    agentkv always reports usage) and ``response_metadata["agentkv"]`` (the receipt).

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
    stream_usage: bool | None = None
    """Whether streams end with ``usage_metadata`` (as ``ChatOpenAI(stream_usage=...)``; the
    call's ``stream_usage=`` or ``stream_options={"include_usage": ...}`` wins). None: yes."""
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
        self._pool = pool_for(
            self,
            max_keys=self.max_threads,
            client=self.client,
            async_client=self.async_client,
            store=self.store,
            on_turn=self.on_turn,
        )

    # -- a call's own config: its thread ------------------------------------------------------
    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return super().invoke(input, _thread_config(config), stop=stop, **kwargs)

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return await super().ainvoke(input, _thread_config(config), stop=stop, **kwargs)

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        # stream() runs _stream without a run manager: the thread goes as the call's argument
        _thread_kwarg(config, kwargs)
        yield from super().stream(input, _thread_config(config), stop=stop, **kwargs)

    async def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        _thread_kwarg(config, kwargs)
        async for chunk in super().astream(input, _thread_config(config), stop=stop, **kwargs):
            yield chunk

    # -- LangChain's required surface ----------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "agentkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "mode": self.mode, **self._sampling({})}

    def _combine_llm_outputs(self, llm_outputs: list[dict[str, Any] | None], /) -> dict[str, Any]:
        """``generate()``'s ``llm_output``: the token usage of its calls summed, as ChatOpenAI."""
        total: dict[str, Any] = {}
        for output in llm_outputs:
            for name, value in ((output or {}).get("token_usage") or {}).items():
                if value is not None:
                    total[name] = add_usage(total.get(name), value)
        return {"token_usage": total, "model_name": self.model}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "agentkv"
        params["ls_model_name"] = self.model
        return params

    # -- conversations (pool, from_state, close, aclose: PoolMethods) -----------------------
    def conversation(self, thread_id: str) -> AnyConversation | None:
        """The agentkv conversation of a thread (its id is the thread id), once it has run."""
        return self._pool.conversation(thread_id)

    def to_state(self, thread_id: str) -> dict[str, Any] | None:
        """A thread's conversations as JSON-able state, to keep with the app's own state."""
        return self._pool.to_state(thread_id)

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
            return result_from_chunks(list(chunks))
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
            return result_from_chunks(chunks)
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
        want_usage = self._want_usage(kwargs)
        key, wire, tools, params = self._request(messages, stop, run_manager, kwargs)
        turn, chunks = self._pool.stream(key, wire, tools, **params)
        usage, name = None, None
        for raw in chunks:
            usage, name = raw.usage or usage, raw.model or name
            chunk = generation_chunk(raw)
            if chunk is not None:
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        last = self._last_chunk(turn, usage if want_usage else None, name)
        if run_manager is not None:
            run_manager.on_llm_new_token("", chunk=last)
        yield last

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        want_usage = self._want_usage(kwargs)
        key, wire, tools, params = self._request(messages, stop, run_manager, kwargs)
        turn, chunks = await self._pool.astream(key, wire, tools, **params)
        usage, name = None, None
        async for raw in chunks:
            usage, name = raw.usage or usage, raw.model or name
            chunk = generation_chunk(raw)
            if chunk is not None:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        last = self._last_chunk(turn, usage if want_usage else None, name)
        if run_manager is not None:
            await run_manager.on_llm_new_token("", chunk=last)
        yield last

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
            kwargs["tool_choice"] = openai_tool_choice(tool_choice)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: _StructuredMethod = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers parsed into ``schema``, as ``ChatOpenAI.with_structured_output``.

        ``method``: ``"function_calling"`` (the default: a forced tool call), ``"json_schema"``
        (``response_format={"type": "json_schema", ...}``: vLLM decodes to the schema) or
        ``"json_mode"`` (``response_format={"type": "json_object"}``; the prompt must ask for
        the JSON). ``tools`` go with ``json_schema`` (the model may call them instead)."""
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema must be given unless method='json_mode'")
            if strict is not None:
                kwargs["strict"] = strict
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        pydantic_schema = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "json_schema":
            if schema is None:
                raise ValueError("schema must be given unless method='json_mode'")
            bound: dict[str, Any] = {"response_format": response_format(schema, strict)}
            if tools:
                bound["tools"] = [convert_to_openai_tool(t, strict=strict) for t in tools]
            output_format: Any = convert_to_openai_tool(schema)
        elif method == "json_mode":
            bound, output_format = {"response_format": {"type": "json_object"}}, schema
        else:
            raise ValueError(f"Unknown method {method!r}: function_calling, json_schema, json_mode")
        bound["ls_structured_output_format"] = {
            "kwargs": {"method": method, "strict": strict},
            "schema": output_format,
        }
        llm = self.bind(**bound)
        parser: Runnable[Any, Any] = (
            PydanticOutputParser(pydantic_object=cast(type[BaseModel], schema))
            if pydantic_schema
            else JsonOutputParser()
        )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        )
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks(
            [fallback], exception_key="parsing_error"
        )

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

    def _want_usage(self, kwargs: dict[str, Any]) -> bool:
        """Whether the stream ends with usage (ChatOpenAI's order: the call's ``stream_usage``,
        the call's ``stream_options``, ``model_kwargs``' ``stream_options``, the field); the
        request always asks for the usage chunk (the last chunk carries it)."""
        sources = [
            kwargs.pop("stream_usage", None),
            (kwargs.get("stream_options") or {}).get("include_usage"),
            (self.model_kwargs.get("stream_options") or {}).get("include_usage"),
            self.stream_usage,
        ]
        kwargs["stream_options"] = {
            **(self.model_kwargs.get("stream_options") or {}),
            **(kwargs.get("stream_options") or {}),
            "include_usage": True,
        }
        return next((s for s in sources if isinstance(s, bool)), True)

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
        completion = turn.completion
        assert completion is not None
        message = ai_message(completion)
        message.response_metadata["agentkv"] = turn_metadata(turn)
        # on_llm_end's llm_output, as ChatOpenAI's: the usage as the server reported it
        llm_output: dict[str, Any] = {
            "token_usage": completion.usage.model_dump() if completion.usage else None,
            "model_provider": "agentkv",
            "model_name": completion.model,
            "id": completion.id,
        }
        return ChatResult(generations=[ChatGeneration(message=message)], llm_output=llm_output)

    def _last_chunk(self, turn: Turn, usage: Any, model_name: str | None) -> ChatGenerationChunk:
        # model_name only here: LangChain concatenates strings of merged chunks' metadata
        metadata = {"agentkv": turn_metadata(turn), "model_name": model_name or self.model}
        message = AIMessageChunk(
            content="",
            response_metadata=metadata,
            usage_metadata=to_usage_metadata(usage),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)


def _thread_config(config: RunnableConfig | None) -> RunnableConfig | None:
    """A direct call's ``configurable.thread_id`` as the run's ``thread_id`` metadata, which
    is where LangGraph puts it for the model calls inside a graph."""
    if not config:
        return config
    thread = (config.get("configurable") or {}).get("thread_id")
    metadata = config.get("metadata") or {}
    if thread is None or "thread_id" in metadata:
        return config
    return cast(RunnableConfig, {**config, "metadata": {**metadata, "thread_id": thread}})


def _thread_kwarg(config: RunnableConfig | None, kwargs: dict[str, Any]) -> None:
    thread = ((config or {}).get("configurable") or {}).get("thread_id")
    thread = ((config or {}).get("metadata") or {}).get("thread_id") or thread
    if thread and not kwargs.get("conversation_id"):
        kwargs["conversation_id"] = str(thread)
