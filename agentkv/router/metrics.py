"""The router's Prometheus metrics (one registry per app, no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentkv.protocol.families import Family, build
from agentkv.protocol.names import RouterMetric as R

__all__ = ["RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_AGE = (1, 5, 15, 30, 60, 120, 240, 360, 450, 480)


class RouterMetrics:
    """Counters and histograms of one router; ``render()`` is the ``/metrics`` text.

    The families below are made in this instance's own registry, in this order, by ``build``.
    """

    requests = Family(
        Counter, R.REQUESTS, "Requests by endpoint and decision.", ("endpoint", "decision")
    )
    failed = Family(
        Counter, R.FAILED_REQUESTS, "Requests answered with an error, by status.", ("status",)
    )
    reused_tokens = Family(
        Counter,
        R.REUSED_TOKENS,
        "Prompt tokens P reads from D's blocks: M = max(0, min(C, N) - L), estimated where "
        "P's KV events are off.",
    )
    prompt_tokens = Family(
        Counter, R.PROMPT_TOKENS, "Prompt tokens of answered turns (reuse ratio = reused / prompt)."
    )
    local_prefix_tokens = Family(
        Counter,
        R.LOCAL_PREFIX_TOKENS,
        "Prompt tokens P already held in its own prefix cache (L, from its KV events).",
    )
    estimated = Family(
        Counter,
        R.ESTIMATED_TURNS,
        "Turns whose reuse figure is an estimate (L unknown: P's KV events off).",
    )
    trimmed = Family(
        Counter,
        R.TRIMMED_TURNS,
        "Turns that used less than the whole handle, by cause (rewrite or drift).",
        ("cause",),
    )
    abandoned = Family(
        Counter,
        R.ABANDONED_STREAMS,
        "Streams whose client left before the end: drained (D read to the end, its handle "
        "kept) or aborted.",
        ("outcome",),
    )
    store_errors = Family(
        Counter,
        R.STORE_ERRORS,
        "Handle-store calls that failed or were skipped by the open breaker, by operation.",
        ("op",),
    )
    verified_tokens = Family(
        Counter, R.VERIFIED_TOKENS, "Prompt tokens verified against what D holds."
    )
    released = Family(
        Counter,
        R.HANDLES_RELEASED,
        "Handles released early (remote_num_tokens 0), by reason.",
        ("reason",),
    )
    handle_age = Family(
        Histogram, R.HANDLE_AGE_SECONDS, "Age of a handle when a turn takes it.", buckets=_AGE
    )
    upstream_errors = Family(Counter, R.UPSTREAM_ERRORS, "Failed upstream calls.", ("role", "kind"))
    retries = Family(Counter, R.RETRIES, "Upstream retries, by reason.", ("reason",))
    p_seconds = Family(Histogram, R.PREFILL_SECONDS, "P request latency.", buckets=_LATENCY)
    d_first_byte = Family(
        Histogram, R.DECODE_FIRST_BYTE_SECONDS, "D time to first byte.", buckets=_LATENCY
    )
    turn_seconds = Family(
        Histogram,
        R.TURN_SECONDS,
        "Whole turn latency (to D's last byte), by decision.",
        ("decision",),
        buckets=_LATENCY,
    )
    first_byte = Family(
        Histogram,
        R.FIRST_BYTE_SECONDS,
        "From the client's request to D's first byte (P, the KV read and D's first byte: "
        "the router's TTFT), by decision.",
        ("decision",),
        buckets=_LATENCY,
    )
    store_size = Family(Gauge, R.STORE_HANDLES, "Handles held in the store.")
    leases = Family(
        Gauge, R.LEASES, "Leases held (lapsed ones not yet released included), every lease check."
    )
    store_evictions = Family(
        Counter,
        R.STORE_EVICTIONS,
        "Handles evicted (and released) because a bound was reached, by tenant and bound "
        "(tenant: its store.max_entries_per_tenant; store: the memory store's store.max_entries).",
        ("tenant", "bound"),
    )
    healthy = Family(Gauge, R.ENGINE_HEALTHY, "1 when the engine is in rotation.", ("role", "url"))
    restarts = Family(
        Counter,
        R.ENGINE_RESTARTS,
        "Engines seen with a new engine id behind the same URL (restarted), by role.",
        ("role",),
    )
    conversation_sources = Family(
        Counter,
        R.CONVERSATION_SOURCES,
        "Answered turns by the signal that named their conversation (agentkv, session, "
        "claude-code, codex, prompt-cache-key, opencode, dynamo; none: anonymous).",
        ("source",),
    )
    dropped = Family(
        Counter,
        R.HANDLES_DROPPED,
        "Stored handles dropped unread because their D is gone (ejected, or restarted: the "
        "engine behind the URL is no longer the one that issued them), by reason.",
        ("reason",),
    )
    kv_index_in_sync = Family(
        Gauge,
        R.KV_INDEX_IN_SYNC,
        "1 when the index of an engine's KV events is in sync with it (P: its prefix cache, "
        "receipts state L; D: its CPU tier, turns may take the cpu path); 0: unknown.",
        ("url",),
    )
    identity = Family(
        Counter,
        R.IDENTITY_TURNS,
        "Chat turns by token identity: kept (previous prompt + generated ids + new messages), "
        "kept-prefix (a changed history's recorded ids up to its last unchanged answer), "
        "or the reason the client's messages were rendered.",
        ("outcome",),
    )

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        build(self, self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
