"""Streaming D's answer to the client without tying D's fate to the client's.

A reader task reads D's stream to the end and hands the client's bytes to the response through a
queue. When the client hangs up, the response stops but the reader goes on (bounded in time and
in how many run at once) so D finishes the turn and its new handle is stored: a resent turn then
pulls. When D dies mid-stream the client gets an SSE error event in OpenAI's shape and a clean
end instead of a broken chunked body.

What one read from D returned is cleaned as one block (:class:`~agentkv.router.sse.EventRelay`:
only the events that carry the handle, a ``finish_reason`` or ``usage`` are parsed) and goes to
the client in one write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from agentkv.protocol import error_body
from agentkv.protocol.http import sse
from agentkv.router.http import Stream, TransportError
from agentkv.router.sse import Captured, EventRelay
from agentkv.router.tasks import TaskSet

__all__ = ["Relay", "StreamOutcome"]

log = logging.getLogger("agentkv.router")

_DONE = b"data: [DONE]\n\n"


@dataclass
class StreamOutcome:
    """How a relayed stream ended."""

    done: bool = False
    """D sent ``[DONE]``."""
    failed: bool = False
    """D's stream broke (the client got an error event)."""
    abandoned: bool = False
    """The client left before the end."""
    drained: bool = False
    """The client left and the router read D to the end anyway."""


class Relay:
    """The reader tasks of one router (``upstream.max_drains`` streams read on after their client
    left, each for at most ``upstream.drain_timeout_s``)."""

    def __init__(self, *, drain_timeout_s: float, max_drains: int) -> None:
        self.drain_timeout_s, self.max_drains = drain_timeout_s, max_drains
        self.draining = 0
        self._tasks = TaskSet()

    async def aclose(self) -> None:
        await self._tasks.cancel()

    def stream(
        self,
        upstream: Stream,
        *,
        keep_ids: bool,
        on_handle: Callable[[Captured], Awaitable[None]],
        on_end: Callable[[StreamOutcome], None],
        keep_prompt_ids: bool | None = None,
        accumulate: bool = False,
        on_first: Callable[[], None] | None = None,
    ) -> AsyncIterator[bytes]:
        """The client's SSE bytes; D is read by a task of its own. ``keep_prompt_ids`` (default
        ``keep_ids``): pass D's echo of the prompt's ids. ``accumulate``: keep the assistant
        message (``Captured.answer``) for token identity. ``on_first``: called once, when D's
        first bytes arrive (or the stream ends without any)."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        outcome = StreamOutcome()
        events = EventRelay(
            Captured(),
            keep_ids=keep_ids,
            keep_prompt_ids=keep_ids if keep_prompt_ids is None else keep_prompt_ids,
            accumulate=accumulate,
        )
        read = self._read(upstream, queue, outcome, events, on_handle=on_handle, on_first=on_first)
        task = self._tasks.spawn(read)
        task.add_done_callback(lambda _: on_end(outcome))
        return self._forward(queue, outcome, task)

    async def _forward(
        self, queue: asyncio.Queue[bytes | None], outcome: StreamOutcome, task: asyncio.Task[None]
    ) -> AsyncIterator[bytes]:
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item
        finally:
            if not task.done():
                outcome.abandoned = True
                if self.draining >= self.max_drains:
                    task.cancel()  # too many already: D aborts, its blocks are freed

    async def _read(
        self,
        upstream: Stream,
        queue: asyncio.Queue[bytes | None],
        outcome: StreamOutcome,
        events: EventRelay,
        *,
        on_handle: Callable[[Captured], Awaitable[None]],
        on_first: Callable[[], None] | None = None,
    ) -> None:
        captured = events.captured
        remembered = False
        draining_since: float | None = None
        try:
            async for data in upstream:
                if on_first is not None:
                    on_first()
                    on_first = None
                if outcome.abandoned and draining_since is None:
                    draining_since = time.monotonic()
                    self.draining += 1
                if draining_since is not None and (
                    time.monotonic() - draining_since > self.drain_timeout_s
                ):
                    log.warning(
                        "gave up draining an abandoned stream after %.0f s", self.drain_timeout_s
                    )
                    return
                out = events.feed(data)
                outcome.done = events.done
                if captured.handle is not None and not remembered:
                    # D's handle comes on the finish_reason chunk, with the last token: store it
                    # before the client sees the end and can send its next turn
                    remembered = True
                    await on_handle(captured)
                if out and not outcome.abandoned:
                    queue.put_nowait(out)  # what arrived together goes out in one write
            out = events.close()
            if captured.handle is not None and not remembered:
                remembered = True
                await on_handle(captured)
            if out and not outcome.abandoned:
                queue.put_nowait(out)
            outcome.done = events.done
            outcome.drained = outcome.abandoned
        except TransportError as exc:
            outcome.failed = True
            log.warning("decode stream broke: %s", type(exc).__name__)
            message = "The decode instance's stream broke before the end of the answer."
            queue.put_nowait(sse(error_body(502, message)))
            queue.put_nowait(_DONE)
        finally:
            if on_first is not None:
                on_first()
            if draining_since is not None:
                self.draining -= 1
            queue.put_nowait(None)
            await upstream.aclose()
