"""Read Prometheus text exposition (``/metrics``) with ``prometheus_client``'s parser: the
router's pressure check, the benchmarks and the tests.

Needs ``prometheus_client`` (the ``serve`` extra): ``agentkv.protocol`` does not import this.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["histogram_buckets", "histogram_quantile", "parse_metrics", "samples"]


def samples(text: str) -> Iterator[Sample]:
    """Every sample of a page (``ValueError`` when it is not Prometheus text)."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def parse_metrics(text: str, *, by: str = "source") -> dict[str, float]:
    """Samples as ``name`` or ``name[<value of label by>]`` → value, summed over other labels."""
    out: dict[str, float] = {}
    for sample in samples(text):
        tag = sample.labels.get(by, "")
        key = f"{sample.name}[{tag}]" if tag else sample.name
        out[key] = out.get(key, 0.0) + sample.value
    return out


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative counts per upper bound (``le``; ``+Inf`` as ``inf``), summed over
    its other labels."""
    out: dict[float, float] = {}
    for sample in samples(text):
        if sample.name == f"{name}_bucket":
            le = float(sample.labels["le"])
            out[le] = out.get(le, 0.0) + sample.value
    return out


def histogram_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """Prometheus's ``histogram_quantile`` of cumulative ``buckets``: linear within the bucket
    the rank falls in (from 0 in the first), the highest finite bound when it falls in ``+Inf``;
    None without observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0 or not math.isinf(bounds[-1]):
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower
