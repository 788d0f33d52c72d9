"""The engines behind the router: one HTTP client each, health, load, and placement policies.

* Health: an active check (``GET /health`` every ``upstream.health_interval_s``) and passive
  ejection (``upstream.eject_after_failures`` consecutive failed requests take an instance out
  until its check passes again).
* Load: prompt tokens in flight per P, requests in flight per D.
* Placement (small composable functions): P by conversation affinity (rendezvous hashing over
  healthy instances) that yields to the least-loaded P when the preferred one is over its cap;
  D by least outstanding work, preferring the D that holds the conversation's KV.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agentkv.protocol import HEADER_SIM_ENGINE_ID, KVTransferParams
from agentkv.router.config import Backend, RouterConfig
from agentkv.router.http import (
    AiohttpClient,
    ClientFactory,
    EngineClient,
    Pool,
    TransportError,
)
from agentkv.router.store import StoredHandle
from agentkv.router.tasks import TaskSet

__all__ = [
    "EnginePool",
    "LocalPrefix",
    "Upstream",
    "first_byte_deadline",
    "load",
    "pick_decode",
    "pick_prefill",
    "pick_prefill_by_prefix",
    "release",
]

log = logging.getLogger("agentkv.router")


@dataclass(eq=False)
class Upstream:
    """One instance and what the router knows about it."""

    role: str
    backend: Backend
    client: EngineClient
    """Requests: one bounded keep-alive pool (:mod:`agentkv.router.http`)."""
    health: EngineClient
    """Health checks, on their own connection, so they never queue behind requests."""
    healthy: bool = True
    """In rotation: True from the start, so turns that arrive before the first health check are
    placed as usual (an instance that cannot answer fails them over like any failure)."""
    answered: bool = False
    """A health check or a request has succeeded since the router started: ``/health`` says
    200 only when every role has an instance that is healthy and has answered."""
    failures: int = 0
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    prefill_tokens: int = 0
    """P: the prompt tokens it computes for the requests in flight there (each prompt less what it
    reads back): its queue, in the path cost model."""
    on_eject: list[Callable[[Upstream], None]] = field(default_factory=list)
    identity: str | None = None
    """The engine id of the instance behind :attr:`url`, while confirmed: from D's handles and
    from the simulator's ``X-AgentKV-Sim-Engine-Id`` on every answer and health check. None at
    start and from a failed health check or connection on (the instance may be restarting),
    until the engine is identified again. Handles are only read from an identified D whose id
    is theirs."""
    last_identity: str | None = None
    """The last engine id seen behind :attr:`url` (kept while :attr:`identity` is None)."""
    on_new_identity: list[Callable[[Upstream, str], None]] = field(default_factory=list)
    """Called when the engine id behind the URL changes: a new engine (restarted)."""
    max_model_len: int | None = None
    """The context length the engine serves (its ``/v1/models``), once read."""

    def count_prefill(self, prompt_tokens: int, computed_tokens: int) -> None:
        """P: count a request's prompt and the tokens it computes in flight (negative: done)."""
        self.outstanding_tokens += prompt_tokens
        self.prefill_tokens += computed_tokens

    @property
    def url(self) -> str:
        return self.backend.url

    def identify(self, engine_id: str | None) -> None:
        """The engine answered as ``engine_id`` (None: it did not say)."""
        if not engine_id:
            return
        previous = self.last_identity
        self.identity = self.last_identity = engine_id
        if previous is not None and previous != engine_id:
            log.warning("engine restarted role=%s url=%s: new engine id", self.role, self.url)
            self.max_model_len = None  # the new instance may serve another context length
            for hook in self.on_new_identity:
                hook(self, engine_id)

    def suspect(self) -> None:
        """The engine did not answer: until it is identified again it may be a new instance."""
        self.identity = None

    @property
    def ready(self) -> bool:
        """Healthy and known to answer."""
        return self.healthy and self.answered

    def ok(self) -> None:
        self.failures = 0
        self.answered = True
        if not self.healthy:
            log.info("engine back in rotation role=%s url=%s", self.role, self.url)
        self.healthy = True

    def failed(self, threshold: int) -> None:
        self.failures += 1
        if self.healthy and self.failures >= threshold:
            self.healthy = False
            log.warning(
                "engine ejected role=%s url=%s failures=%d", self.role, self.url, self.failures
            )
            for hook in self.on_eject:
                hook(self)


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


