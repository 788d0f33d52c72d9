"""In-process P and D simulator instances wired together over httpx's ASGI transport.

Fast protocol tests use this; the end-to-end tests (tests/e2e) use real processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from agentkv.protocol.promtext import parse_metrics
from agentkv.sim import SimConfig, SimState, create_app
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.transfer import TransferClient
from tests._support.clock import SharedClock

P_PORT, D_PORT = 8100, 8200


@dataclass
class Cluster:
    """P at localhost:8100 and D at localhost:8200, plus a client that reaches both."""

    p: SimState
    d: SimState
    client: httpx.AsyncClient
    clock: SharedClock
    apps: dict[int, Any] = field(default_factory=dict)

    async def post(self, port: int, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return await self.client.post(f"http://localhost:{port}{path}", json=body, **kw)

    async def metrics(self, port: int) -> dict[str, float]:
        text = (await self.client.get(f"http://localhost:{port}/metrics")).text
        return parse_metrics(text)


def openai_error(message: str, kind: str, code: int) -> dict[str, Any]:
    """The ``error`` of an OpenAI-style error body, as vLLM answers it."""
    return {"message": message, "type": kind, "param": None, "code": code}


class _Router(httpx.AsyncBaseTransport):
    def __init__(self, apps: dict[int, Any]) -> None:
        self.apps = apps

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port
        if port not in self.apps:
            raise httpx.ConnectError(f"nothing listens on {port}", request=request)
        transport = httpx.ASGITransport(app=self.apps[port])
        return await transport.handle_async_request(request)


def make_cluster(p: dict[str, Any] | None = None, d: dict[str, Any] | None = None) -> Cluster:
    apps: dict[int, Any] = {}
    clock = SharedClock()
    client = httpx.AsyncClient(transport=_Router(apps), timeout=30)
    states = []
    for port, role, origin, extra in (
        (P_PORT, "prefill", 5_000.0, p),
        (D_PORT, "decode", 90_000.0, d),
    ):
        cfg = SimConfig.model_validate(
            {
                "role": role,
                "port": port,
                "time_scale": 0.0,
                "block_size": 16,
                "num_blocks": 512,
                **(extra or {}),
            }
        )
        app = create_app(
            cfg,
            clock=clock.view(origin),
            transfer=TransferClient(httpx.AsyncClient(transport=_Router(apps))),
            cost=PRESETS["zero"],
        )
        apps[port] = app
        states.append(app.state.sim)
    return Cluster(states[0], states[1], client, clock, apps)
