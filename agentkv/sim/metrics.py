"""Prometheus metrics under vLLM 0.33's names (one registry per instance, no globals)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentkv.protocol import Metric as M
from agentkv.protocol.families import Family, build

__all__ = ["SimMetrics"]

# every family is labelled (model_name, engine): an attribute is this instance's one series, but
# for the three with one more label, whose children __init__ takes
_L = ("model_name", "engine")
_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_TTFT = (
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
)
_ITL = (
    0.005,
    0.01,
    0.0125,
    0.015,
    0.0155,
    0.016,
    0.017,
    0.018,
    0.019,
    0.02,
    0.0225,
    0.025,
    0.0275,
    0.03,
    0.035,
    0.04,
    0.05,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
)
"""Fine around the presets' 15 ms decode step, so that a 10 % change of a quantile shows."""
_NIXL_TIME = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def _counter(name: str, doc: str) -> Family[Counter]:
    return Family(Counter, name, doc, _L)


def _gauge(name: str, doc: str) -> Family[Gauge]:
    return Family(Gauge, name, doc, _L)


def _histogram(name: str, doc: str, buckets: Sequence[float]) -> Family[Histogram]:
    return Family(Histogram, name, doc, _L, buckets=buckets)


class SimMetrics:
    """All metrics of one simulated instance; ``render()`` gives the ``/metrics`` text.

    The families below are made in this instance's own registry, in this order, by ``build``.
    """

    prefix_cache_queries = _counter(M.PREFIX_CACHE_QUERIES, "Prefix cache queries (tokens).")
    prefix_cache_hits = _counter(M.PREFIX_CACHE_HITS, "Prefix cache hits (tokens).")
    external_queries = _counter(
        M.EXTERNAL_PREFIX_CACHE_QUERIES, "External (connector) prefix cache queries (tokens)."
    )
    external_hits = _counter(
        M.EXTERNAL_PREFIX_CACHE_HITS, "External (connector) prefix cache hits (tokens)."
    )
    prompt_tokens = _counter(M.PROMPT_TOKENS, "Prompt tokens processed.")
    generation_tokens = _counter(M.GENERATION_TOKENS, "Generation tokens produced.")
    prompt_tokens_cached = _counter(
        M.PROMPT_TOKENS_CACHED, "Prompt tokens not computed (local or external cache)."
    )
    _by_source = Family(
        Counter, M.PROMPT_TOKENS_BY_SOURCE, "Prompt tokens by source.", (*_L, "source")
    )
    _cached_by_source = Family(
        Counter,
        M.PROMPT_TOKENS_CACHED_BY_SOURCE,
        "Cached prompt tokens by source.",
        (*_L, "source"),
    )
    prefill_kv_computed = _histogram(
        M.REQUEST_PREFILL_KV_COMPUTED_TOKENS,
        "Prompt tokens computed per request.",
        (1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144),
    )
    kv_usage = _gauge(M.KV_CACHE_USAGE_PERC, "KV cache usage (0-1).")
    running = _gauge(M.NUM_REQUESTS_RUNNING, "Requests running.")
    waiting = _gauge(M.NUM_REQUESTS_WAITING, "Requests waiting (for blocks or remote KV).")
    _success = Family(Counter, M.REQUEST_SUCCESS, "Finished requests.", (*_L, "finished_reason"))
    ttft = _histogram(
        M.TIME_TO_FIRST_TOKEN_SECONDS,
        "Time to first token (simulated, scaled).",
        _TTFT,
    )
    nixl_xfer_time = _histogram(M.NIXL_XFER_TIME_SECONDS, "NIXL read time.", _NIXL_TIME)
    nixl_post_time = _histogram(
        M.NIXL_POST_TIME_SECONDS, "NIXL post time.", (0.0001, 0.001, 0.01, 0.1, 1)
    )
    nixl_bytes = _histogram(
        M.NIXL_BYTES_TRANSFERRED,
        "Bytes read per transfer.",
        (2**10, 2**14, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30),
    )
    nixl_descriptors = _histogram(
        M.NIXL_NUM_DESCRIPTORS, "Descriptors per transfer.", (1, 4, 16, 64, 256, 1024, 4096, 16384)
    )
    nixl_failed_transfers = _counter(M.NIXL_NUM_FAILED_TRANSFERS, "Failed NIXL transfers.")
    nixl_failed_notifications = _counter(
        M.NIXL_NUM_FAILED_NOTIFICATIONS, "Failed NIXL notifications."
    )
    nixl_expired = _counter(
        M.NIXL_NUM_KV_EXPIRED_REQS,
        "Requests whose KV expired (lease/TTL reaped or expired read declined).",
    )
    nixl_notif_after_expiry = _counter(
        M.NIXL_NUM_NOTIFICATIONS_AFTER_EXPIRY,
        "Notifications for unknown (freed or expired) requests.",
    )
    wrong_kv_tokens = _counter(
        M.SIM_WRONG_KV_TOKENS,
        "Prompt tokens that ran on KV computed for other tokens or positions.",
    )
    wrong_kv_requests = _counter(M.SIM_WRONG_KV_REQUESTS, "Requests that ran on wrong KV.")
    retained_blocks = _gauge(
        M.SIM_RETAINED_BLOCKS, "Blocks held for a future reader (D: next turn; P: D's read)."
    )
    retained_requests = _gauge(
        M.SIM_RETAINED_REQUESTS, "Finished requests whose blocks are held for a reader."
    )
    retained_block_seconds = _counter(
        M.SIM_RETAINED_BLOCK_SECONDS, "Blocks held for a future turn x seconds held (D)."
    )
    blocks_used = _gauge(M.SIM_KV_BLOCKS_USED, "KV blocks referenced.")
    blocks_total = _gauge(M.SIM_KV_BLOCKS_TOTAL, "Usable KV blocks.")
    prefill_in_flight = _gauge(
        M.SIM_PREFILL_TOKENS_IN_FLIGHT,
        "Prompt tokens being prefilled now (each slows the running decode steps).",
    )
    decode_slowdown = _counter(
        M.SIM_DECODE_SLOWDOWN_SECONDS,
        "Seconds added to decode steps by prefills sharing them (simulated, scaled).",
    )
    slowed_steps = _counter(
        M.SIM_SLOWED_DECODE_STEPS, "Decode steps that shared the instance with a prefill."
    )
    inter_token = _histogram(
        M.SIM_MODEL_INTER_TOKEN_SECONDS,
        "Modelled time of each decode step after a request's first token, prefill interference "
        "included (cost-model seconds, before --time-scale).",
        _ITL,
    )
    prefill_queue = _counter(
        M.SIM_PREFILL_QUEUE_SECONDS,
        "Modelled seconds prefills waited for the instance's earlier prefills (before "
        "--time-scale).",
    )
    cpu_blocks = _gauge(M.SIM_CPU_BLOCKS, "Blocks held by the CPU tier.")
    cpu_saves = _counter(M.SIM_CPU_SAVES, "Blocks saved to the CPU tier.")
    cpu_save_failures = _counter(
        M.SIM_CPU_SAVE_FAILURES, "Block saves to the CPU tier that failed (best effort)."
    )
    cpu_evictions = _counter(M.SIM_CPU_EVICTIONS, "Blocks evicted from the CPU tier (LRU).")
    cpu_loaded_tokens = _counter(M.SIM_CPU_LOADED_TOKENS, "Prompt tokens loaded from the CPU tier.")

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        build(self, self.registry, model_name=model_name, engine=engine)
        labels = (model_name, engine)
        self.by_source = {s: self._by_source.labels(*labels, s) for s in _SOURCES}
        self.cached_device = self._cached_by_source.labels(*labels, "device")
        self.cached_p2p = self._cached_by_source.labels(*labels, "p2p")
        self.cached_host = self._cached_by_source.labels(*labels, "host")
        self.success = {
            reason: self._success.labels(*labels, reason)
            for reason in ("stop", "length", "abort", "error")
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
