"""The generation routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/responses`` (mapped onto the chat path), ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (:mod:`agentkv.sim.messages`); streamed or whole, with the
simulator's receipt headers and the stream faults."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv.protocol import (
    HEADER_REQUEST_ID,
    HEADER_SIM_CACHED_TOKENS,
    HEADER_SIM_COMPUTED_TOKENS,
    HEADER_SIM_CPU_TOKENS,
    HEADER_SIM_ENGINE_ID,
    HEADER_SIM_MODEL_TTFT_MS,
    HEADER_SIM_WRONG_KV_TOKENS,
)
from agentkv.protocol.errors import APIError
from agentkv.protocol.http import ORJSONResponse
from agentkv.protocol.responses import responses_to_chat
from agentkv.protocol.responses_stream import ResponsesEncoder
from agentkv.sim import messages
from agentkv.sim.faults import Faults
from agentkv.sim.requests import Finished, Scheduled
from agentkv.sim.responses import StreamWriter, full_response
from agentkv.sim.serving import RequestPlan, SimRenderer, plan_chat, plan_completion
from agentkv.sim.state import Handler, SimState, check_model, json_body

__all__ = ["routes"]

_TRACE_HEADERS = ("traceparent", "tracestate")
"""W3C trace context headers (vLLM's ``vllm/tracing/utils.py`` ``TRACE_HEADERS``)."""


def routes(state: SimState) -> list[Route]:
    """The generation routes of ``state``'s instance."""
    return [
        Route("/v1/chat/completions", _generate(state, chat=True), methods=["POST"]),
        Route("/v1/completions", _generate(state, chat=False), methods=["POST"]),
        Route("/v1/responses", _responses(state), methods=["POST"]),
        Route("/v1/messages", _messages(state), methods=["POST"]),
        Route("/v1/messages/count_tokens", _count_tokens(state), methods=["POST"]),
    ]


def _generate(state: SimState, *, chat: bool) -> Handler:
    async def handler(request: Request) -> Response:
        body = await json_body(request)
        return await _serve(state, request, body, chat=chat)

    return handler


async def _serve(
    state: SimState, request: Request, body: dict[str, Any], *, chat: bool
) -> Response:
    """One chat or completion request: the engine's answer, streamed or whole."""
    r, engine, faults = state.renderer, state.engine, state.faults
    state.trace_context = {
        k: v for k in _TRACE_HEADERS if (v := request.headers.get(k)) is not None
    }
    check_model(state, body)
    if faults.delay_s:
        await asyncio.sleep(faults.delay_s)
    if faults.take_failure():
        raise APIError(faults.fail_status, faults.fail_message)
    base_id = request.headers.get(HEADER_REQUEST_ID)
    plan = plan_chat(r, body, base_id) if chat else plan_completion(r, body, base_id)
    events = engine.run(plan.gen).__aiter__()
    first = await events.__anext__()  # prefill; raises APIError before any byte
    assert isinstance(first, Scheduled)
    headers = {
        HEADER_SIM_WRONG_KV_TOKENS: str(first.wrong_kv_tokens),
        HEADER_SIM_MODEL_TTFT_MS: f"{first.model_ttft_s * 1000:.3f}",
        HEADER_SIM_ENGINE_ID: state.config.engine_id,
        HEADER_SIM_CACHED_TOKENS: str(first.local_hit_tokens),
        HEADER_SIM_CPU_TOKENS: str(first.cpu_tokens),
        HEADER_SIM_COMPUTED_TOKENS: str(first.computed_tokens),
    }
    if plan.stream:
        with_handle = state.config.compat != "0.32"  # 0.32 puts no handle on streams
        return StreamingResponse(
            _stream(r, plan, first, events, with_handle, faults),
            media_type="text/event-stream",
            headers=headers,
        )
    fin: Finished | None = None
    async for event in events:
        if isinstance(event, Finished):
            fin = event
    assert fin is not None
    return JSONResponse(full_response(r, plan, first, fin), headers=headers)


def _responses(state: SimState) -> Handler:
    """``POST /v1/responses`` as vLLM serves it for a chat model: the request mapped onto the
    chat path (:mod:`agentkv.protocol.responses`) and the answer mapped back."""

    async def handler(request: Request) -> Response:
        body = await json_body(request)
        check_model(state, body)
        previous = body.get("previous_response_id")
        if previous is not None:
            raise APIError(
                404, f"Response with id '{str(previous)[:80]}' not found.", param="response_id"
            )
        chat = responses_to_chat(body)
        encoder = ResponsesEncoder(body)
        answer = await _serve(state, request, chat, chat=True)
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(
                _reencode(answer.body_iterator, encoder),
                media_type="text/event-stream",
                headers=dict(answer.headers),
            )
        return ORJSONResponse(
            encoder.response(json.loads(bytes(answer.body))), headers=dict(answer.headers)
        )

    return handler


async def _reencode(source: AsyncIterable[Any], encoder: ResponsesEncoder) -> AsyncIterator[bytes]:
    """The chat stream's chunks as Responses events (the simulator writes whole events)."""
    async for part in source:
        text = part if isinstance(part, bytes) else str(part).encode()
        out = b""
        for line in text.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out += b"".join(encoder.done())
            else:
                out += b"".join(encoder.chunk(json.loads(data)))
        if out:
            yield out


async def _stream(
    r: SimRenderer,
    plan: RequestPlan,
    sched: Scheduled,
    events: AsyncIterator[Scheduled | int | Finished],
    with_handle: bool,
    faults: Faults,
) -> AsyncIterator[bytes]:
    writer = StreamWriter(r, plan, with_handle=with_handle)
    cut = faults.cut_stream_after
    try:
        for chunk in writer.first():
            yield chunk
        count = 0
        held: int | None = None  # the last token, sent with the engine's Finished (as vLLM)
        async for event in events:
            if isinstance(event, Finished):
                for chunk in writer.last(held, sched, event):
                    yield chunk
                held = None
                continue
            if not isinstance(event, int):
                continue
            if held is not None:  # it was not the last after all
                for chunk in writer.token(held):
                    yield chunk
                held = None
            if cut is not None and count >= cut:  # ``cut_stream_after: 0``: no token at all
                raise ConnectionAbortedError("fault: stream cut")
            count += 1
            cutting = cut is not None and count >= cut
            if writer.expects_last() and not cutting:
                held = event
                continue
            for chunk in writer.token(event):
                yield chunk
            if cutting:
                raise ConnectionAbortedError("fault: stream cut")
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _messages(state: SimState) -> Handler:
    """Anthropic's ``/v1/messages``: the chat path under vLLM's conversion."""
    traits = messages.TemplateTraits(state.renderer)

    async def run(request: Request, body: dict[str, Any]) -> Response:
        return await _serve(state, request, body, chat=True)

    async def handler(request: Request) -> Response:
        chat = messages.to_chat(await json_body(request), traits)
        return await messages.convert(await run(request, chat))

    return handler


def _count_tokens(state: SimState) -> Handler:
    traits = messages.TemplateTraits(state.renderer)

    async def handler(request: Request) -> Response:
        chat = messages.to_chat(await json_body(request), traits, count_tokens=True)
        check_model(state, chat)
        return JSONResponse(messages.count_tokens(state.renderer, chat))

    return handler
