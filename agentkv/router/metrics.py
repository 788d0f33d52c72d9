"""The router's Prometheus metrics (one registry per app, no globals)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentkv.protocol.names import RouterMetric

__all__ = ["RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """Counters and histograms of one router; ``render()`` is the ``/metrics`` text."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(
            name: str, doc: str, labels: Sequence[str] = (), *, buckets: Sequence[float] = _LATENCY
        ) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.requests = counter(
            RouterMetric.REQUESTS,
            "Requests by endpoint and decision.",
            ("endpoint", "decision"),
        )
        self.failed = counter(
            RouterMetric.FAILED_REQUESTS,
            "Requests answered with an error, by status.",
            ("status",),
        )
        self.reused_tokens = counter(
            RouterMetric.REUSED_TOKENS,
            "Prompt tokens P reads from D's blocks: M = max(0, min(C, N) - L), estimated where "
            "P's KV events are off.",
        )
        self.prompt_tokens = counter(
            RouterMetric.PROMPT_TOKENS,
            "Prompt tokens of answered turns (reuse ratio = reused / prompt).",
        )
        self.local_prefix_tokens = counter(
            RouterMetric.LOCAL_PREFIX_TOKENS,
            "Prompt tokens P already held in its own prefix cache (L, from its KV events).",
        )
        self.estimated = counter(
            RouterMetric.ESTIMATED_TURNS,
            "Turns whose reuse figure is an estimate (L unknown: P's KV events off).",
        )
        self.trimmed = counter(
            RouterMetric.TRIMMED_TURNS,
            "Turns that used less than the whole handle, by cause (rewrite or drift).",
            ("cause",),
        )
        self.abandoned = counter(
            RouterMetric.ABANDONED_STREAMS,
            "Streams whose client left before the end: drained (D read to the end, its handle "
            "kept) or aborted.",
            ("outcome",),
        )
        self.store_errors = counter(
            RouterMetric.STORE_ERRORS,
            "Handle-store calls that failed or were skipped by the open breaker, by operation.",
            ("op",),
        )
        self.verified_tokens = counter(
            RouterMetric.VERIFIED_TOKENS, "Prompt tokens verified against what D holds."
        )
        self.released = counter(
            RouterMetric.HANDLES_RELEASED,
            "Handles released early (remote_num_tokens 0), by reason.",
            ("reason",),
        )
        self.handle_age = histogram(
            RouterMetric.HANDLE_AGE_SECONDS,
            "Age of a handle when a turn takes it.",
            buckets=(1, 5, 15, 30, 60, 120, 240, 360, 450, 480),
        )
        self.upstream_errors = counter(
            RouterMetric.UPSTREAM_ERRORS, "Failed upstream calls.", ("role", "kind")
        )
        self.retries = counter(RouterMetric.RETRIES, "Upstream retries, by reason.", ("reason",))
        self.p_seconds = histogram(RouterMetric.PREFILL_SECONDS, "P request latency.")
        self.d_first_byte = histogram(
            RouterMetric.DECODE_FIRST_BYTE_SECONDS, "D time to first byte."
        )
        self.turn_seconds = histogram(
            RouterMetric.TURN_SECONDS,
            "Whole turn latency (to D's last byte), by decision.",
            ("decision",),
        )
        self.first_byte = histogram(
            RouterMetric.FIRST_BYTE_SECONDS,
            "From the client's request to D's first byte (P, the KV read and D's first byte: "
            "the router's TTFT), by decision.",
            ("decision",),
        )
        self.store_size = Gauge(
            RouterMetric.STORE_HANDLES, "Handles held in the store.", registry=r
        )
        self.healthy = Gauge(
            RouterMetric.ENGINE_HEALTHY,
            "1 when the engine is in rotation.",
            ("role", "url"),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
