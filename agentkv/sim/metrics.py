"""Prometheus metrics under vLLM 0.33's names (one registry per instance, no globals)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentkv.protocol import Metric

__all__ = ["SimMetrics"]

_LABELS = ("model_name", "engine")
_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class SimMetrics:
    """All metrics of one simulated instance; ``render()`` gives the ``/metrics`` text."""

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = (model_name, engine)
        r = self.registry

        # one series each, labelled (model_name, engine): the instance's child
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=r).labels(*labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=r).labels(*labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=r).labels(*labels)

        self.prefix_cache_queries = counter(
            Metric.PREFIX_CACHE_QUERIES, "Prefix cache queries (tokens)."
        )
        self.prefix_cache_hits = counter(Metric.PREFIX_CACHE_HITS, "Prefix cache hits (tokens).")
        self.external_queries = counter(
            Metric.EXTERNAL_PREFIX_CACHE_QUERIES,
            "External (connector) prefix cache queries (tokens).",
        )
        self.external_hits = counter(
            Metric.EXTERNAL_PREFIX_CACHE_HITS, "External (connector) prefix cache hits (tokens)."
        )
        self.prompt_tokens = counter(Metric.PROMPT_TOKENS, "Prompt tokens processed.")
        self.generation_tokens = counter(Metric.GENERATION_TOKENS, "Generation tokens produced.")
        self.prompt_tokens_cached = counter(
            Metric.PROMPT_TOKENS_CACHED, "Prompt tokens not computed (local or external cache)."
        )
        by_source = Counter(
            Metric.PROMPT_TOKENS_BY_SOURCE,
            "Prompt tokens by source.",
            (*_LABELS, "source"),
            registry=r,
        )
        self.by_source = {s: by_source.labels(*labels, s) for s in _SOURCES}
        cached_by_source = Counter(
            Metric.PROMPT_TOKENS_CACHED_BY_SOURCE,
            "Cached prompt tokens by source.",
            (*_LABELS, "source"),
            registry=r,
        )
        self.cached_device = cached_by_source.labels(*labels, "device")
        self.cached_p2p = cached_by_source.labels(*labels, "p2p")
        self.prefill_kv_computed = histogram(
            Metric.REQUEST_PREFILL_KV_COMPUTED_TOKENS,
            "Prompt tokens computed per request.",
            (1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
        )
        self.kv_usage = gauge(Metric.KV_CACHE_USAGE_PERC, "KV cache usage (0-1).")
        self.running = gauge(Metric.NUM_REQUESTS_RUNNING, "Requests running.")
        self.waiting = gauge(
            Metric.NUM_REQUESTS_WAITING, "Requests waiting (for blocks or remote KV)."
        )
        success = Counter(
            Metric.REQUEST_SUCCESS, "Finished requests.", (*_LABELS, "finished_reason"), registry=r
        )
        self.success = {
            reason: success.labels(*labels, reason)
            for reason in ("stop", "length", "abort", "error")
        }
        self.ttft = histogram(
            Metric.TIME_TO_FIRST_TOKEN_SECONDS,
            "Time to first token (simulated, scaled).",
            (
                0.001,
                0.005,
                0.01,
                0.02,
                0.04,
                0.06,
                0.08,
                0.1,
                0.25,
                0.5,
                0.75,
                1,
                2.5,
                5,
                7.5,
                10,
                20,
                40,
                80,
            ),
        )
        self.nixl_xfer_time = histogram(
            Metric.NIXL_XFER_TIME_SECONDS,
            "NIXL read time.",
            (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.nixl_post_time = histogram(
            Metric.NIXL_POST_TIME_SECONDS, "NIXL post time.", (0.0001, 0.001, 0.01, 0.1, 1)
        )
        self.nixl_bytes = histogram(
            Metric.NIXL_BYTES_TRANSFERRED,
            "Bytes read per transfer.",
            (2**10, 2**14, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30),
        )
        self.nixl_descriptors = histogram(
            Metric.NIXL_NUM_DESCRIPTORS,
            "Descriptors per transfer.",
            (1, 4, 16, 64, 256, 1024, 4096, 16384),
        )
        self.nixl_failed_transfers = counter(
            Metric.NIXL_NUM_FAILED_TRANSFERS, "Failed NIXL transfers."
        )
        self.nixl_failed_notifications = counter(
            Metric.NIXL_NUM_FAILED_NOTIFICATIONS, "Failed NIXL notifications."
        )
        self.nixl_expired = counter(
            Metric.NIXL_NUM_KV_EXPIRED_REQS,
            "Requests whose KV expired (lease/TTL reaped or expired read declined).",
        )
        self.nixl_notif_after_expiry = counter(
            Metric.NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY,
            "Notifications for unknown (freed or expired) requests.",
        )
        self.wrong_kv_tokens = counter(
            Metric.SIM_WRONG_KV_TOKENS,
            "Prompt tokens that ran on KV computed for other tokens or positions.",
        )
        self.wrong_kv_requests = counter(
            Metric.SIM_WRONG_KV_REQUESTS, "Requests that ran on wrong KV."
        )
        self.retained_blocks = gauge(
            Metric.SIM_RETAINED_BLOCKS,
            "Blocks held for a future reader (D: next turn; P: D's read).",
        )
        self.retained_requests = gauge(
            Metric.SIM_RETAINED_REQUESTS, "Finished requests whose blocks are held for a reader."
        )
        self.retained_block_seconds = counter(
            Metric.SIM_RETAINED_BLOCK_SECONDS, "Blocks held for a future turn x seconds held (D)."
        )
        self.blocks_used = gauge(Metric.SIM_KV_BLOCKS_USED, "KV blocks referenced.")
        self.blocks_total = gauge(Metric.SIM_KV_BLOCKS_TOTAL, "Usable KV blocks.")

    def render(self) -> bytes:
        return generate_latest(self.registry)
