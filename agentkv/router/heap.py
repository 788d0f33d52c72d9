"""Giving the heap's free memory back to the system.

An agent-sized turn passes megabytes through the router (the client's body, P's and D's bodies,
their answers) and keeps a few tens of KiB (the conversation's handle and identity record).
glibc's allocator keeps the freed megabytes in the process's heap, fragmented by what stays
live, so the router's resident size grows with the number of live conversations by several
times what it keeps for them (issue 23: 115–171 KiB per live 32k-token conversation with the
exact ids, 52 KiB once trimmed). Every ``interval_s`` seconds, when the heap holds at least
``min_free_bytes`` free, :class:`HeapTrimmer` calls glibc's ``malloc_trim(0)``, which returns
the free pages of every arena to the system (about 0.2 ms at this size). On a C library without
``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from typing import Any

from agentkv.router.tasks import cancel_and_wait

__all__ = ["HeapTrimmer", "free_heap_bytes", "trim_heap"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    if hasattr(libc, "mallinfo2"):  # glibc 2.33+
        libc.mallinfo2.restype = _MallInfo2
    return libc


_LIBC = _libc()


def free_heap_bytes() -> int | None:
    """Bytes free in the allocator's arenas (glibc's ``mallinfo2().fordblks``), None when the C
    library does not say."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    return int(_LIBC.mallinfo2().fordblks)


def trim_heap() -> bool:
    """Return the heap's free pages to the system now; whether the C library could."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


class HeapTrimmer:
    """A background loop trimming the heap every ``interval_s`` seconds when it holds at least
    ``min_free_bytes`` free (``interval_s`` None: never)."""

    def __init__(self, interval_s: float | None, min_free_bytes: int = 1 << 20) -> None:
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.trims = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s is None or _LIBC is None or self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(self.interval_s))

    async def aclose(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    def tick(self) -> bool:
        """One check: trim when enough is free (or when the C library cannot say how much)."""
        free = free_heap_bytes()
        if free is not None and free < self.min_free_bytes:
            return False
        if trim_heap():
            self.trims += 1
            return True
        return False

    async def _run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.tick()
