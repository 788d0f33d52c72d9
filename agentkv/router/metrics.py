"""The router's Prometheus metrics (one registry per app, no globals)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
            "agentkv_router_requests",
            "Requests by endpoint and decision.",
            ("endpoint", "decision"),
        )
        self.failed = counter(
            "agentkv_router_failed_requests",
            "Requests answered with an error, by status.",
            ("status",),
        )
        self.reused_tokens = counter(
            "agentkv_router_reused_tokens",
            "Prompt tokens P reads from D's blocks: M = max(0, min(C, N) - L), estimated where "
            "P's KV events are off.",
        )
        self.prompt_tokens = counter(
            "agentkv_router_prompt_tokens",
            "Prompt tokens of answered turns (reuse ratio = reused / prompt).",
        )
        self.local_prefix_tokens = counter(
            "agentkv_router_local_prefix_tokens",
            "Prompt tokens P already held in its own prefix cache (L, from its KV events).",
        )
        self.estimated = counter(
            "agentkv_router_estimated_turns",
            "Turns whose reuse figure is an estimate (L unknown: P's KV events off).",
        )
        self.trimmed = counter(
            "agentkv_router_trimmed_turns",
            "Turns that used less than the whole handle, by cause (rewrite or drift).",
            ("cause",),
        )
        self.abandoned = counter(
            "agentkv_router_abandoned_streams",
            "Streams whose client left before the end: drained (D read to the end, its handle "
            "kept) or aborted.",
            ("outcome",),
        )
        self.store_errors = counter(
            "agentkv_router_store_errors",
            "Handle-store calls that failed or were skipped by the open breaker, by operation.",
            ("op",),
        )
        self.verified_tokens = counter(
            "agentkv_router_verified_tokens", "Prompt tokens verified against what D holds."
        )
        self.released = counter(
            "agentkv_router_handles_released",
            "Handles released early (remote_num_tokens 0), by reason.",
            ("reason",),
        )
        self.handle_age = histogram(
            "agentkv_router_handle_age_seconds",
            "Age of a handle when a turn takes it.",
            buckets=(1, 5, 15, 30, 60, 120, 240, 360, 450, 480),
        )
        self.upstream_errors = counter(
            "agentkv_router_upstream_errors", "Failed upstream calls.", ("role", "kind")
        )
        self.retries = counter(
            "agentkv_router_retries", "Upstream retries, by reason.", ("reason",)
        )
        self.p_seconds = histogram("agentkv_router_prefill_seconds", "P request latency.")
        self.d_first_byte = histogram(
            "agentkv_router_decode_first_byte_seconds", "D time to first byte."
        )
        self.turn_seconds = histogram(
            "agentkv_router_turn_seconds",
            "Whole turn latency (to D's last byte), by decision.",
            ("decision",),
        )
        self.first_byte = histogram(
            "agentkv_router_first_byte_seconds",
            "From the client's request to D's first byte (P, the KV read and D's first byte: "
            "the router's TTFT), by decision.",
            ("decision",),
        )
        self.store_size = Gauge(
            "agentkv_router_store_handles", "Handles held in the store.", registry=r
        )
        self.healthy = Gauge(
            "agentkv_router_engine_healthy",
            "1 when the engine is in rotation.",
            ("role", "url"),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
