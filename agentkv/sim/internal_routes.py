"""The simulator's own routes (not vLLM's): the NIXL stand-in under ``/_sim/nixl/``
(:mod:`agentkv.sim.transfer`), ``GET|POST /_sim/faults`` (:mod:`agentkv.sim.faults`) and
``GET /_sim/state``."""

from __future__ import annotations

import asyncio
import os

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv.protocol.errors import APIError
from agentkv.sim.faults import Faults
from agentkv.sim.state import Handler, SimState, json_body

__all__ = ["routes"]


def routes(state: SimState) -> list[Route]:
    """The simulator-only routes of ``state``'s instance."""
    return [
        Route("/_sim/nixl/handshake", _handshake(state), methods=["GET"]),
        Route("/_sim/nixl/read", _read(state), methods=["POST"]),
        Route("/_sim/nixl/notify", _notify(state), methods=["POST"]),
        Route("/_sim/faults", _faults(state), methods=["GET", "POST"]),
        Route("/_sim/state", _state(state), methods=["GET"]),
    ]


def _handshake(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        return JSONResponse(state.engine.handshake())

    return handler


def _read(state: SimState) -> Handler:
    async def handler(request: Request) -> Response:
        body = await json_body(request)
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
        body = await json_body(request)
        request_id = body.get("request_id")
        if not isinstance(request_id, str):
            raise APIError(400, "`request_id` is required.")
        return JSONResponse({"freed": state.engine.serve_notify(request_id)})

    return handler


def _faults(state: SimState) -> Handler:
    exit_timer: list[asyncio.TimerHandle] = []  # the pending ``exit_after_s``, if any

    async def handler(request: Request) -> Response:
        if request.method == "POST":
            body = await json_body(request)
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
