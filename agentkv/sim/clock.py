"""Injectable time: a private monotonic clock per instance, and scaled sleeps."""

from __future__ import annotations

import asyncio
import time

__all__ = ["Clock", "ManualClock"]


class Clock:
    """``now()`` is this instance's ``perf_counter`` (shifted by ``offset_s``, as separate
    machines' clocks are); ``sleep()`` waits ``seconds × scale`` of real time."""

    def __init__(self, *, offset_s: float = 0.0, scale: float = 1.0) -> None:
        self.offset_s = offset_s
        self.scale = scale

    def now(self) -> float:
        return time.perf_counter() + self.offset_s

    async def sleep(self, seconds: float) -> None:
        delay = seconds * self.scale
        if delay > 0:
            await asyncio.sleep(delay)


class ManualClock(Clock):
    """A clock tests move by hand; sleeps return at once."""

    def __init__(self, start: float = 1_000.0) -> None:
        super().__init__(offset_s=0.0, scale=0.0)
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
