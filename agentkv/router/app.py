"""``create_app(config)``: the router as an ASGI app (Starlette), no module-level state.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /tokenize``,
``POST /detokenize``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
``DELETE /v1/conversations/{id}``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv.protocol import error_body
from agentkv.router.config import RouterConfig
from agentkv.router.guard import GuardedStore
from agentkv.router.metrics import RouterMetrics
from agentkv.router.pd import Router, UpstreamError
from agentkv.router.request import RouterError, parse_request, tenant_for
from agentkv.router.store import HandleStore, make_store
from agentkv.router.upstream import EnginePool

__all__ = ["create_app"]

log = logging.getLogger("agentkv.router")
Handler = Callable[[Request], Awaitable[Response]]


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param), status_code=status)


def _guard(metrics: RouterMetrics, fn: Handler) -> Handler:
    async def handler(request: Request) -> Response:
        try:
            return await fn(request)
        except RouterError as exc:
            metrics.failed.labels(str(exc.status)).inc()
            return _error(exc.status, exc.message, exc.param)
        except UpstreamError as exc:
            metrics.failed.labels(str(exc.status)).inc()
            return Response(exc.body, status_code=exc.status, media_type="application/json")
        except Exception:
            log.exception("router failure")
            metrics.failed.labels("500").inc()
            return _error(500, "Internal router error.")

    return handler


def create_app(
    config: RouterConfig,
    *,
    store: HandleStore | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """The router for ``config``.

    Args:
        config: backends and policies.
        store: where handles live (default: from ``config.store``).
        transport: an httpx transport for all upstream calls (tests).
    """
    pool = EnginePool(config, transport=transport)
    metrics = RouterMetrics()
    the_store = GuardedStore(
        store
        or make_store(
            config.store,
            max_entries=config.store_max_entries,
            max_entries_per_tenant=config.store_max_entries_per_tenant,
            per_conversation=config.handles_per_conversation,
        ),
        failures_to_open=config.store_failures_to_open,
        open_s=config.store_open_s,
        on_error=lambda op: metrics.store_errors.labels(op).inc(),
    )
    router = Router(config, pool, the_store, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool.start()
        try:
            yield
        finally:
            await router.drain()
            await pool.aclose()
            await the_store.aclose()

    def generate(chat: bool) -> Handler:
        async def handler(request: Request) -> Response:
            raw = await request.body()
            headers = {k.lower(): v for k, v in request.headers.items()}
            req = parse_request(raw, headers, chat=chat, config=config)
            return await router.turn(req)

        return _guard(metrics, handler)

    def passthrough(path: str) -> Handler:
        """``/tokenize`` and ``/detokenize``: answered by a healthy P, as the engines would."""

        async def handler(request: Request) -> Response:
            tenant_for(config, request.headers.get("authorization"))
            raw = await request.body()
            if len(raw) > config.max_body_bytes:
                raise RouterError(413, f"Request body larger than {config.max_body_bytes} bytes.")
            for engine in [e for e in pool.prefill if e.healthy] or pool.prefill:
                try:
                    r = await engine.client.post(
                        path, content=raw, headers={"content-type": "application/json"}
                    )
                except httpx.HTTPError:
                    engine.failed(config.eject_after_failures)
                    continue
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            raise RouterError(503, f"No prefill instance answered {path}.")

        return _guard(metrics, handler)

    async def models(request: Request) -> Response:
        for engine in [e for e in pool.decode if e.healthy] or pool.decode:
            try:
                r = await engine.client.get("/v1/models", timeout=10)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return Response(r.content, media_type="application/json")
        raise RouterError(503, "No decode instance answered /v1/models.")

    async def health(request: Request) -> Response:
        p = sum(e.healthy for e in pool.prefill)
        d = sum(e.healthy for e in pool.decode)
        body: dict[str, Any] = {
            "status": "ok" if p and d else "unavailable",
            # a failing store costs reuse, never answers: degraded, still 200
            "store": "ok" if the_store.healthy else "degraded",
            "prefill": {e.url: e.healthy for e in pool.prefill},
            "decode": {e.url: e.healthy for e in pool.decode},
            "handles": await the_store.size(),
        }
        return JSONResponse(body, status_code=200 if p and d else 503)

    async def metrics_route(request: Request) -> Response:
        size = await the_store.size()
        if size is not None:
            metrics.store_size.set(size)
        for e in pool.all:
            metrics.healthy.labels(e.role, e.url).set(1 if e.healthy else 0)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def close(request: Request) -> Response:
        tenant, _ = tenant_for(config, request.headers.get("authorization"))
        conversation = request.path_params["conversation_id"]
        released = await router.close_conversation(tenant, conversation)
        return JSONResponse(
            {"id": conversation, "object": "conversation.deleted", "released": released}
        )

    routes = [
        Route("/v1/chat/completions", generate(True), methods=["POST"]),
        Route("/v1/completions", generate(False), methods=["POST"]),
        Route("/tokenize", passthrough("/tokenize"), methods=["POST"]),
        Route("/detokenize", passthrough("/detokenize"), methods=["POST"]),
        Route("/v1/models", _guard(metrics, models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", _guard(metrics, close), methods=["DELETE"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = router
    return app
