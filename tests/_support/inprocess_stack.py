"""The router in front of simulator P and D instances, all in-process: no ports, no processes.

Each simulator app and the router app run their lifespans (health checks, the reaper) in the
test's event loop. The router reaches the simulators through a fake of its engine client
(``engine_client.InProcessEngines``); the simulators (for their KV transfers) and the test's
clients reach the apps through an httpx transport; both dispatch by URL port. The simulators
and the router's handle store share one manual clock, so TTLs pass by
:meth:`InProcessStack.advance`, not by sleeping.

The subprocess counterpart is ``stack.py`` (streaming relays, kills, Redis, real ports).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette

import agentkv
from agentkv.protocol.promtext import parse_metrics
from agentkv.router import create_app as create_router
from agentkv.router.config import RouterConfig
from agentkv.router.store import HandleStore, make_store
from agentkv.sim import SimConfig, SimState
from agentkv.sim import create_app as create_sim
from agentkv.sim.transfer import TransferClient
from tests._support.clock import SharedClock
from tests._support.engine_client import InProcessEngines
from tests._support.router_config import router_data

ROUTER_PORT = 8000
P_PORT, D_PORT = 8100, 8200
"""The first P's and D's ports (the next ones count up); only the transports read them."""


class ByPort(httpx.AsyncBaseTransport):
    """Sends each request to the ASGI app registered for its URL's port."""

    def __init__(self, apps: dict[int, Starlette]) -> None:
        self.apps = apps

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        app = self.apps.get(request.url.port or 80)
        if app is None:
            raise httpx.ConnectError(f"nothing listens on {request.url.port}", request=request)
        return await httpx.ASGITransport(app=app).handle_async_request(request)


@dataclass
class Sim:
    """One in-process simulator: its URL (as the router's config names it) and its state."""

    url: str
    state: SimState


@dataclass
class Router:
    url: str
    app: Starlette


@dataclass
class InProcessStack:
    prefill: list[Sim]
    decode: list[Sim]
    router: Router
    clock: SharedClock
    transport: ByPort
    http: httpx.AsyncClient
    """Reaches every app by URL (``http://localhost:PORT``)."""

    def metrics(self, sim: Sim) -> dict[str, float]:
        return parse_metrics(sim.state.metrics.render().decode())

    def wrong_kv(self) -> float:
        return sum(
            self.metrics(s).get("agentkv_sim_wrong_kv_tokens_total", 0.0)
            for s in [*self.prefill, *self.decode]
        )

    def retained(self, sim: Sim) -> int:
        return len(sim.state.engine.retained)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on every instance's clock and the router's handle store."""
        self.clock.advance(seconds)

    def client(self, api_key: str = "k") -> agentkv.AsyncClient:
        """An SDK client of the router (its HTTP goes to the router app in-process)."""
        http = httpx.AsyncClient(transport=self.transport, timeout=30)
        return agentkv.AsyncClient(
            base_url=f"{self.router.url}/v1", api_key=api_key, http_client=http
        )


@contextlib.asynccontextmanager
async def inprocess_stack(
    *,
    p_args: Sequence[dict[str, Any]] = ({},),
    d_args: Sequence[dict[str, Any]] = ({},),
    router: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    common: dict[str, Any] | None = None,
    store: HandleStore | None = None,
) -> AsyncIterator[InProcessStack]:
    """P and D simulators (``SimConfig`` fields: ``common`` + each one's ``p_args``/``d_args``)
    and a router (``router``: ``RouterConfig`` fields; ``backend``: each engine's fields;
    ``store``: its handle store, default the configured one on the shared clock) in front of
    them, lifespans running; stops them all on exit."""
    common = {"time_scale": 0.0, "block_size": 16, **(common or {})}
    clock = SharedClock()
    apps: dict[int, Starlette] = {}
    transport = ByPort(apps)
    sims: dict[str, list[Sim]] = {"prefill": [], "decode": []}
    for role, port0, origin, args in (
        ("prefill", P_PORT, 5_000.0, p_args),
        ("decode", D_PORT, 90_000.0, d_args),
    ):
        for i, extra in enumerate(args):
            port = port0 + i
            cfg = SimConfig.model_validate({"role": role, "port": port, **common, **extra})
            app = create_sim(
                cfg,
                clock=clock.view(origin + 1_000.0 * i),
                transfer=TransferClient(httpx.AsyncClient(transport=ByPort(apps))),
            )
            apps[port] = app
            sims[role].append(Sim(f"http://localhost:{port}", app.state.sim))
    engines = {
        "prefill": [{"url": s.url, **(backend or {})} for s in sims["prefill"]],
        "decode": [{"url": s.url, **(backend or {})} for s in sims["decode"]],
        "block_size": 16,
        "health_interval_s": 0.5,
    }
    config = RouterConfig.model_validate(router_data({"upstream": engines}, router))
    store = store or make_store(
        config.store.backend,
        max_entries=config.store.max_entries,
        max_entries_per_tenant=config.tenant_bound,
        per_conversation=config.store.handles_per_conversation,
        clock=clock.monotonic,
    )
    router_app = create_router(config, store=store, engine_client=InProcessEngines(apps))
    apps[ROUTER_PORT] = router_app
    async with contextlib.AsyncExitStack() as stack:
        for app in apps.values():
            await stack.enter_async_context(app.router.lifespan_context(app))
        http = await stack.enter_async_context(httpx.AsyncClient(transport=transport, timeout=30))
        yield InProcessStack(
            sims["prefill"],
            sims["decode"],
            Router(f"http://localhost:{ROUTER_PORT}", router_app),
            clock,
            transport,
            http,
        )
