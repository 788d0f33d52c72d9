"""What every route of one simulated instance shares: :class:`SimState` (``app.state.sim``),
the request body as JSON (size-capped) and vLLM's ``model`` check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from agentkv.protocol.errors import APIError
from agentkv.protocol.http import json_object
from agentkv.sim.config import SimConfig
from agentkv.sim.engine import Engine
from agentkv.sim.faults import Faults
from agentkv.sim.metrics import SimMetrics
from agentkv.sim.serving import SimRenderer

__all__ = ["MAX_BODY_BYTES", "Handler", "SimState", "check_model", "json_body"]

MAX_BODY_BYTES = 64 * 1024 * 1024


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


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, "Request body too large.")
    try:
        return json_object(raw)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


Handler = Any


def check_model(state: SimState, body: dict[str, Any]) -> None:
    """vLLM's ``_check_model``: an empty or absent ``model`` means the served one."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "`model` must be a string.", param="model")
    name = state.config.served_model_name
    if model and model != name:
        raise APIError(
            404, f"The model `{model}` does not exist. Valid aliases: {name}.", param="model"
        )
