"""One simulated time line for in-process engines (tests/sim/cluster.py) and the in-process
router stack (tests/router/inprocess_stack.py): each instance sees it shifted by its own origin
(like ``perf_counter``), the router's store reads it as ``monotonic``."""

from __future__ import annotations

from agentkv.sim.clock import ManualClock


class SharedClock:
    """One time line for every instance; each sees it shifted by its own origin."""

    def __init__(self) -> None:
        self.t = 0.0

    def view(self, origin: float) -> ManualClock:
        shared = self

        class _View(ManualClock):
            def now(self) -> float:
                return origin + shared.t

        return _View()

    def monotonic(self) -> float:
        return 50_000.0 + self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeClock:
    """A clock the test sets (``clock.now``), for objects that take a ``clock`` callable (the
    router's handle store and leases)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
