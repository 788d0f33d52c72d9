"""What a replay reads from the simulator engines' ``/metrics`` around each policy: counters,
and D's modelled inter-token latency (``agentkv_sim_model_inter_token_seconds``) as quantiles of
the run's own observations (the histogram's buckets after the run less those before)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import httpx

from agentkv.protocol import Metric
from agentkv.protocol.promtext import histogram_buckets, histogram_quantile, parse_metrics

__all__ = ["ITL_QUANTILES", "engine_counters", "measured_delta"]

_RETAINED = f"{Metric.SIM_RETAINED_BLOCK_SECONDS}_total"
_WRONG = f"{Metric.SIM_WRONG_KV_TOKENS}_total"
_EXPIRED = f"{Metric.NIXL_NUM_KV_EXPIRED_REQS}_total"
_QUEUE = f"{Metric.SIM_PREFILL_QUEUE_SECONDS}_total"
_SLOWED = f"{Metric.SIM_SLOWED_DECODE_STEPS}_total"
_ITL = Metric.SIM_MODEL_INTER_TOKEN_SECONDS
_BUCKET = "d_itl_le_"
ITL_QUANTILES = (0.5, 0.9, 0.99)
"""D's inter-token latency quantiles a replay reports (``d_itl_p50_ms`` …)."""


async def _pages(urls: Sequence[str]) -> list[str]:
    pages: list[str] = []
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        for url in urls:
            with contextlib.suppress(httpx.HTTPError):
                pages.append((await client.get(f"{url}/metrics")).text)
    return pages


def _sum(pages: Sequence[str], name: str) -> float:
    return sum(parse_metrics(page).get(name, 0.0) for page in pages)


async def engine_counters(
    engine_urls: Sequence[str], decode_urls: Sequence[str]
) -> dict[str, float]:
    """The simulator counters the report shows, per role, and D's inter-token histogram's
    cumulative buckets (keys ``d_itl_le_<bound>``)."""
    p = await _pages([u for u in engine_urls if u not in decode_urls])
    d = await _pages(decode_urls)
    out = {
        "retained_block_s_decode": _sum(d, _RETAINED),
        "wrong_kv_tokens_prefill": _sum(p, _WRONG),
        "wrong_kv_tokens_decode": _sum(d, _WRONG),
        "expired_decode": _sum(d, _EXPIRED),
        "prefill_queue_s_prefill": _sum(p, _QUEUE),
        "prefill_queue_s_decode": _sum(d, _QUEUE),
        "slowed_steps_decode": _sum(d, _SLOWED),
        "d_itl_sum_s": _sum(d, f"{_ITL}_sum"),
    }
    for page in d:
        for le, count in histogram_buckets(page, _ITL).items():
            key = f"{_BUCKET}{le!r}"
            out[key] = out.get(key, 0.0) + count
    return out


def measured_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What one policy's run added: each counter's difference, and D's inter-token latency
    quantiles and mean in modelled milliseconds over the steps of this run (``d_itl_p50_ms`` …,
    ``d_itl_mean_ms``; ``d_itl_steps``), in place of the buckets."""
    out: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        if key.startswith(_BUCKET):
            buckets[float(key.removeprefix(_BUCKET))] = delta
        else:
            out[key] = delta
    if buckets:
        out["d_itl_steps"] = max(buckets.values())
        if out["d_itl_steps"] > 0:
            out["d_itl_mean_ms"] = out["d_itl_sum_s"] / out["d_itl_steps"] * 1000
        for q in ITL_QUANTILES:
            at = histogram_quantile(buckets, q)
            if at is not None:
                out[f"d_itl_p{round(q * 100)}_ms"] = at * 1000
    return out
