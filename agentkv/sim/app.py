"""The simulator's ASGI app: ``create_app(config)`` serves one vLLM-like instance.

Routes (vLLM 0.33's OpenAI server; generation in :mod:`agentkv.sim.generation_routes`, the rest
in :mod:`agentkv.sim.server_routes`): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (:mod:`agentkv.sim.messages`),
``POST /v1/responses`` (stateless: mapped onto the chat path as vLLM maps it, without a response
store, so a ``previous_response_id`` is not found, as on vLLM without
``VLLM_ENABLE_RESPONSES_API_STORE``), ``POST /tokenize``, ``POST /detokenize``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``,
``POST /reset_prefix_cache``, ``GET /kv_event_sources``. Internal (simulator only,
:mod:`agentkv.sim.internal_routes`): the NIXL stand-in under ``/_sim/nixl/``
(:mod:`agentkv.sim.transfer`), ``GET|POST /_sim/faults`` (:mod:`agentkv.sim.faults`) and
``GET /_sim/state``. What the routes share (:class:`~agentkv.sim.state.SimState`, the body
check): :mod:`agentkv.sim.state`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette

from agentkv.chat.template import ChatTemplate, load_template
from agentkv.chat.tokenizer import ChatTokenizer, load_tokenizer
from agentkv.sim import generation_routes, internal_routes, server_routes
from agentkv.sim.clock import Clock
from agentkv.sim.config import SimConfig
from agentkv.sim.costmodel import PRESETS, CostModel, load_cost_file
from agentkv.sim.engine import Engine
from agentkv.sim.errors import error_handling
from agentkv.sim.faults import Faults
from agentkv.sim.metrics import SimMetrics
from agentkv.sim.serving import SimRenderer
from agentkv.sim.state import SimState
from agentkv.sim.transfer import TransferClient

__all__ = ["create_app"]


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
        *generation_routes.routes(state),
        *server_routes.routes(state),
        *internal_routes.routes(state),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, **error_handling())
    app.state.sim = state
    return app
