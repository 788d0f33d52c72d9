"""The longest common prefix of two sequences (token ids, block hashes, text): one function for
the SDK, the benchmarks and the tools."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["common_prefix"]


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix (slice comparisons: C speed on long histories)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
