"""The router's heap trimmer returns freed memory to the system (glibc)."""

from __future__ import annotations

import asyncio
import os
import platform

import pytest

from agentkv.router.heap import HeapTrimmer, free_heap_bytes, trim_heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _fragment() -> list[bytes]:
    """64 MiB of 64 KiB buffers (below glibc's mmap threshold: in the heap), each followed by a
    small object that stays live, then the large ones freed: free memory the heap cannot shrink
    past, as an agent-sized turn leaves it."""
    kept: list[bytes] = []
    large: list[bytearray] = []
    for _ in range(1024):
        large.append(bytearray(os.urandom(64 * 1024)))
        kept.append(os.urandom(1024))  # past pymalloc: in the heap too
    large.clear()
    return kept


@glibc
def test_trim_returns_the_freed_pages() -> None:
    trim_heap()
    kept = _fragment()
    free = free_heap_bytes()
    assert free is not None and free >= 32 * 1024 * 1024, free
    before = _rss_kib()
    trimmer = HeapTrimmer(1.0)
    assert trimmer.tick()
    assert trimmer.trims == 1
    after = _rss_kib()
    assert before - after >= 32 * 1024, (before, after)  # at least half of the 64 MiB back
    assert len(kept) == 1024


@glibc
def test_nothing_to_trim_below_the_threshold() -> None:
    trim_heap()
    trimmer = HeapTrimmer(1.0, min_free_bytes=1 << 40)
    assert not trimmer.tick()
    assert trimmer.trims == 0


@glibc
def test_the_loop_runs_and_stops() -> None:
    async def run() -> int:
        trimmer = HeapTrimmer(0.01, min_free_bytes=0)
        trimmer.start()
        await asyncio.sleep(0.2)
        await trimmer.aclose()
        return trimmer.trims

    assert asyncio.run(run()) >= 2


def test_never_when_unset() -> None:
    async def run() -> int:
        trimmer = HeapTrimmer(None, min_free_bytes=0)
        trimmer.start()
        await asyncio.sleep(0.05)
        await trimmer.aclose()
        return trimmer.trims

    assert asyncio.run(run()) == 0
