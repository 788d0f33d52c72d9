"""Prometheus metrics under vLLM 0.33's names (one registry per instance, no globals)."""

from __future__ import annotations

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

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=r)

        self.prefix_cache_queries = counter(
            Metric.PREFIX_CACHE_QUERIES, "Prefix cache queries (tokens)."
        ).labels(*labels)
        self.prefix_cache_hits = counter(
            Metric.PREFIX_CACHE_HITS, "Prefix cache hits (tokens)."
        ).labels(*labels)
        self.external_queries = counter(
            Metric.EXTERNAL_PREFIX_CACHE_QUERIES,
            "External (connector) prefix cache queries (tokens).",
        ).labels(*labels)
        self.external_hits = counter(
            Metric.EXTERNAL_PREFIX_CACHE_HITS, "External (connector) prefix cache hits (tokens)."
        ).labels(*labels)
        self.prompt_tokens = counter(Metric.PROMPT_TOKENS, "Prompt tokens processed.").labels(
            *labels
        )
        self.generation_tokens = counter(
            Metric.GENERATION_TOKENS, "Generation tokens produced."
        ).labels(*labels)
        self.prompt_tokens_cached = counter(
            Metric.PROMPT_TOKENS_CACHED, "Prompt tokens not computed (local or external cache)."
        ).labels(*labels)
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
        self.prefill_kv_computed = Histogram(
            Metric.REQUEST_PREFILL_KV_COMPUTED_TOKENS,
            "Prompt tokens computed per request.",
            _LABELS,
            buckets=(1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
            registry=r,
        ).labels(*labels)
        self.kv_usage = gauge(Metric.KV_CACHE_USAGE_PERC, "KV cache usage (0-1).").labels(*labels)
        self.running = gauge(Metric.NUM_REQUESTS_RUNNING, "Requests running.").labels(*labels)
        self.waiting = gauge(
            Metric.NUM_REQUESTS_WAITING, "Requests waiting (for blocks or remote KV)."
        ).labels(*labels)
        success = Counter(
            Metric.REQUEST_SUCCESS, "Finished requests.", (*_LABELS, "finished_reason"), registry=r
        )
        self.success = {
            reason: success.labels(*labels, reason)
            for reason in ("stop", "length", "abort", "error")
        }
        self.ttft = Histogram(
            Metric.TIME_TO_FIRST_TOKEN_SECONDS,
            "Time to first token (simulated, scaled).",
            _LABELS,
            buckets=(
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
            registry=r,
        ).labels(*labels)
        self.nixl_xfer_time = Histogram(
            Metric.NIXL_XFER_TIME_SECONDS,
            "NIXL read time.",
            _LABELS,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        ).labels(*labels)
        self.nixl_post_time = Histogram(
            Metric.NIXL_POST_TIME_SECONDS,
            "NIXL post time.",
            _LABELS,
            buckets=(0.0001, 0.001, 0.01, 0.1, 1),
            registry=r,
        ).labels(*labels)
        self.nixl_bytes = Histogram(
            Metric.NIXL_BYTES_TRANSFERRED,
            "Bytes read per transfer.",
            _LABELS,
            buckets=(2**10, 2**14, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30),
            registry=r,
        ).labels(*labels)
        self.nixl_descriptors = Histogram(
            Metric.NIXL_NUM_DESCRIPTORS,
            "Descriptors per transfer.",
            _LABELS,
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384),
            registry=r,
        ).labels(*labels)
        self.nixl_failed_transfers = counter(
            Metric.NIXL_NUM_FAILED_TRANSFERS, "Failed NIXL transfers."
        ).labels(*labels)
        self.nixl_failed_notifications = counter(
            Metric.NIXL_NUM_FAILED_NOTIFICATIONS, "Failed NIXL notifications."
        ).labels(*labels)
        self.nixl_expired = counter(
            Metric.NIXL_NUM_KV_EXPIRED_REQS,
            "Requests whose KV expired (lease/TTL reaped or expired read declined).",
        ).labels(*labels)
        self.nixl_notif_after_expiry = counter(
            Metric.NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY,
            "Notifications for unknown (freed or expired) requests.",
        ).labels(*labels)
        self.wrong_kv_tokens = counter(
            Metric.SIM_WRONG_KV_TOKENS,
            "Prompt tokens that ran on KV computed for other tokens or positions.",
        ).labels(*labels)
        self.wrong_kv_requests = counter(
            Metric.SIM_WRONG_KV_REQUESTS, "Requests that ran on wrong KV."
        ).labels(*labels)
        self.retained_blocks = gauge(
            Metric.SIM_RETAINED_BLOCKS,
            "Blocks held for a future reader (D: next turn; P: D's read).",
        ).labels(*labels)
        self.retained_requests = gauge(
            Metric.SIM_RETAINED_REQUESTS, "Finished requests whose blocks are held for a reader."
        ).labels(*labels)
        self.retained_block_seconds = counter(
            Metric.SIM_RETAINED_BLOCK_SECONDS, "Blocks held for a future turn x seconds held (D)."
        ).labels(*labels)
        self.blocks_used = gauge(Metric.SIM_KV_BLOCKS_USED, "KV blocks referenced.").labels(*labels)
        self.blocks_total = gauge(Metric.SIM_KV_BLOCKS_TOTAL, "Usable KV blocks.").labels(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
