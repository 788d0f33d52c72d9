"""What a turn really did: the client's receipt headers, and the same figures in the metrics,
the span and the log (one place, so headers and metrics never disagree)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from agentkv.protocol import (
    HEADER_DECISION,
    HEADER_DECODE_CACHED_TOKENS,
    HEADER_ESTIMATED,
    HEADER_IDENTITY,
    HEADER_LOCAL_PREFIX_TOKENS,
    HEADER_PATH_ESTIMATE_MS,
    HEADER_REUSED_TOKENS,
    HEADER_RUNNER_UP,
    HEADER_RUNNER_UP_ESTIMATE_MS,
    HEADER_SIM_CACHED_TOKENS,
    HEADER_SIM_CPU_TOKENS,
    HEADER_SIM_MODEL_TTFT_MS,
    HEADER_SIM_WRONG_KV_TOKENS,
    HEADER_TRIM_CAUSE,
    HEADER_VERIFIED_PREFIX_TOKENS,
)
from agentkv.router.logs import safe
from agentkv.router.metrics import RouterMetrics
from agentkv.router.request import ClientRequest

__all__ = ["ON_D", "Receipt", "account", "decode_found", "sim_receipt"]

ON_D = frozenset({"decode", "cpu"})
"""The decisions of a turn sent straight to D, no P (docs/paths.md): D's own GPU prefix cache
(``decode``) or its CPU tier (``cpu``)."""

log = logging.getLogger("agentkv.router")


@dataclass(frozen=True)
class Receipt:
    """What the turn really did, for the client's headers and the metrics."""

    decision: str
    reused: int
    """M: tokens P reads from D."""
    verified: int
    """C."""
    local: int | None
    """L (None: unknown, P's KV events are off)."""
    cause: str | None
    identity: str | None = None
    """``kept``, ``kept-prefix`` or ``rendered:<reason>`` (chat turns;
    :mod:`agentkv.router.identity`)."""
    estimate_s: float | None = None
    """The cost model's TTFT estimate of the path taken (None: it did not choose this one)."""
    runner_up: str | None = None
    """The path it ranked next, and that path's estimate."""
    runner_up_s: float | None = None
    found: int | None = None
    """Straight to D (``decode``, ``cpu``): the prompt tokens D found cached, its GPU prefix
    cache and CPU tier together, as D reported them (None: not said yet)."""

    def headers(self) -> dict[str, str]:
        out = {
            HEADER_DECISION: self.decision,
            HEADER_REUSED_TOKENS: str(self.reused),
            HEADER_VERIFIED_PREFIX_TOKENS: str(self.verified),
        }
        if self.decision in ON_D:
            pass  # straight to D: no P, so no L
        elif self.local is None:
            out[HEADER_ESTIMATED] = "1"
        else:
            out[HEADER_LOCAL_PREFIX_TOKENS] = str(self.local)
        if self.estimate_s is not None:
            out[HEADER_PATH_ESTIMATE_MS] = f"{self.estimate_s * 1000:.1f}"
        if self.runner_up is not None and self.runner_up_s is not None:
            out[HEADER_RUNNER_UP] = self.runner_up
            out[HEADER_RUNNER_UP_ESTIMATE_MS] = f"{self.runner_up_s * 1000:.1f}"
        if self.found is not None:
            out[HEADER_DECODE_CACHED_TOKENS] = str(self.found)
        if self.cause:
            out[HEADER_TRIM_CAUSE] = self.cause
        if self.identity:
            out[HEADER_IDENTITY] = self.identity
        return out


def sim_receipt(prefill: Mapping[str, str], decode: Mapping[str, str]) -> dict[str, str]:
    """The turn's simulator receipt from P's and D's (absent with real vLLM): the modelled TTFT
    is P's plus D's, the wrong-KV tokens the larger count (D's wrong tokens are those it pulled
    from a P that read wrong KV, plus its own poisoned prefix cache)."""
    out: dict[str, str] = {}
    ttft = [
        float(h[HEADER_SIM_MODEL_TTFT_MS])
        for h in (prefill, decode)
        if HEADER_SIM_MODEL_TTFT_MS in h
    ]
    if ttft:
        out[HEADER_SIM_MODEL_TTFT_MS] = f"{sum(ttft):.3f}"
    wrong = [
        int(h[HEADER_SIM_WRONG_KV_TOKENS])
        for h in (prefill, decode)
        if HEADER_SIM_WRONG_KV_TOKENS in h
    ]
    if wrong:
        out[HEADER_SIM_WRONG_KV_TOKENS] = str(max(wrong))
    return out


