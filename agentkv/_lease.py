"""Retention leases: keep an open conversation's KV while its agent lives (issue 17).

With ``Client(..., lease_s=30)`` every turn carries ``X-AgentKV-Lease: 30`` and a renewer keeps
the lease of every open conversation of that client alive between turns — through tool waits
of any length — with one batched ``POST /v1/conversations/leases`` per client every
``lease_s / 3``. A conversation stops being renewed when it is closed (``conv.close()`` also
releases its KV at once), when it is garbage-collected (the renewer holds it weakly) or when the
process dies (renewals stop and the router lets the lease lapse).

The decisions are sans-IO (:class:`LiveSet`, :class:`LeaseSchedule`, :class:`LeaseCore`: which
ids are live, when the next renewal is due, what to send, what an answer means); two thin
drivers do the I/O: :class:`LeaseRenewer` (a daemon thread with its own small ``httpx`` client,
for :class:`~agentkv.Client`) and :class:`AsyncLeaseRenewer` (an asyncio task, for
:class:`~agentkv.AsyncClient`). Renewals never block a turn and never raise into user code: a
failure is logged and retried on the next tick; a router without the lease routes (404/405)
stops the renewals of that client (logged once at INFO).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from typing_extensions import Self

from agentkv.protocol import HEADER_LEASE

__all__ = [
    "LEASES_PATH",
    "AsyncLeaseRenewer",
    "LeaseCore",
    "LeaseRenewer",
    "LeaseSchedule",
    "LeaseStats",
    "LiveSet",
    "RenewalRequest",
    "lease_path",
]

log = logging.getLogger("agentkv.lease")

LEASES_PATH = "/v1/conversations/leases"
"""The batched renewal route, relative to the server root."""

MIN_INTERVAL_S = 0.01
"""The shortest renewal interval, whatever a server grants."""


def lease_path(conversation_id: str) -> str:
    """The single-conversation renewal route (the SDK itself always batches); the id is
    percent-encoded, so one holding ``/``, ``?``, ``#`` or ``%`` names itself."""
    return f"/v1/conversations/{quote(conversation_id, safe='')}/lease"


def check_lease_s(lease_s: float) -> float:
    value = float(lease_s)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"lease_s must be a positive number of seconds, not {lease_s!r}")
    return value


def _wire_number(value: float) -> int | float:
    return int(value) if value.is_integer() else value


@dataclass(frozen=True)
class LeaseStats:
    """What one client's renewer has done (``client.lease_stats``)."""

    lease_s: float
    requests: int = 0
    """Batched renewal requests the server accepted (200)."""
    renewed: int = 0
    """Conversation leases those requests renewed."""
    failures: int = 0
    """Renewal requests that failed (connection errors, other statuses); retried next tick."""
    stopped: bool = False
    """The server has no lease routes (404/405): this client renews no more."""
    last_error: str | None = None


@dataclass(frozen=True)
class RenewalRequest:
    """One batched renewal: ``POST {root}{path}`` with ``body``."""

    path: str
    body: dict[str, Any]

    @property
    def ids(self) -> list[str]:
        return list(self.body["ids"])


