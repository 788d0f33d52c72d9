"""vLLM's other routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /reset_prefix_cache``, ``GET /kv_event_sources``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv.protocol import HEADER_SIM_ENGINE_ID
from agentkv.protocol.errors import APIError
from agentkv.sim.state import Handler, SimState, check_model, json_body

__all__ = ["routes"]


def routes(state: SimState) -> list[Route]:
    """vLLM's tokenizer, model list, health, metrics and cache routes of ``state``'s instance."""
    return [
        Route("/tokenize", _tokenize(state), methods=["POST"]),
        Route("/detokenize", _detokenize(state), methods=["POST"]),
        Route("/v1/models", _models(state), methods=["GET"]),
        Route("/health", _health(state), methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
        Route("/reset_prefix_cache", _reset(state), methods=["POST"]),
        Route("/kv_event_sources", _kv_event_sources(state), methods=["GET"]),
    ]


def _tokenize(state: SimState) -> Handler:
    r = state.renderer

    async def handler(request: Request) -> Response:
        body = await json_body(request)
        check_model(state, body)
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
        body = await json_body(request)
        check_model(state, body)
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