def pick_prefill(
    engines: Sequence[Upstream], key: str | None, *, cap_tokens: int, need_bidirectional: bool
) -> Upstream | None:
    """Rendezvous-hash ``key`` over healthy P; the least-loaded one when that is over its cap.
    When every P is ejected, they are all tried anyway (an overloaded instance fails its health
    checks; answering slowly beats answering 503)."""
    able = [e for e in engines if e.backend.bidirectional or not need_bidirectional]
    pool = [e for e in able if e.healthy] or able
    if not pool:
        return None
    least = min(pool, key=lambda e: e.outstanding_tokens)
    if key is None:
        return least
    preferred = max(pool, key=lambda e: _score(key, e.url))
    return preferred if preferred.outstanding_tokens <= cap_tokens else least


class LocalPrefix(Protocol):
    """What P holds in its own prefix cache (an index fed by P's KV events; None: unknown, the
    index is not in sync with P)."""

    def local_prefix_tokens(
        self, prompt_ids: Sequence[int], cache_salt: str | None
    ) -> int | None: ...


def pick_prefill_by_prefix(
    engines: Sequence[Upstream],
    indexes: Mapping[str, LocalPrefix],
    key: str | None,
    ids: Sequence[int],
    cache_salt: str | None,
    *,
    block_size: int,
    cap_tokens: int,
    need_bidirectional: bool,
) -> tuple[Upstream | None, int | None]:
    """(P, L): :func:`pick_prefill`'s P, or with KV events (``indexes``: P url -> its prefix
    index) the P with the longest local prefix L (ties: that P, else configuration order)."""
    preferred = pick_prefill(
        engines, key, cap_tokens=cap_tokens, need_bidirectional=need_bidirectional
    )
    if preferred is None or preferred.url not in indexes:
        return preferred, None

    def local(e: Upstream) -> int | None:
        held = indexes[e.url].local_prefix_tokens(ids, cache_salt)
        return None if held is None else _cap_local(held, len(ids), block_size)

    best, best_local = preferred, local(preferred)
    able = [
        e
        for e in engines
        if e.healthy
        and e.url in indexes
        and (e.backend.bidirectional or not need_bidirectional)
        and e.outstanding_tokens <= cap_tokens
    ]
    for e in able:
        n = local(e)
        if n is not None and n > (best_local or 0):
            best, best_local = e, n
    return best, best_local


def cpu_held(
    engines: Sequence[Upstream],
    indexes: Mapping[str, LocalPrefix],
    ids: Sequence[int],
    cache_salt: str | None,
) -> dict[str, int]:
    """Each healthy D's CPU-tier prefix of ``ids`` (``indexes``: D url -> the index of its CPU
    tier's KV events); D's without one, out of sync or holding nothing are left out."""
    out: dict[str, int] = {}
    for e in engines:
        index = indexes.get(e.url)
        if index is None or not e.healthy:
            continue
        held = index.local_prefix_tokens(ids, cache_salt)
        if held:
            out[e.url] = held
    return out