class LiveSet:
    """The open conversations of one client, held weakly (thread-safe).

    Several conversation objects may share an id (a resumed copy): the id stays live while any
    of them does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[int, tuple[weakref.ref[object], str]] = {}

    def track(self, conversation: object, conversation_id: str) -> None:
        with self._lock:
            self._refs[id(conversation)] = (weakref.ref(conversation), conversation_id)

    def forget(self, conversation: object) -> None:
        with self._lock:
            entry = self._refs.get(id(conversation))
            if entry is not None and entry[0]() is conversation:
                del self._refs[id(conversation)]

    def ids(self) -> list[str]:
        """The distinct ids of the live conversations (first tracked first); drops the dead."""
        with self._lock:
            dead = [key for key, (ref, _) in self._refs.items() if ref() is None]
            for key in dead:
                del self._refs[key]
            return list(dict.fromkeys(cid for _, cid in self._refs.values()))

    def __len__(self) -> int:
        return len(self.ids())


class LeaseSchedule:
    """Ticks every ``lease / 3`` (of the shorter of what was asked and what the server granted),
    measured from the previous tick: a late tick causes no burst of catch-up ticks."""

    def __init__(self, lease_s: float, *, now: float) -> None:
        self.lease_s = check_lease_s(lease_s)
        self.granted_s = self.lease_s
        self.last_at = now
        self.next_at = now + self.interval_s

    @property
    def interval_s(self) -> float:
        return max(min(self.lease_s, self.granted_s) / 3, MIN_INTERVAL_S)

    def wait_s(self, now: float) -> float:
        return max(0.0, self.next_at - now)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def advance(self, now: float) -> None:
        """A tick went out at ``now``: the next one is a whole interval later (so a late tick,
        after a suspended process or a busy interpreter, is never followed by a quick one)."""
        self.last_at = now
        self.next_at = now + self.interval_s

    def grant(self, granted_s: float | None) -> None:
        """What the server granted (it may cap a lease); None or nonsense: what was asked."""
        ok = granted_s is not None and math.isfinite(granted_s) and granted_s > 0
        self.granted_s = granted_s if ok and granted_s is not None else self.lease_s
        self.next_at = min(self.next_at, self.last_at + self.interval_s)


class LeaseCore:
    """The renewer's decisions, without I/O or threads: feed it the time and the answers."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = check_lease_s(lease_s)
        self.live = LiveSet()
        self.schedule: LeaseSchedule | None = None
        self._stats = LeaseStats(lease_s=self.lease_s)
        self._lock = threading.Lock()

    @property
    def header_value(self) -> str:
        return str(_wire_number(self.lease_s))

    @property
    def stats(self) -> LeaseStats:
        return self._stats

    @property
    def stopped(self) -> bool:
        return self._stats.stopped

    def add_header(self, headers: MutableMapping[str, str]) -> None:
        """Put ``X-AgentKV-Lease`` on a turn (a per-turn value the caller set wins)."""
        headers.setdefault(HEADER_LEASE, self.header_value)

    def track(self, conversation: object, conversation_id: str, *, now: float) -> None:
        """A turn of ``conversation`` is being sent: keep it alive from now on."""
        self.live.track(conversation, conversation_id)
        with self._lock:
            if self.schedule is None:
                self.schedule = LeaseSchedule(self.lease_s, now=now)

    def forget(self, conversation: object) -> None:
        self.live.forget(conversation)

    def wait_s(self, now: float) -> float | None:
        """Seconds until the next tick; None when there will be none (stopped, or not started:
        nothing tracked yet)."""
        if self.stopped or self.schedule is None:
            return None
        return self.schedule.wait_s(now)

    def poll(self, now: float) -> RenewalRequest | None:
        """The renewal to send now: None when no tick is due or no conversation is open."""
        schedule = self.schedule
        if self.stopped or schedule is None or not schedule.due(now):
            return None
        schedule.advance(now)
        ids = self.live.ids()
        if not ids:
            return None
        return RenewalRequest(LEASES_PATH, {"lease_s": _wire_number(self.lease_s), "ids": ids})

    def answered(self, request: RenewalRequest, status: int, body: Any) -> None:
        """The server's answer to ``request``."""
        if status in (404, 405):
            if not self.stopped:
                log.info(
                    "agentkv: the server has no lease routes (%s on POST %s): this client stops "
                    "renewing leases (turns are unaffected)",
                    status,
                    request.path,
                )
            self._update(stopped=True, last_error=f"HTTP {status}")
            return
        if status != 200:
            self._fail(f"HTTP {status}")
            return
        data = body.get("data") if isinstance(body, dict) else None
        items = [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []
        # an item with an ``error`` was not renewed: no stored KV (404) or the tenant's bound (429)
        renewed = [d for d in items if "error" not in d]
        granted = [d["lease_s"] for d in renewed if isinstance(d.get("lease_s"), int | float)]
        if self.schedule is not None:
            self.schedule.grant(float(min(granted)) if granted else None)
        self._update(requests=1, renewed=len(renewed) if items else len(request.ids))

    def failed(self, request: RenewalRequest, error: BaseException) -> None:
        """``request`` got no answer (connection error, timeout, ...)."""
        self._fail(f"{type(error).__name__}: {error}")

    def _fail(self, why: str) -> None:
        log.debug("agentkv: lease renewal failed (%s); retrying on the next tick", why)
        self._update(failures=1, last_error=why)

    def _update(
        self,
        *,
        requests: int = 0,
        renewed: int = 0,
        failures: int = 0,
        stopped: bool | None = None,
        last_error: str | None = None,
    ) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(
                s,
                requests=s.requests + requests,
                renewed=s.renewed + renewed,
                failures=s.failures + failures,
                stopped=s.stopped if stopped is None else stopped,
                last_error=s.last_error if last_error is None else last_error,
            )


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def openai_http_settings(client: Any, lease_s: float) -> tuple[str, dict[str, str], httpx.Timeout]:
    """The server root, headers (auth included) and timeouts of an ``openai`` client, for the
    renewer's own small ``httpx`` client. Timeouts are capped so that a renewal never hangs
    for longer than a few ticks."""
    from agentkv._rendering import root_url

    merged = {**dict(client.default_headers), **dict(client.auth_headers)}
    headers = {k: v for k, v in merged.items() if isinstance(k, str) and isinstance(v, str)}
    raw = client.timeout  # a number, None, or a Timeout (httpx's or openai's own)
    names = ("connect", "read", "write", "pool")
    if isinstance(raw, int | float):
        parts: dict[str, Any] = dict.fromkeys(names, float(raw))
    else:
        parts = {name: getattr(raw, name, None) for name in names}
    cap = max(check_lease_s(lease_s) / 3, 2.0)
    capped = {
        name: min(float(v), cap) if isinstance(v, int | float) else cap for name, v in parts.items()
    }
    timeout = httpx.Timeout(**capped)
    return root_url(client.base_url), headers, timeout


T = TypeVar("T", httpx.BaseTransport, httpx.AsyncBaseTransport)


class _Driver(Generic[T]):
    """What both drivers share: the core, where to send, the turn hook, the answers."""

    def __init__(
        self,
        lease_s: float,
        *,
        root: str,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | float | None = 5.0,
        clock: Callable[[], float] = time.monotonic,
        transport: T | None = None,
    ) -> None:
        self.core = LeaseCore(lease_s)
        self.root = root.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.clock = clock
        self.closed = False
        self._transport: T | None = transport
        self._init_state()

    @classmethod
    def for_openai(cls, client: Any, lease_s: float) -> Self:
        root, headers, timeout = openai_http_settings(client, lease_s)
        return cls(lease_s, root=root, headers=headers, timeout=timeout)

    def _init_state(self) -> None:
        """The driver's own state (its thread or task)."""

    @property
    def stats(self) -> LeaseStats:
        return self.core.stats

    def forget(self, conversation: object) -> None:
        """``conversation`` was closed: renew it no more."""
        self.core.forget(conversation)

    def turn(
        self, conversation: object, conversation_id: str, headers: MutableMapping[str, str]
    ) -> None:
        """A turn is being sent: add the lease header, keep the conversation alive."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop renewing."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop renewing, from a coroutine."""
        self.close()

    def _track(
        self, conversation: object, conversation_id: str, headers: MutableMapping[str, str]
    ) -> None:
        self.core.add_header(headers)
        self.core.track(conversation, conversation_id, now=self.clock())

    def _http_options(self) -> dict[str, Any]:
        return {"headers": self.headers, "timeout": self.timeout, "transport": self._transport}

    def _answered(self, request: RenewalRequest, response: httpx.Response) -> None:
        self.core.answered(request, response.status_code, _json(response))


class LeaseRenewer(_Driver[httpx.BaseTransport]):
    """Renews a :class:`~agentkv.Client`'s leases from a daemon thread (started on the first
    turn); ``close()`` stops it at once, whatever the interval."""

    def _init_state(self) -> None:
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def turn(
        self, conversation: object, conversation_id: str, headers: MutableMapping[str, str]
    ) -> None:
        """A turn is being sent: add the lease header, keep the conversation alive."""
        self._track(conversation, conversation_id, headers)
        if not self._running() and not self.closed and not self.core.stopped:
            with self._start_lock:  # (again after a fork: the child has no renewer thread)
                if not self._running() and not self.closed:
                    self._thread = threading.Thread(
                        target=self._run, name="agentkv-lease-renewer", daemon=True
                    )
                    self._thread.start()

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop renewing (promptly: the thread waits on an Event, not a sleep)."""
        with self._start_lock:
            self.closed = True
            thread = self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        with httpx.Client(**self._http_options()) as http:
            while not self._stop.is_set():
                wait = self.core.wait_s(self.clock())
                if wait is None or self._stop.wait(wait):
                    return
                request = self.core.poll(self.clock())
                if request is not None:
                    self._send(http, request)

    def _send(self, http: httpx.Client, request: RenewalRequest) -> None:
        try:
            response = http.post(self.root + request.path, json=request.body)
        except Exception as exc:  # a renewal never raises into user code
            self.core.failed(request, exc)
            return
        self._answered(request, response)


class AsyncLeaseRenewer(_Driver[httpx.AsyncBaseTransport]):
    """Renews an :class:`~agentkv.AsyncClient`'s leases from an asyncio task, started on the
    first turn inside a running loop (again on a new loop) and cancelled by ``aclose()``."""

    def _init_state(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def turn(
        self, conversation: object, conversation_id: str, headers: MutableMapping[str, str]
    ) -> None:
        """A turn is being sent: add the lease header, keep the conversation alive."""
        self._track(conversation, conversation_id, headers)
        if self.closed or self.core.stopped:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = self._task
        if task is None or task.done() or self._loop is not loop:
            self._loop, self._task = loop, loop.create_task(self._run())

    async def aclose(self) -> None:
        """Cancel the renewals (and wait for the task when it runs on this loop)."""
        self.closed = True
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        if task.get_loop() is asyncio.get_running_loop():
            await asyncio.wait({task})

    def close(self) -> None:
        """Cancel the renewals from synchronous code (any thread)."""
        self.closed = True
        task, loop, self._task = self._task, self._loop, None
        if task is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)

    async def _run(self) -> None:
        async with httpx.AsyncClient(**self._http_options()) as http:
            while not self.closed:
                wait = self.core.wait_s(self.clock())
                if wait is None:
                    return
                await asyncio.sleep(wait)
                request = self.core.poll(self.clock())
                if request is not None and not self.closed:
                    await self._send(http, request)

    async def _send(self, http: httpx.AsyncClient, request: RenewalRequest) -> None:
        try:
            response = await http.post(self.root + request.path, json=request.body)
        except Exception as exc:  # a renewal never raises into user code
            self.core.failed(request, exc)
            return
        self._answered(request, response)
