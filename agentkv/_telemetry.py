"""OpenTelemetry: one span per turn, with ``gen_ai.*`` and ``agentkv.*`` attributes, its W3C
trace context on the request, and the GenAI client metrics.

Only ``opentelemetry-api`` is used: without a configured SDK every call is a no-op. Names follow
the OpenTelemetry GenAI semantic conventions (spans: ``chat {model}``, kind CLIENT; metrics:
``gen_ai.client.token.usage`` in ``{token}`` and ``gen_ai.client.operation.duration`` in ``s``,
with the bucket boundaries the conventions recommend).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import metrics, propagate, trace

from agentkv.__version__ import __version__
from agentkv._receipt import TurnReceipt

__all__ = ["TurnSpan", "start_turn_span"]

_tracer = trace.get_tracer("agentkv", __version__)
_meter = metrics.get_meter("agentkv", __version__)

# Explicit bucket boundaries of the GenAI semantic conventions.
_TOKEN_BUCKETS = [4.0**i for i in range(14)]
"""1, 4, 16, …, 67108864."""
_DURATION_BUCKETS = [0.01 * 2**i for i in range(14)]
"""0.01, 0.02, 0.04, …, 81.92."""

_token_usage = _meter.create_histogram(
    "gen_ai.client.token.usage",
    unit="{token}",
    description="Number of input and output tokens used.",
    explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
)
_duration = _meter.create_histogram(
    "gen_ai.client.operation.duration",
    unit="s",
    description="GenAI operation duration.",
    explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
)

_PROVIDER = "vllm"
"""``gen_ai.provider.name``: vLLM is not among the well-known values, so its own name."""


def server_attributes(base_url: Any) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of an OpenAI base URL."""
    parts = urlsplit(str(base_url))
    if not parts.hostname:
        return {}
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return {"server.address": parts.hostname, "server.port": port}


class TurnSpan:
    """The span of one turn; :meth:`record` adds the receipt's figures and ends it."""

    def __init__(self, span: trace.Span, attributes: Mapping[str, Any]) -> None:
        self.span = span
        self.ended = False
        self.started = time.perf_counter()
        self._metric_attrs: dict[str, Any] = {
            k: attributes[k]
            for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model")
            if k in attributes
        }

    def request(self, request: Mapping[str, Any], base_url: Any) -> None:
        """The request's ``gen_ai.request.*`` and ``server.*`` attributes; injects this span's
        W3C trace context (``traceparent``, ``tracestate``) into the request's headers."""
        attrs: dict[str, Any] = {"gen_ai.request.stream": bool(request.get("stream"))}
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
        if isinstance(max_tokens, int):
            attrs["gen_ai.request.max_tokens"] = max_tokens
        for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed"):
            value = request.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attrs[f"gen_ai.request.{key}"] = value
        stop = request.get("stop")
        if isinstance(stop, str):
            attrs["gen_ai.request.stop_sequences"] = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            attrs["gen_ai.request.stop_sequences"] = stop
        server = server_attributes(base_url)
        attrs.update(server)
        self._metric_attrs.update(server)
        self.span.set_attributes(attrs)
        headers = request.get("extra_headers")
        if isinstance(headers, MutableMapping):
            propagate.inject(headers, context=trace.set_span_in_context(self.span))

    def fail(self, exc: BaseException) -> None:
        if not self.ended:
            self.span.record_exception(exc)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            self.span.set_attribute("error.type", type(exc).__name__)
            self._duration({"error.type": type(exc).__name__})
            self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.span.end()

    def _duration(self, extra: Mapping[str, Any]) -> None:
        _duration.record(time.perf_counter() - self.started, {**self._metric_attrs, **extra})

    def record(self, receipt: TurnReceipt, response_model: str | None = None) -> None:
        attrs: dict[str, Any] = {
            "gen_ai.usage.input_tokens": receipt.prompt_tokens,
            "gen_ai.usage.output_tokens": receipt.completion_tokens,
            "agentkv.turn": receipt.turn,
            "agentkv.epoch": receipt.epoch,
            "agentkv.mode": receipt.mode,
        }
        if response_model:
            attrs["gen_ai.response.model"] = response_model
        if receipt.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [receipt.finish_reason]
        if receipt.request_id:
            attrs["gen_ai.response.id"] = receipt.request_id
        if receipt.cached_tokens is not None:
            attrs["gen_ai.usage.cache_read.input_tokens"] = receipt.cached_tokens
            attrs["agentkv.cached_tokens"] = receipt.cached_tokens
        if receipt.decision is not None:
            attrs["agentkv.decision"] = receipt.decision
        if receipt.reused_tokens is not None:
            attrs["agentkv.reused_tokens"] = receipt.reused_tokens
        if receipt.verified_prefix_tokens is not None:
            attrs["agentkv.verified_prefix_tokens"] = receipt.verified_prefix_tokens
        if receipt.drift is not None:
            attrs["agentkv.drift.hazard"] = receipt.drift.hazard
            attrs["agentkv.drift.lost_tokens"] = receipt.drift.lost_tokens
        if receipt.rewrite is not None:
            attrs["agentkv.rewrite.reason"] = receipt.rewrite.reason
        if receipt.ttft_s is not None:
            attrs["agentkv.ttft_s"] = receipt.ttft_s
        if self.ended:
            return
        self.span.set_attributes(attrs)
        metric_attrs = dict(self._metric_attrs)
        if response_model:
            metric_attrs["gen_ai.response.model"] = response_model
        _token_usage.record(receipt.prompt_tokens, {**metric_attrs, "gen_ai.token.type": "input"})
        _token_usage.record(
            receipt.completion_tokens, {**metric_attrs, "gen_ai.token.type": "output"}
        )
        self._metric_attrs = metric_attrs
        self._duration({})
        self.end()


def start_turn_span(ledger: Any) -> TurnSpan:
    """A ``chat {model}`` client span for one turn of ``ledger`` (ended by ``record``, ``fail``
    or ``end``; a streamed turn ends when its stream does)."""
    attrs = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": _PROVIDER,
        "gen_ai.conversation.id": ledger.id,
        "agentkv.turn": ledger.turns + 1,
        "agentkv.epoch": ledger.epoch,
    }
    if ledger.model:
        attrs["gen_ai.request.model"] = ledger.model
    name = f"chat {ledger.model}" if ledger.model else "chat"
    span = _tracer.start_span(name, kind=trace.SpanKind.CLIENT, attributes=attrs)
    return TurnSpan(span, attrs)
