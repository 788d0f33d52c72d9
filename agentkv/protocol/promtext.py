"""Read Prometheus text exposition (``/metrics``) with ``prometheus_client``'s parser: the
router's pressure check, the benchmarks and the tests.

Needs ``prometheus_client`` (the ``serve`` extra): ``agentkv.protocol`` does not import this.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["parse_metrics", "samples"]


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