def _cap_local(local: int, n: int, block_size: int) -> int:
    """vLLM's prefix-cache hit never covers the last prompt token (at most (n-1)//bs blocks)."""
    return min(local, (n - 1) // block_size * block_size) if n > 0 else 0


def pick_decode(
    engines: Sequence[Upstream], holder: str | None, *, slack: int = 2
) -> Upstream | None:
    """The least busy healthy D; the one holding the conversation's KV unless much busier
    (every D when all are ejected, as for P)."""
    pool = [e for e in engines if e.healthy] or list(engines)
    if not pool:
        return None
    least = min(pool, key=lambda e: e.outstanding_requests)
    for e in pool:
        if e.url == holder and e.outstanding_requests <= least.outstanding_requests + slack:
            return e
    return least


class EnginePool:
    """All P and D instances; starts and stops their health checks."""

    def __init__(self, config: RouterConfig, *, engine_client: ClientFactory | None = None) -> None:
        """``engine_client``: makes each engine's client (default :class:`AiohttpClient`)."""
        self.config = config
        connect = engine_client or AiohttpClient

        def client(b: Backend, *, health: bool = False) -> EngineClient:
            # keep-alive shorter than the engines' (uvicorn's 5 s), so the router never reuses a
            # connection the engine is closing
            size = 2 if health else config.upstream.max_connections
            pool = Pool(
                timeout_s=10.0 if health else config.upstream.request_timeout_s,
                max_connections=size,
                keepalive_s=config.upstream.keepalive_s,
            )
            return connect(b.url, pool)

        self.prefill = [
            Upstream("prefill", b, client(b), client(b, health=True))
            for b in config.upstream.prefill
        ]
        self.decode = [
            Upstream("decode", b, client(b), client(b, health=True)) for b in config.upstream.decode
        ]
        self._tasks = TaskSet()
        self.served_model: str | None = None
        """The model D serves by default (the first of its ``/v1/models``): a request without
        ``model`` is for this one, as vLLM reads it."""

    @property
    def all(self) -> list[Upstream]:
        return [*self.prefill, *self.decode]

    async def check(self, engine: Upstream) -> bool:
        timeout = min(5.0, self.config.upstream.health_interval_s * 2)
        try:
            r = await engine.health.get("/health", timeout=timeout)
            good = r.status == 200
        except TransportError:
            good = False
        if good:
            engine.identify(r.headers.get(HEADER_SIM_ENGINE_ID))
            engine.ok()
            if engine.max_model_len is None or (
                self.served_model is None and engine.role == "decode"
            ):
                await self._read_models(engine, timeout)
        else:
            engine.suspect()
            engine.failed(1 if not engine.healthy else self.config.upstream.eject_after_failures)
        return good

    async def _read_models(self, engine: Upstream, timeout: float) -> None:
        """From the engine's ``/v1/models``: the model it serves when a request names none
        (the first card; read from a D) and the smallest ``max_model_len``. What cannot be read
        is asked again at the next health check."""
        try:
            r = await engine.health.get("/v1/models", timeout=timeout)
            cards = r.json().get("data") if r.status == 200 else None
        except (TransportError, ValueError, AttributeError):
            return
        cards = [c for c in cards or [] if isinstance(c, dict)]
        lengths = [c["max_model_len"] for c in cards if isinstance(c.get("max_model_len"), int)]
        if lengths:
            engine.max_model_len = min(lengths)
        name = cards[0].get("id") if cards else None
        if engine.role == "decode" and self.served_model is None and isinstance(name, str):
            self.served_model = name

    async def _watch(self, engine: Upstream) -> None:
        while True:
            await self.check(engine)
            await asyncio.sleep(self.config.upstream.health_interval_s)

    def start(self) -> None:
        for engine in self.all:
            self._tasks.spawn(self._watch(engine))

    async def aclose(self) -> None:
        await self._tasks.cancel()
        for e in self.all:
            await e.client.aclose()
            await e.health.aclose()


async def release(
    pool: EnginePool, handle: StoredHandle, config: RouterConfig, *, on_error: Callable[[], None]
) -> bool:
    """Tell D to free a handle's blocks now: a notify-only P request, tried like a turn's P
    request (``upstream.retries`` more times), so one failing P does not leave D pinning the blocks
    until its TTL. Whether a P took the notify (``on_error`` is called for each failure)."""
    params = KVTransferParams.model_validate(handle.params).for_reading().release_only()
    body = {
        "prompt": handle.tail_tokens[:1] or [0],
        "max_tokens": 1,
        "kv_transfer_params": params.to_wire(),
    }
    for _attempt in range(config.upstream.retries + 1):
        engine = pick_prefill(pool.prefill, None, cap_tokens=1 << 62, need_bidirectional=True)
        if engine is None:
            return False
        try:
            r = await engine.client.post(
                "/v1/completions", body, timeout=config.upstream.prefill_deadline_s
            )
        except TransportError:
            on_error()
            continue
        if r.status == 200:
            return True
        on_error()
        if r.status < 500 and r.status != 429:
            return False  # P refused the notify itself: trying again changes nothing
    return False


def first_byte_deadline(
    config: RouterConfig, engine: Upstream, most: object, n: int, relay: bool
) -> float:
    """How long D may take to its first byte for a prompt of ``n`` tokens and ``most`` output
    tokens (the client's ``max_tokens``, if an int): a stream's first chunk, or a non-streamed
    answer whole (vLLM sends its headers with the body)."""
    if relay:
        return config.upstream.decode_first_byte_timeout_s
    if not isinstance(most, int):
        most = max(1, (engine.max_model_len or n + 32_768) - n)
    return (
        config.upstream.decode_first_byte_timeout_s + most * config.upstream.decode_token_timeout_s
    )


def load(
    decode: Sequence[Upstream], prefill: Sequence[Upstream]
) -> tuple[frozenset[str], dict[str, int], int]:
    """What the path cost model knows of the engines' load, from the router's own counts: the D's
    out of rotation, each D's requests running, and the prompt tokens the least loaded healthy P
    computes."""
    out = frozenset(e.url for e in decode if not e.healthy)
    running = {e.url: e.outstanding_requests for e in decode}
    queued = min((e.prefill_tokens for e in prefill if e.healthy), default=0)
    return out, running, queued
