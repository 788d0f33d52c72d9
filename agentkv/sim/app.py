"""The simulator's ASGI app: ``create_app(config)`` serves one vLLM-like instance.

Routes (vLLM 0.33's OpenAI server): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (:mod:`agentkv.sim.messages`),
``POST /v1/responses`` (stateless: mapped onto the chat path as vLLM maps it, without a response
store, so a ``previous_response_id`` is not found, as on vLLM without
``VLLM_ENABLE_RESPONSES_API_STORE``), ``POST /tokenize``, ``POST /detokenize``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``,
``POST /reset_prefix_cache``, ``GET /kv_event_sources``. Internal (simulator only): the NIXL
stand-in under ``/_sim/nixl/`` (:mod:`agentkv.sim.transfer`), ``GET|POST /_sim/faults``
(:mod:`agentkv.sim.faults`) and ``GET /_sim/state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentkv.chat.template import ChatTemplate, load_template
from agentkv.chat.tokenizer import ChatTokenizer, load_tokenizer
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
from agentkv.protocol.http import (
    ORJSONResponse,
    json_object,
)
from agentkv.protocol.responses import responses_to_chat
from agentkv.protocol.responses_stream import ResponsesEncoder
from agentkv.sim import messages
from agentkv.sim.clock import Clock
from agentkv.sim.config import SimConfig
from agentkv.sim.costmodel import PRESETS, CostModel, load_cost_file
from agentkv.sim.engine import Engine
from agentkv.sim.errors import error_handling
from agentkv.sim.faults import Faults
from agentkv.sim.metrics import SimMetrics
from agentkv.sim.requests import Finished, Scheduled
from agentkv.sim.responses import StreamWriter, full_response
from agentkv.sim.serving import RequestPlan, SimRenderer, plan_chat, plan_completion
from agentkv.sim.transfer import TransferClient

__all__ = ["SimState", "create_app"]

MAX_BODY_BYTES = 64 * 1024 * 1024
_TRACE_HEADERS = ("traceparent", "tracestate")
"""W3C trace context headers (vLLM's ``vllm/tracing/utils.py`` ``TRACE_HEADERS``)."""


@dataclass
class SimState:
    """Everything one instance holds (``app.state.sim``)."""

    config: SimConfig
    engine: Engine
    renderer: SimRenderer
    metrics: SimMetrics
    faults: Faults
    trace_context: dict[str, str] = field(default_factory=dict)
    """The W3C trace context (``traceparent``, ``tracestate``) of the last generation request
    (empty when it carried none), shown by ``GET /_sim/state``."""


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, "Request body too large.")
    try:
        return json_object(raw)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def create_app(
    config: SimConfig | None = None,
    *,
    tokenizer: ChatTokenizer | None = None,
    template: ChatTemplate | None = None,
    cost: CostModel | None = None,
    clock: Clock | None = None,
    transfer: TransferClient | None = None,
    faults: Faults | None = None,
) -> Starlette:
    """Build one simulated vLLM instance.

    Args:
        config: the instance's settings (defaults: a plain instance, real Qwen3 vocabulary).
        tokenizer: overrides ``config.tokenizer``.
        template: overrides ``config.template``.
        cost: overrides ``config.costs`` and ``config.preset``.
        clock: the instance's private clock (default: ``perf_counter`` shifted by
            ``config.clock_offset_s``, sleeps scaled by ``config.time_scale``).
        transfer: how to reach other instances (default: HTTP).
        faults: initial fault knobs.
    """
    cfg = config or SimConfig()
    tok = tokenizer or load_tokenizer(cfg.tokenizer)
    tmpl = template or load_template(cfg.template, tok)
    if cost is None and cfg.costs is not None:
        cost = load_cost_file(cfg.costs)
    if cost is None:
        if cfg.preset not in PRESETS:
            raise ValueError(f"unknown preset {cfg.preset!r}; known: {', '.join(sorted(PRESETS))}")
        cost = PRESETS[cfg.preset]
    clk = clock or Clock(offset_s=cfg.clock_offset_s, scale=cfg.time_scale)
    metrics = SimMetrics(cfg.served_model_name)
    engine = Engine(
        cfg,
        cost=cost,
        metrics=metrics,
        clock=clk,
        transfer=transfer or TransferClient(),
        vocab_size=tok.vocab_size,
    )
    state = SimState(cfg, engine, SimRenderer(cfg, tok, tmpl), metrics, faults or Faults())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reaper = asyncio.create_task(engine.reap_forever())
        try:
            yield
        finally:
            engine.shutdown()
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await engine.transfer.aclose()
            engine.close()

    routes = [
        Route("/v1/chat/completions", _generate(state, chat=True), methods=["POST"]),
        Route("/v1/completions", _generate(state, chat=False), methods=["POST"]),
        Route("/v1/responses", _responses(state), methods=["POST"]),
        Route("/v1/messages", _messages(state), methods=["POST"]),
        Route("/v1/messages/count_tokens", _count_tokens(state), methods=["POST"]),
        Route("/tokenize", _tokenize(state), methods=["POST"]),
        Route("/detokenize", _detokenize(state), methods=["POST"]),
        Route("/v1/models", _models(state), methods=["GET"]),
        Route("/health", _health(state), methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
        Route("/reset_prefix_cache", _reset(state), methods=["POST"]),
        Route("/kv_event_sources", _kv_event_sources(state), methods=["GET"]),
        Route("/_sim/nixl/handshake", _handshake(state), methods=["GET"]),
        Route("/_sim/nixl/read", _read(state), methods=["POST"]),
        Route("/_sim/nixl/notify", _notify(state), methods=["POST"]),
        Route("/_sim/faults", _faults(state), methods=["GET", "POST"]),
        Route("/_sim/state", _state(state), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, **error_handling())
    app.state.sim = state
    return app


Handler = Any


def _check_model(state: SimState, body: dict[str, Any]) -> None:
    """vLLM's ``_check_model``: an empty or absent ``model`` means the served one."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "`model` must be a string.", param="model")
    name = state.config.served_model_name
    if model and model != name:
        raise APIError(
            404, f"The model `{model}` does not exist. Valid aliases: {name}.", param="model"
        )


def _generate(state: SimState, *, chat: bool) -> Handler:
    async def handler(request: Request) -> Response:
        body = await _json_body(request)
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
    _check_model(state, body)
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
        body = await _json_body(request)
        _check_model(state, body)
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
        chat = messages.to_chat(await _json_body(request), traits)
        return await messages.convert(await run(request, chat))

    return handler


def _count_tokens(state: SimState) -> Handler:
    traits = messages.TemplateTraits(state.renderer)

    async def handler(request: Request) -> Response:
        chat = messages.to_chat(await _json_body(request), traits, count_tokens=True)
        _check_model(state, chat)
        return JSONResponse(messages.count_tokens(state.renderer, chat))

    return handler


def _tokenize(state: SimState) -> Handler:
    r = state.renderer

    async def handler(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(state, body)
        if "messages" in body:
            text = r.render_chat(body)
            ids = r.tokenizer.encode(
                text, add_special_tokens=bool(body.get("add_special_tokens", False))
            )
        elif isinstance(body.get("prompt"), str):
            ids = r.tokenizer.encode(
                body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))
            )
        else:
            raise APIError(400, "Either `prompt` (a string) or `messages` is required.")
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": state.config.max_model_len,
            "tokens": ids,
        }
        out["token_strs"] = (
            [r.tokenizer.id_to_token(t) for t in ids] if body.get("return_token_strs") else None
        )
        return JSONResponse(out)

    return handler


def _detokenize(state: SimState) -> Handler:
    r = state.renderer

    async def handler(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(state, body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise APIError(400, "`tokens` must be a list of token ids.", param="tokens")
        for t in tokens:
            if not r.tokenizer.is_valid_id(t):
                raise APIError(400, f"Token id {t} is out of vocabulary", param="tokens")
        return JSONResponse({"prompt": r.tokenizer.decode(tokens)})

    return handler


def _models(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        cfg = state.config
        card = {
            "id": cfg.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": cfg.served_model_name,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                    "object": "model_permission",
                    "created": int(time.time()),
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return JSONResponse({"object": "list", "data": [card]})

    return handler


def _health(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        return Response(
            status_code=state.faults.health_status,
            headers={HEADER_SIM_ENGINE_ID: state.config.engine_id},
        )

    return handler


def _metrics(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        return Response(
            state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    return handler


def _reset(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        state.engine.reset_prefix_cache()
        return Response(status_code=200)

    return handler


def _kv_event_sources(state: SimState) -> Handler:
    """vLLM 0.33's ``GET /kv_event_sources``: the publisher's resolved config per data-parallel
    rank (``{"0": {...}}``), ``{}`` when events are off."""

    async def handler(request: Request) -> Response:
        publisher = state.engine.kv_events
        if publisher is None:
            return JSONResponse({})
        return JSONResponse({"0": publisher.config.model_dump()})

    return handler


def _handshake(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        return JSONResponse(state.engine.handshake())

    return handler


def _read(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        body = await _json_body(request)
        request_id, block_ids = body.get("request_id"), body.get("block_ids")
        if not isinstance(request_id, str) or not isinstance(block_ids, list):
            raise APIError(400, "`request_id` and `block_ids` are required.")
        try:
            blocks = state.engine.serve_read(request_id, [int(b) for b in block_ids])
        except KeyError:
            raise APIError(410, f"No KV blocks held for request {request_id}.") from None
        await state.engine.reap()
        return JSONResponse({"blocks": blocks})

    return handler


def _notify(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        body = await _json_body(request)
        request_id = body.get("request_id")
        if not isinstance(request_id, str):
            raise APIError(400, "`request_id` is required.")
        return JSONResponse({"freed": state.engine.serve_notify(request_id)})

    return handler


def _faults(state: SimState) -> Handler:
    exit_timer: list[asyncio.TimerHandle] = []  # the pending ``exit_after_s``, if any

    async def handler(request: Request) -> Response:
        if request.method == "POST":
            body = await _json_body(request)
            try:
                update = Faults.model_validate({**state.faults.model_dump(), **body})
            except ValidationError as exc:
                raise APIError(400, f"Invalid fault knobs: {exc}") from exc
            for name in Faults.model_fields:
                setattr(state.faults, name, getattr(update, name))
            if "exit_after_s" in body:  # a new value replaces (null cancels) the pending exit
                while exit_timer:
                    exit_timer.pop().cancel()
                if update.exit_after_s is not None:
                    loop = asyncio.get_running_loop()
                    exit_timer.append(loop.call_later(update.exit_after_s, os._exit, 1))
        return JSONResponse(state.faults.model_dump())

    return handler


def _state(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        engine = state.engine
        now = engine.clock.now()
        retained = {
            rid: {
                "blocks": [b.block_id for b in held.blocks],
                "for_next_turn": held.for_next_turn,
                "expires_in_s": held.expires_at - now,
            }
            for rid, held in engine.retained.items()
        }
        return JSONResponse(
            {
                "engine_id": state.config.engine_id,
                "role": state.config.role,
                "blocks_used": engine.pool.num_used,
                "blocks_total": engine.pool.num_usable,
                "blocks_cached": engine.pool.num_cached,
                "cpu_blocks": None if engine.cpu is None else len(engine.cpu),
                "prefill_tokens_in_flight": engine.prefill_tokens_in_flight,
                "retained": retained,
                "now": now,
                "last_trace_context": state.trace_context,
            }
        )

    return handler
