"""The router's Prometheus metrics (one registry per app, no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """Counters and histograms of one router; ``render()`` is the ``/metrics`` text."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "agentkv_router_requests",
            "Requests by endpoint and decision.",
            ("endpoint", "decision"),
            registry=r,
        )
        self.failed = Counter(
            "agentkv_router_failed_requests",
            "Requests answered with an error, by status.",
            ("status",),
            registry=r,
        )
        self.reused_tokens = Counter(
            "agentkv_router_reused_tokens",
            "Prompt tokens P reads from D's blocks: M = max(0, min(C, N) - L), estimated where "
            "P's KV events are off.",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "agentkv_router_prompt_tokens",
            "Prompt tokens of answered turns (reuse ratio = reused / prompt).",
            registry=r,
        )
        self.local_prefix_tokens = Counter(
            "agentkv_router_local_prefix_tokens",
            "Prompt tokens P already held in its own prefix cache (L, from its KV events).",
            registry=r,
        )
        self.estimated = Counter(
            "agentkv_router_estimated_turns",
            "Turns whose reuse figure is an estimate (L unknown: P's KV events off).",
            registry=r,
        )
        self.trimmed = Counter(
            "agentkv_router_trimmed_turns",
            "Turns that used less than the whole handle, by cause (rewrite or drift).",
            ("cause",),
            registry=r,
        )
        self.abandoned = Counter(
            "agentkv_router_abandoned_streams",
            "Streams whose client left before the end: drained (D read to the end, its handle "
            "kept) or aborted.",
            ("outcome",),
            registry=r,
        )
        self.store_errors = Counter(
            "agentkv_router_store_errors",
            "Handle-store calls that failed or were skipped by the open breaker, by operation.",
            ("op",),
            registry=r,
        )
        self.verified_tokens = Counter(
            "agentkv_router_verified_tokens",
            "Prompt tokens verified against what D holds.",
            registry=r,
        )
        self.released = Counter(
            "agentkv_router_handles_released",
            "Handles released early (remote_num_tokens 0), by reason.",
            ("reason",),
            registry=r,
        )
        self.handle_age = Histogram(
            "agentkv_router_handle_age_seconds",
            "Age of a handle when a turn takes it.",
            buckets=(1, 5, 15, 30, 60, 120, 240, 360, 450, 480),
            registry=r,
        )
        self.upstream_errors = Counter(
            "agentkv_router_upstream_errors", "Failed upstream calls.", ("role", "kind"), registry=r
        )
        self.retries = Counter(
            "agentkv_router_retries", "Upstream retries, by reason.", ("reason",), registry=r
        )
        self.p_seconds = Histogram(
            "agentkv_router_prefill_seconds", "P request latency.", buckets=_LATENCY, registry=r
        )
        self.d_first_byte = Histogram(
            "agentkv_router_decode_first_byte_seconds",
            "D time to first byte.",
            buckets=_LATENCY,
            registry=r,
        )
        self.turn_seconds = Histogram(
            "agentkv_router_turn_seconds",
            "Whole turn latency (to D's last byte), by decision.",
            ("decision",),
            buckets=_LATENCY,
            registry=r,
        )
        self.first_byte = Histogram(
            "agentkv_router_first_byte_seconds",
            "From the client's request to D's first byte (P, the KV read and D's first byte: "
            "the router's TTFT), by decision.",
            ("decision",),
            buckets=_LATENCY,
            registry=r,
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
