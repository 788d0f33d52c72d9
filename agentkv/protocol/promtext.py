"""Read Prometheus text exposition (``/metrics``) the way agentkv's tests and benchmarks need (pure
standard library)."""

from __future__ import annotations

import re

__all__ = ["parse_metrics"]

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, *, by: str = "source") -> dict[str, float]:
    """Samples as ``name`` or ``name[<value of label by>]`` → value, summed over other labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        tag = dict(_LABEL.findall(labels)).get(by, "")
        key = f"{name}[{tag}]" if tag else name
        out[key] = out.get(key, 0.0) + float(value)
    return out