def decode_found(headers: Mapping[str, str], body: Any = None) -> int | None:
    """What D says it found cached of a direct request's prompt: the simulator's headers (GPU
    prefix hit + CPU tier), else a whole answer's ``usage.prompt_tokens_details.cached_tokens``
    (vLLM: D's own prefix-cache hit); None when D has not said."""
    if HEADER_SIM_CACHED_TOKENS in headers:
        try:
            return int(headers[HEADER_SIM_CACHED_TOKENS]) + int(
                headers.get(HEADER_SIM_CPU_TOKENS, 0)
            )
        except ValueError:
            return None
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def account(
    metrics: RouterMetrics,
    req: ClientRequest,
    prompt_tokens: int,
    r: Receipt,
    prefill_url: str | None,
    decode_url: str,
    span: trace.Span,
    started: float,
) -> None:
    """A turn's receipt into the metrics, the span and the log."""
    metrics.requests.labels("chat" if req.chat else "completions", r.decision).inc()
    metrics.reused_tokens.inc(r.reused)
    metrics.verified_tokens.inc(r.verified)
    metrics.prompt_tokens.inc(prompt_tokens)
    if r.local is not None:
        metrics.local_prefix_tokens.inc(r.local)
    elif r.decision not in ON_D:  # straight to D: no P, no L to estimate
        metrics.estimated.inc()
    if r.cause:
        metrics.trimmed.labels(r.cause).inc()
    if r.identity:
        metrics.identity.labels(r.identity.removeprefix("rendered:")).inc()
    metrics.conversation_sources.labels(req.conversation_source).inc()
    span.set_attributes(
        {
            "agentkv.decision": r.decision,
            "agentkv.conversation.source": req.conversation_source,
            "agentkv.reused_tokens": r.reused,
            "agentkv.verified_prefix_tokens": r.verified,
            "agentkv.local_prefix_tokens": -1 if r.local is None else r.local,
            "agentkv.identity": r.identity or "",
            "agentkv.prompt_tokens": prompt_tokens,
            "agentkv.prefill.url": prefill_url or "",
            "agentkv.decode.url": decode_url,
            "agentkv.path.estimate_ms": -1.0 if r.estimate_s is None else r.estimate_s * 1000,
            "agentkv.path.runner_up": r.runner_up or "",
            "agentkv.path.runner_up_estimate_ms": (
                -1.0 if r.runner_up_s is None else r.runner_up_s * 1000
            ),
            "agentkv.decode.cached_tokens": -1 if r.found is None else r.found,
        }
    )
    log.info(
        "turn conversation=%s source=%s tenant=%s epoch=%d decision=%s reused=%d verified=%d "
        "local=%s prompt_tokens=%d prefill=%s decode=%s runner_up=%s found=%s ms=%.1f",
        safe(req.conversation_id),
        req.conversation_source,
        safe(req.tenant),
        req.epoch,
        r.decision,
        r.reused,
        r.verified,
        "?" if r.local is None else r.local,
        prompt_tokens,
        prefill_url or "-",
        decode_url,
        r.runner_up or "-",
        "?" if r.found is None else r.found,
        (time.perf_counter() - started) * 1000,
        extra={
            "conversation_id": safe(req.conversation_id or ""),
            "conversation_source": req.conversation_source,
            "tenant": safe(req.tenant),
            "epoch": req.epoch,
            "decision": r.decision,
            "reused": r.reused,
            "verified": r.verified,
            "local": r.local,
            "prompt_tokens": prompt_tokens,
            "runner_up": r.runner_up,
            "decode_cached_tokens": r.found,
        },
    )
