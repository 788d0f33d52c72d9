"""Retries of a turn's requests: which errors, how many times, how long to wait.

Connection errors, 429 and 503 are retried (nothing is recorded before a response arrives, so a
retry never appends twice); every other error passes through at once. The default wait is
exponential with jitter proportional to it: ``0.1 · 2^(n-1)`` seconds (capped at 4 s) times a
random factor in ``[0.5, 1.5)``, so the first retry waits 0.05–0.15 s, the second 0.1–0.3 s,
the third 0.2–0.6 s. :class:`RetryPolicy` takes tenacity's ``wait=`` and ``sleep=`` (tests pass
a no-op ``sleep``).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import openai
from tenacity import AsyncRetrying, Retrying, retry_if_exception, stop_after_attempt
from tenacity.wait import wait_base

__all__ = ["RetryPolicy", "proportional_jitter", "retryable"]

_RETRY_STATUS = {429, 503}
T = TypeVar("T")


def retryable(exc: BaseException) -> bool:
    """Connection errors, 429 and 503 (``openai``'s or ``httpx``'s)."""
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in _RETRY_STATUS
    if isinstance(exc, openai.APIConnectionError | httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in _RETRY_STATUS


class proportional_jitter(wait_base):
    """``min(cap, multiplier · 2^(attempt-1))`` seconds times a random factor in
    ``[1 - spread, 1 + spread)``: the jitter grows with the wait."""

    def __init__(self, multiplier: float = 0.1, cap: float = 4.0, spread: float = 0.5) -> None:
        if multiplier < 0 or cap < 0 or not 0 <= spread <= 1:
            raise ValueError("multiplier and cap must be >= 0, spread in [0, 1]")
        self.multiplier, self.cap, self.spread = multiplier, cap, spread

    def __call__(self, retry_state: Any) -> float:
        attempt = max(1, int(retry_state.attempt_number))
        try:
            base = min(self.cap, self.multiplier * 2.0 ** (attempt - 1))
        except OverflowError:
            base = self.cap
        return base * random.uniform(1 - self.spread, 1 + self.spread)


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries (``Client(retries=RetryPolicy(...))``).

    Args:
        retries: attempts after the first.
        wait: a tenacity wait strategy (default :class:`proportional_jitter`).
        sleep: the sync client's sleep (default ``time.sleep``).
        async_sleep: the async client's sleep, sync or a coroutine function (default
            ``asyncio.sleep``).
    """

    retries: int = 2
    wait: wait_base | None = None
    sleep: Callable[[float], None] | None = None
    async_sleep: Callable[[float], Awaitable[None] | None] | None = None

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, not {self.retries!r}")

    @classmethod
    def of(cls, retries: int | RetryPolicy) -> RetryPolicy:
        return retries if isinstance(retries, RetryPolicy) else cls(retries=int(retries))

    def _common(self) -> dict[str, Any]:
        return {
            "stop": stop_after_attempt(self.retries + 1),
            "wait": self.wait if self.wait is not None else proportional_jitter(),
            "retry": retry_if_exception(retryable),
            "reraise": True,
        }

    def retrying(self) -> Retrying:
        extra: dict[str, Any] = {} if self.sleep is None else {"sleep": self.sleep}
        return Retrying(**self._common(), **extra)

    def async_retrying(self) -> AsyncRetrying:
        extra: dict[str, Any] = {} if self.async_sleep is None else {"sleep": self.async_sleep}
        return AsyncRetrying(**self._common(), **extra)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, retried."""
        return self.retrying()(fn)

    async def acall(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()``, retried."""

        async def attempt() -> T:
            return await fn()

        return await self.async_retrying()(attempt)
