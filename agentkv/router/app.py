"""``create_app(config)``: the router as an ASGI app (Starlette), no module-level state.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic's API, :mod:`agentkv.router.messages`),
``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (on
``metrics_port`` instead when one is configured), ``DELETE /v1/conversations/{id}``.

With tenants configured every route but ``/health`` needs a tenant's key, ``/metrics`` an admin
key (``admin_api_keys``); ``/health`` shows engine addresses only to an admin key (or when
neither tenants nor admin keys are configured).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson
from prometheus_client import Counter
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv.protocol.http import error_response, json_object
from agentkv.protocol.names import RouterMetric
from agentkv.router.config import RouterConfig
from agentkv.router.guard import GuardedStore
from agentkv.router.http import TransportError
from agentkv.router.kv_index import KVEventSubscriber, PrefixIndex
from agentkv.router.leases import MemoryLeases, RedisLeases
from agentkv.router.logs import safe
from agentkv.router.messages import (
    TemplateTraits,
    anthropic_errors,
    chat_body,
    messages_api,
    with_api_key,
)
from agentkv.router.metrics import RouterMetrics
from agentkv.router.pd import Router, UpstreamError
from agentkv.router.redis_store import RedisStore
from agentkv.router.request import (
    RouterError,
    is_admin,
    lease_seconds,
    parse_request,
    read_body,
    tenant_for,
)
from agentkv.router.store import HandleStore, make_store
from agentkv.router.tracing import extracted
from agentkv.router.upstream import EnginePool

__all__ = ["create_app"]

log = logging.getLogger("agentkv.router")
Handler = Callable[[Request], Awaitable[Response]]


def _guard(metrics: RouterMetrics, aborts: Counter, fn: Handler) -> Handler:
    async def handler(request: Request) -> Response:
        try:
            return await fn(request)
        except RouterError as exc:
            metrics.failed.labels(str(exc.status)).inc()
            return error_response(exc.status, exc.message, exc.param, close=exc.close)
        except ClientDisconnect:
            # the client hung up before its request was in: nothing to answer, nothing failed
            aborts.labels("upload").inc()
            log.info("client hung up during upload path=%s", safe(request.url.path))
            return Response(status_code=499)
        except UpstreamError as exc:
            metrics.failed.labels(str(exc.status)).inc()
            return Response(exc.body, status_code=exc.status, media_type="application/json")
        except Exception:
            log.exception("router failure")
            metrics.failed.labels("500").inc()
            return error_response(500, "Internal router error.")

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
        transport: an httpx transport for all upstream calls (tests: engines in-process); the
            router then uses httpx instead of aiohttp.
    """
    pool = EnginePool(config, transport=transport)
    metrics = RouterMetrics()
    aborts = Counter(
        RouterMetric.CLIENT_ABORTS,
        "Requests the client hung up on before they were answered, by stage.",
        ("stage",),
        registry=metrics.registry,
    )
    open_admin = not config.tenants and not config.admin_api_keys
    """No tenants, no admin keys: everything is open, as before tenancy."""
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
    inner = the_store.inner
    leases = (
        RedisLeases(inner.client, prefix=inner.prefix)
        if isinstance(inner, RedisStore)
        else MemoryLeases()
    )
    indexes, subscribers = kv_event_indexes(config)
    router = Router(config, pool, the_store, metrics, local_prefix=indexes, leases=leases)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool.start()
        router.start()
        for subscriber in subscribers:
            try:
                await subscriber.start()
            except Exception as exc:  # events are an accelerator: run without L
                log.warning("KV events of %s unavailable: %s", subscriber.endpoint, exc)
        metrics_server = (
            await _serve_metrics(metrics_app, config.host, config.metrics_port)
            if config.metrics_port is not None
            else None
        )
        try:
            yield
        finally:
            if metrics_server is not None:
                await metrics_server.stop()
            await router.drain()
            for subscriber in subscribers:
                await subscriber.aclose()
            await pool.aclose()
            await the_store.aclose()

    def generate(chat: bool) -> Handler:
        async def handler(request: Request) -> Response:
            # the key first: an unknown client does not get to send a body
            tenant_for(config, request.headers.get("authorization"))
            raw = await read_body(request, config.max_body_bytes)
            headers = {k.lower(): v for k, v in request.headers.items()}
            req = parse_request(raw, headers, chat=chat, config=config)
            with extracted(headers):  # the client's traceparent: the parent of the turn's span
                return await router.turn(req)

        return _guard(metrics, aborts, handler)

    traits = TemplateTraits()

    async def messages(request: Request) -> Response:
        """Anthropic's ``/v1/messages``: its Chat Completions body through the turn core (the
        answer and errors are converted by :func:`messages_api`)."""
        headers = with_api_key(request.headers)
        tenant_for(config, headers.get("authorization"))
        chat = await chat_body(await read_body(request, config.max_body_bytes), router, traits)
        req = parse_request(orjson.dumps(chat), headers, chat=True, config=config)
        with extracted(headers):
            return await router.turn(req)

    async def count_tokens(request: Request) -> Response:
        """The prompt length the engines would run for a Messages request (P's ``/tokenize``)."""
        headers = with_api_key(request.headers)
        tenant_for(config, headers.get("authorization"))
        raw = await read_body(request, config.max_body_bytes)
        chat = await chat_body(raw, router, traits, count_tokens=True)
        req = parse_request(orjson.dumps(chat), headers, chat=True, config=config)
        n = len(await router.prompt_ids(req))
        return JSONResponse({"input_tokens": n, "context_management": {"original_input_tokens": n}})

    def passthrough(path: str) -> Handler:
        """``/tokenize`` and ``/detokenize``: answered by a healthy P, as the engines would."""

        async def handler(request: Request) -> Response:
            tenant_for(config, request.headers.get("authorization"))
            raw = await read_body(request, config.max_body_bytes)
            for engine in [e for e in pool.prefill if e.healthy] or pool.prefill:
                try:
                    r = await engine.client.post(path, raw)
                except TransportError:
                    engine.failed(config.eject_after_failures)
                    continue
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            raise RouterError(503, f"No prefill instance answered {path}.")

        return _guard(metrics, aborts, handler)

    async def models(request: Request) -> Response:
        tenant_for(config, request.headers.get("authorization"))
        for engine in [e for e in pool.decode if e.healthy] or pool.decode:
            try:
                r = await engine.client.get("/v1/models", timeout=10)
            except TransportError:
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
        }
        if open_admin or is_admin(config, request.headers.get("authorization")):
            body["prefill"] = {e.url: e.healthy for e in pool.prefill}
            body["decode"] = {e.url: e.healthy for e in pool.decode}
            body["handles"] = await the_store.size()
        return JSONResponse(body, status_code=200 if p and d else 503)

    async def metrics_text(request: Request) -> Response:
        size = await the_store.size()
        if size is not None:
            metrics.store_size.set(size)
        for e in pool.all:
            metrics.healthy.labels(e.role, e.url).set(1 if e.healthy else 0)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def metrics_route(request: Request) -> Response:
        if not open_admin and not is_admin(config, request.headers.get("authorization")):
            raise RouterError(401, "/metrics needs an admin key (Authorization: Bearer <key>).")
        return await metrics_text(request)

    metrics_app = Starlette(routes=[Route("/metrics", metrics_text, methods=["GET"])])

    async def close(request: Request) -> Response:
        tenant, _ = tenant_for(config, request.headers.get("authorization"))
        conversation = request.path_params["conversation_id"]
        released = await router.close_conversation(tenant, conversation)
        return JSONResponse(
            {"id": conversation, "object": "conversation.deleted", "released": released}
        )

    async def lease_call(request: Request) -> tuple[str, dict[str, Any], float]:
        """A lease call's tenant, JSON body and ``lease_s`` (required)."""
        tenant, _ = tenant_for(config, request.headers.get("authorization"))
        body = await _json_object(request)
        seconds = lease_seconds(body.get("lease_s"))
        if seconds is None:
            raise RouterError(400, "`lease_s` is required.", param="lease_s")
        return tenant, body, seconds

    async def renew(tenant: str, conversation: str, seconds: float) -> dict[str, Any]:
        granted = await router.retention.renew((tenant, conversation), seconds)
        return {"id": conversation, "object": "conversation.lease", "lease_s": granted}

    async def lease(request: Request) -> Response:
        tenant, _, seconds = await lease_call(request)
        return JSONResponse(await renew(tenant, request.path_params["conversation_id"], seconds))

    async def leases_batch(request: Request) -> Response:
        tenant, body, seconds = await lease_call(request)
        ids = body.get("ids")
        if (
            not isinstance(ids, list)
            or len(ids) > 10_000
            or not all(isinstance(i, str) and 0 < len(i) <= 512 for i in ids)
        ):
            raise RouterError(
                400, "`ids` must be a list of at most 10000 conversation ids.", param="ids"
            )
        data = [await renew(tenant, conversation, seconds) for conversation in ids]
        return JSONResponse({"object": "list", "data": data})

    routes = [
        Route("/v1/chat/completions", generate(True), methods=["POST"]),
        Route("/v1/conversations/leases", _guard(metrics, aborts, leases_batch), methods=["POST"]),
        Route(
            "/v1/conversations/{conversation_id}/lease",
            _guard(metrics, aborts, lease),
            methods=["POST"],
        ),
        Route("/v1/completions", generate(False), methods=["POST"]),
        Route("/v1/messages", messages_api(_guard(metrics, aborts, messages)), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens",
            anthropic_errors(_guard(metrics, aborts, count_tokens)),
            methods=["POST"],
        ),
        Route("/tokenize", passthrough("/tokenize"), methods=["POST"]),
        Route("/detokenize", passthrough("/detokenize"), methods=["POST"]),
        Route("/v1/models", _guard(metrics, aborts, models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route(
            "/v1/conversations/{conversation_id}",
            _guard(metrics, aborts, close),
            methods=["DELETE"],
        ),
    ]
    if config.metrics_port is None:
        routes.append(Route("/metrics", _guard(metrics, aborts, metrics_route), methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = router
    return app


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await read_body(request, 1 << 20)
    try:
        return json_object(raw or b"{}")
    except ValueError as exc:
        raise RouterError(400, str(exc)) from exc


def kv_event_indexes(
    config: RouterConfig,
) -> tuple[dict[str, PrefixIndex], list[KVEventSubscriber]]:
    """A prefix index and a subscriber for every P whose KV events are configured."""
    indexes: dict[str, PrefixIndex] = {}
    subscribers: list[KVEventSubscriber] = []
    for backend in config.prefill:
        events = backend.kv_events
        if events is None or not events.active:
            continue
        index = PrefixIndex(config.block_size)
        indexes[backend.url] = index
        subscribers.append(KVEventSubscriber.from_config(events, index, host=backend.host))
    return indexes, subscribers


class _MetricsServer:
    """``/metrics`` on its own port, in the router's event loop (uvicorn, no signal handlers:
    the main server owns the process's signals and stops this one in its lifespan)."""

    def __init__(self, server: Any, task: asyncio.Task[None]) -> None:
        self.server, self.task = server, task

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def _serve_metrics(app: Starlette, host: str, port: int) -> _MetricsServer:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, log_level=None)
    server = Server(config)
    # the socket is bound already: serving it cannot fail to start
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    log.info("metrics on http://%s:%d/metrics", host, port)
    return _MetricsServer(server, task)
