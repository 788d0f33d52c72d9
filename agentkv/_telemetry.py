"""OpenTelemetry: one span per turn, with ``gen_ai.*`` and ``agentkv.*`` attributes.

Only ``opentelemetry-api`` is used: without a configured SDK every call is a no-op.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from agentkv.__version__ import __version__
from agentkv._receipt import TurnReceipt

__all__ = ["TurnSpan", "start_turn_span"]

_tracer = trace.get_tracer("agentkv", __version__)


class TurnSpan:
    """The span of one turn; :meth:`record` adds the receipt's figures and ends it."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.ended = False

    def fail(self, exc: BaseException) -> None:
        if not self.ended:
            self.span.record_exception(exc)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            self.span.set_attribute("error.type", type(exc).__name__)
            self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.span.end()

    def record(self, receipt: TurnReceipt) -> None:
        attrs: dict[str, Any] = {
            "gen_ai.usage.input_tokens": receipt.prompt_tokens,
            "gen_ai.usage.output_tokens": receipt.completion_tokens,
            "agentkv.turn": receipt.turn,
            "agentkv.epoch": receipt.epoch,
            "agentkv.mode": receipt.mode,
        }
        if receipt.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [receipt.finish_reason]
        if receipt.request_id:
            attrs["gen_ai.response.id"] = receipt.request_id
        if receipt.cached_tokens is not None:
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
        if not self.ended:
            self.span.set_attributes(attrs)
            self.end()


def start_turn_span(ledger: Any) -> TurnSpan:
    """A ``chat {model}`` client span for one turn of ``ledger`` (ended by ``record``, ``fail``
    or ``end``; a streamed turn ends when its stream does)."""
    attrs = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.conversation.id": ledger.id,
        "agentkv.turn": ledger.turns + 1,
        "agentkv.epoch": ledger.epoch,
    }
    if ledger.model:
        attrs["gen_ai.request.model"] = ledger.model
    name = f"chat {ledger.model}" if ledger.model else "chat"
    return TurnSpan(_tracer.start_span(name, kind=trace.SpanKind.CLIENT, attributes=attrs))
