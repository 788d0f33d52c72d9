"""``create_app(config)``: the router as an ASGI app (Starlette), no module-level state.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic's API, :mod:`agentkv.router.messages`),
``POST /v1/responses`` (with ``GET`` and ``DELETE /v1/responses/{id}``:
:mod:`agentkv.router.responses`), ``POST /tokenize``,
``POST /detokenize``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (on
``http.metrics_port`` instead when one is configured), ``DELETE /v1/conversations/{id}``,
``POST /v1/conversations/{id}/lease``, ``POST /v1/conversations/leases`` (a conversation id may
contain ``/``). Unknown paths and methods are answered in OpenAI's error shape (404, 405).

With tenants configured every route but ``/health`` needs a tenant's key, ``/metrics`` an admin
key (``tenancy.admin_api_keys``); ``/health`` shows engine addresses only to an admin key (or when
neither tenants nor admin keys are configured).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Literal

from prometheus_client import Counter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentkv.protocol.errors import APIError, error_body
from agentkv.protocol.http import json_object
from agentkv.protocol.names import RouterMetric
from agentkv.router.config import RouterConfig
from agentkv.router.errors import router_error_handling
from agentkv.router.guard import GuardedStore
from agentkv.router.heap import HeapTrimmer
from agentkv.router.http import ClientFactory, TransportError
from agentkv.router.identity import Identity, IdentityLedger, MemoryLedger, RedisLedger
from agentkv.router.kv_index import PrefixIndex
from agentkv.router.kv_subscriber import KVEventSubscriber
from agentkv.router.leases import MemoryLeases, RedisLeases
from agentkv.router.logs import safe
from agentkv.router.memory_store import MemoryStore
from agentkv.router.messages import (
    TemplateTraits,
    chat_body,
    json_body,
    messages_api,
    with_api_key,
)
from agentkv.router.metrics import RouterMetrics
from agentkv.router.pd import Router
from agentkv.router.redis_store import RedisStore
from agentkv.router.request import lease_seconds, parse_body, parse_request, read_body
from agentkv.router.responses import ResponsesAPI
from agentkv.router.responses_store import MemoryResponses, RedisResponses, ResponseStore
from agentkv.router.retention import LeasesUnavailable
from agentkv.router.server import HeadLimits, bounded_protocol
from agentkv.router.store import Bound, HandleStore, make_store
from agentkv.router.tenancy import Tenancy
from agentkv.router.tracing import extracted
from agentkv.router.upstream import EnginePool

__all__ = ["create_app"]

log = logging.getLogger("agentkv.router")
Handler = Callable[[Request], Awaitable[Response]]


def create_app(
    config: RouterConfig,
    *,
    store: HandleStore | None = None,
    engine_client: ClientFactory | None = None,
) -> Starlette:
    """The router for ``config``.

    Args:
        config: backends and policies.
        store: where handles live (default: from ``config.store.backend``).
        engine_client: makes the client of each engine (default: aiohttp's,
            :class:`~agentkv.router.http.AiohttpClient`; tests: a fake that reaches in-process
            engines).
    """
    pool = EnginePool(config, engine_client=engine_client)
    metrics = RouterMetrics()
    aborts = Counter(
        RouterMetric.CLIENT_ABORTS,
        "Requests the client hung up on before they were answered, by stage.",
        ("stage",),
        registry=metrics.registry,
    )
    open_admin = not config.tenancy.tenants and not config.tenancy.admin_api_keys
    """No tenants, no admin keys: everything is open, as before tenancy."""
    head_limits = HeadLimits(config.http.max_header_bytes, config.http.max_headers)
    tenancy = Tenancy(config)
    tenant_for, is_admin = tenancy.tenant_for, tenancy.is_admin
    the_store = GuardedStore(
        store
        or make_store(
            config.store.backend,
            max_entries=config.store.max_entries,
            max_entries_per_tenant=config.tenant_bound,
            per_conversation=config.store.handles_per_conversation,
            on_evict=EvictionReport(metrics),
        ),
        failures_to_open=config.store.failures_to_open,
        open_s=config.store.open_s,
        on_error=lambda op: metrics.store_errors.labels(op).inc(),
    )
    inner = the_store.inner
    leases = (
        RedisLeases(inner.client, prefix=inner.prefix)
        if isinstance(inner, RedisStore)
        else MemoryLeases()
    )
    ledger: IdentityLedger = (
        RedisLedger(
            inner.client,
            prefix=inner.prefix,
            per_conversation=config.identity.max_tokens_per_conversation,
            branches=config.store.handles_per_conversation,
            ttl_s=config.identity_keep_s,
        )
        if isinstance(inner, RedisStore)
        else MemoryLedger(
            max_tokens=config.identity.max_tokens,
            per_conversation=config.identity.max_tokens_per_conversation,
            branches=config.store.handles_per_conversation,
            ttl_s=config.identity_keep_s,
            clock=inner.clock if isinstance(inner, MemoryStore) else time.monotonic,
        )
    )
    identity = Identity(
        ledger,
        enabled=config.identity.keep,
        on_error=lambda op: metrics.store_errors.labels(op).inc(),
    )
    indexes, cpu_indexes, subscribers = kv_event_indexes(config)
    router = Router(
        config,
        pool,
        the_store,
        metrics,
        local_prefix=indexes,
        cpu_prefix=cpu_indexes,
        leases=leases,
        identity=identity,
    )
    responses = ResponsesAPI(config, router, response_store(config, inner), tenancy)

    heap = HeapTrimmer(config.http.heap_trim_interval_s or None)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        pool.start()
        router.start()
        heap.start()
        for subscriber in subscribers:
            try:
                await subscriber.start()
            except Exception as exc:  # events are an accelerator: run without L
                log.warning("KV events of %s unavailable: %s", subscriber.endpoint, exc)
        metrics_server = (
            await _serve_metrics(
                metrics_app,
                config.http.host,
                config.http.metrics_port,
                head_limits,
                config.http.parser,
            )
            if config.http.metrics_port is not None
            else None
        )
        try:
            yield
        finally:
            await heap.aclose()
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
            caller = tenant_for(request.headers.get("authorization"))
            raw = await read_body(request, config.http.max_body_bytes)
            headers = {k.lower(): v for k, v in request.headers.items()}
            req = parse_request(raw, headers, chat=chat, config=config, caller=caller)
            with extracted(headers):  # the client's traceparent: the parent of the turn's span
                return await router.turn(req)

        return handler

    traits = TemplateTraits()

    async def messages(request: Request) -> Response:
        """Anthropic's ``/v1/messages``: its Chat Completions body through the turn core (the
        answer and errors are converted by :func:`messages_api`)."""
        headers = with_api_key(request.headers)
        caller = tenant_for(headers.get("authorization"))
        body = json_body(await read_body(request, config.http.max_body_bytes))
        chat = await chat_body(body, router, traits)
        req = parse_body(chat, headers, chat=True, caller=caller, session_body=body)
        with extracted(headers):
            return await router.turn(req)

    async def count_tokens(request: Request) -> Response:
        """The prompt length the engines would run for a Messages request (P's ``/tokenize``)."""
        headers = with_api_key(request.headers)
        caller = tenant_for(headers.get("authorization"))
        body = json_body(await read_body(request, config.http.max_body_bytes))
        chat = await chat_body(body, router, traits, count_tokens=True)
        req = parse_body(chat, headers, chat=True, caller=caller)
        n = len(await router.prompt_ids(req))
        return JSONResponse({"input_tokens": n, "context_management": {"original_input_tokens": n}})

    def passthrough(path: str) -> Handler:
        """``/tokenize`` and ``/detokenize``: answered by a healthy P, as the engines would."""

        async def handler(request: Request) -> Response:
            tenant_for(request.headers.get("authorization"))
            raw = await read_body(request, config.http.max_body_bytes)
            for engine in [e for e in pool.prefill if e.healthy] or pool.prefill:
                try:
                    r = await engine.client.post(path, raw)
                except TransportError:
                    engine.failed(config.upstream.eject_after_failures)
                    continue
                return Response(r.body, status_code=r.status, media_type="application/json")
            raise APIError(503, f"No prefill instance answered {path}.")

        return handler

    async def models(request: Request) -> Response:
        tenant_for(request.headers.get("authorization"))
        for engine in [e for e in pool.decode if e.healthy] or pool.decode:
            try:
                r = await engine.client.get("/v1/models", timeout=10)
            except TransportError:
                continue
            if r.status == 200:
                return Response(r.body, media_type="application/json")
        raise APIError(503, "No decode instance answered /v1/models.")

    async def health(request: Request) -> Response:
        # ok once every role has an instance that answered since start and is in rotation;
        # "starting" until each role has had one answer (an orchestrator's readiness probe and
        # `agentkv serve` wait for 200, so no client is sent here before the engines answer)
        p = sum(e.ready for e in pool.prefill)
        d = sum(e.ready for e in pool.decode)
        started = any(e.answered for e in pool.prefill) and any(e.answered for e in pool.decode)
        body: dict[str, Any] = {
            "status": "ok" if p and d else "unavailable" if started else "starting",
            # a failing store costs reuse, never answers: degraded, still 200
            "store": "ok" if the_store.healthy else "degraded",
        }
        if open_admin or is_admin(request.headers.get("authorization")):
            body["prefill"] = {e.url: e.ready for e in pool.prefill}
            body["decode"] = {e.url: e.ready for e in pool.decode}
            body["handles"] = await the_store.size()
        return JSONResponse(body, status_code=200 if p and d else 503)

    async def metrics_text(request: Request) -> Response:
        size = await the_store.size()
        if size is not None:
            metrics.store_size.set(size)
        for e in pool.all:
            metrics.healthy.labels(e.role, e.url).set(1 if e.ready else 0)
        for url, index in (*indexes.items(), *cpu_indexes.items()):
            metrics.kv_index_in_sync.labels(url).set(1 if index.in_sync else 0)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def metrics_route(request: Request) -> Response:
        if not open_admin and not is_admin(request.headers.get("authorization")):
            raise APIError(401, "/metrics needs an admin key (Authorization: Bearer <key>).")
        return await metrics_text(request)

    metrics_app = Starlette(routes=[Route("/metrics", metrics_text, methods=["GET"])])

    async def close(request: Request) -> Response:
        tenant = tenant_for(request.headers.get("authorization")).tenant
        conversation = request.path_params["conversation_id"]
        released = await router.close_conversation(tenant, conversation)
        return JSONResponse(
            {"id": conversation, "object": "conversation.deleted", "released": released}
        )

    async def lease_call(request: Request) -> tuple[str, dict[str, Any], float]:
        """A lease call's tenant, JSON body and ``lease_s`` (required)."""
        tenant = tenant_for(request.headers.get("authorization")).tenant
        body = await _json_object(request)
        seconds = lease_seconds(body.get("lease_s"))
        if seconds is None:
            raise APIError(400, "`lease_s` is required.", param="lease_s")
        return tenant, body, seconds

    async def renew(tenant: str, conversations: list[str], seconds: float) -> list[dict[str, Any]]:
        """Lease items: ``lease_s`` granted, or an ``error`` (404: no stored KV; 429: the
        tenant's ``retention.max_leases_per_tenant``) for a conversation whose lease was not
        renewed."""
        try:
            granted, refusals = await router.retention.renew_held(tenant, conversations, seconds)
        except LeasesUnavailable as exc:
            raise APIError(503, str(exc)) from exc
        return [
            {"id": c, "object": "conversation.lease", "lease_s": granted}
            if r is None
            else {"id": c, "object": "conversation.lease", **error_body(r.status, r.message)}
            for c, r in zip(conversations, refusals, strict=True)
        ]

    async def lease(request: Request) -> Response:
        tenant, _, seconds = await lease_call(request)
        [item] = await renew(tenant, [request.path_params["conversation_id"]], seconds)
        if "error" in item:
            raise APIError(item["error"]["code"], item["error"]["message"])
        return JSONResponse(item)

    async def leases_batch(request: Request) -> Response:
        tenant, body, seconds = await lease_call(request)
        ids = body.get("ids")
        if (
            not isinstance(ids, list)
            or len(ids) > 10_000
            or not all(isinstance(i, str) and 0 < len(i) <= 512 for i in ids)
        ):
            raise APIError(
                400, "`ids` must be a list of at most 10000 conversation ids.", param="ids"
            )
        return JSONResponse({"object": "list", "data": await renew(tenant, ids, seconds)})

    routes = [
        Route("/v1/chat/completions", generate(True), methods=["POST"]),
        Route("/v1/conversations/leases", leases_batch, methods=["POST"]),
        Route("/v1/conversations/{conversation_id:path}/lease", lease, methods=["POST"]),
        Route("/v1/completions", generate(False), methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/messages", messages_api(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/tokenize", passthrough("/tokenize"), methods=["POST"]),
        Route("/detokenize", passthrough("/detokenize"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/conversations/{conversation_id:path}", close, methods=["DELETE"]),
    ]
    if config.http.metrics_port is None:
        routes.append(Route("/metrics", metrics_route, methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan, **router_error_handling(metrics, aborts))
    app.state.router = router
    return app


class EvictionReport:
    """``on_evict`` of the store: the eviction metric, and a warning per tenant and bound at
    most once every ``every_s`` seconds (a tenant at its bound evicts on every new turn)."""

    def __init__(self, metrics: RouterMetrics, every_s: float = 60.0) -> None:
        self._metrics, self._every_s = metrics, every_s
        self._last: dict[tuple[str, Bound], float] = {}

    def __call__(self, tenant: str, bound: Bound) -> None:
        self._metrics.store_evictions.labels(tenant, bound).inc()
        now = time.monotonic()
        last = self._last.get((tenant, bound))
        if last is None or now - last >= self._every_s:
            self._last[(tenant, bound)] = now
            what = (
                "its bound (store.max_entries_per_tenant)"
                if bound == "tenant"
                else "the largest share of a full store (store.max_entries)"
            )
            log.warning(
                "tenant %s holds %s: its oldest handles are evicted (and released)",
                safe(tenant),
                what,
            )


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await read_body(request, 1 << 20)
    try:
        return json_object(raw or b"{}")
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def response_store(config: RouterConfig, handles: HandleStore) -> ResponseStore:
    """Stored responses (``previous_response_id``) in the handle store's backend."""
    if isinstance(handles, RedisStore):
        return RedisResponses(handles.client, prefix=handles.prefix, ttl_s=config.responses.ttl_s)
    return MemoryResponses(
        ttl_s=config.responses.ttl_s,
        max_per_tenant=config.responses.max_per_tenant,
        max_bytes_per_tenant=config.responses.max_bytes_per_tenant,
    )


def kv_event_indexes(
    config: RouterConfig,
) -> tuple[dict[str, PrefixIndex], dict[str, PrefixIndex], list[KVEventSubscriber]]:
    """An index and a subscriber for every engine whose KV events are configured: of each P's
    prefix cache, of each D's CPU tier (``medium: "CPU"`` events; docs/paths.md)."""
    indexes: tuple[dict[str, PrefixIndex], dict[str, PrefixIndex]] = ({}, {})
    subscribers: list[KVEventSubscriber] = []
    for role, backends in enumerate((config.upstream.prefill, config.upstream.decode)):
        for backend in backends:
            events = backend.kv_events
            if events is None or not events.active:
                continue
            index = PrefixIndex(config.upstream.block_size, medium="CPU" if role else "GPU")
            indexes[role][backend.url] = index
            subscribers.append(KVEventSubscriber.from_config(events, index, host=backend.host))
    return indexes[0], indexes[1], subscribers


class _MetricsServer:
    """``/metrics`` on its own port, in the router's event loop (uvicorn, no signal handlers:
    the main server owns the process's signals and stops this one in its lifespan)."""

    def __init__(self, server: Any, task: asyncio.Task[None]) -> None:
        self.server, self.task = server, task

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def _serve_metrics(
    app: Starlette,
    host: str,
    port: int,
    limits: HeadLimits,
    parser: Literal["auto", "httptools", "h11"],
) -> _MetricsServer:
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
    config = uvicorn.Config(
        app,
        http=bounded_protocol(limits, parser),
        lifespan="off",
        access_log=False,
        log_config=None,
        log_level=None,
    )
    server = Server(config)
    # the socket is bound already: serving it cannot fail to start
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    log.info("metrics on http://%s:%d/metrics", host, port)
    return _MetricsServer(server, task)
