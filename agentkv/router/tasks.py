"""The router's background loops: stopping them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel each of ``tasks`` (None: not started), then wait until each has stopped."""
    started = [task for task in tasks if task is not None]
    for task in started:
        task.cancel()
    for task in started:
        with contextlib.suppress(asyncio.CancelledError):
            await task
