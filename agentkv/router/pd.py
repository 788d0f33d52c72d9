"""One turn through P and D: :class:`Router` performs what the turn core decides.

The decisions of a turn (which handle, which P and D, when a handle is spent, retries, the
receipt) are :mod:`agentkv.router.turn`'s, a sans-IO generator of actions; the router performs
each action (HTTP to the engines, the handle store, leases, token identity, metrics, logs,
traces) and sends its outcome back. The router also releases handles (a notify-only P request)
for the core, the leases and the retention policy, and drops the handles of a D that was
ejected or restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import orjson
from opentelemetry import trace
from starlette.responses import Response, StreamingResponse

from agentkv.protocol import HEADER_SIM_ENGINE_ID
from agentkv.protocol import kv_transfer as kvt
from agentkv.protocol.errors import APIError, UpstreamError
from agentkv.router import turn as core
from agentkv.router.bodies import answer_response, decode_body, prefill_body
from agentkv.router.config import RouterConfig
from agentkv.router.guard import GuardedStore
from agentkv.router.http import Timeout, TransportError
from agentkv.router.identity import Identity, MemoryLedger
from agentkv.router.leases import Leases, MemoryLeases
from agentkv.router.logs import safe
from agentkv.router.metrics import RouterMetrics
from agentkv.router.paths import DecodeBudget, InFlight, load_curves
from agentkv.router.prompts import Tokenizer
from agentkv.router.receipt import Receipt, account, decode_found, sim_receipt
from agentkv.router.relay import Relay, StreamOutcome
from agentkv.router.request import ClientRequest, TokenIds
from agentkv.router.retention import Retention
from agentkv.router.sse import Captured, clean_response
from agentkv.router.store import StoredHandle
from agentkv.router.tasks import TaskSet
from agentkv.router.tracing import trace_headers
from agentkv.router.upstream import (
    EnginePool,
    LocalPrefix,
    Upstream,
    cpu_held,
    first_byte_deadline,
    load,
    pick_decode,
    pick_prefill_by_prefix,
    release,
)

__all__ = ["LocalPrefix", "Receipt", "Router"]

log = logging.getLogger("agentkv.router")
_tracer = trace.get_tracer("agentkv.router")
T = TypeVar("T")


@dataclass
class _Turn:
    """What the driver keeps of one turn while performing its actions."""

    req: ClientRequest
    started: float
    response: Response | None = None
    found: int | None = None
    """Decoding in place: what D said it found cached."""
    give_back: Callable[[], None] = lambda: None
    """Gives back the turn's tokens in D's budget (once; a relayed stream's at its first bytes)."""
    relayed: bool = False
    first: asyncio.Event | None = None
    """A relayed stream's first bytes (D's prefill is done): the turn's releases wait for it."""

    def first_bytes(self) -> None:
        self.give_back()
        if self.first is not None:
            self.first.set()


async def _drive(
    plan: Generator[core.Action, Any, T], perform: Callable[[core.Action], Awaitable[Any]]
) -> T:
    """Run a sans-IO plan: perform every action it yields and send the outcome back."""
    answer: Any = None
    while True:
        try:
            action = plan.send(answer)
        except StopIteration as end:
            result: T = end.value
            return result
        answer = await perform(action)


class Router:
    """The P/D orchestration of one router process."""

    def __init__(
        self,
        config: RouterConfig,
        pool: EnginePool,
        store: GuardedStore,
        metrics: RouterMetrics,
        *,
        local_prefix: Mapping[str, LocalPrefix] | None = None,
        cpu_prefix: Mapping[str, LocalPrefix] | None = None,
        leases: Leases | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.config, self.pool, self.store, self.metrics = config, pool, store, metrics
        self.tokenizer = Tokenizer(config, pool, metrics)
        self.identity = identity or Identity(
            MemoryLedger(
                max_tokens=config.identity.max_tokens,
                per_conversation=config.identity.max_tokens_per_conversation,
                branches=config.store.handles_per_conversation,
                ttl_s=config.router_ttl_s,
            ),
            enabled=config.identity.keep,
            on_error=lambda op: metrics.store_errors.labels(op).inc(),
        )
        self.local_prefix: dict[str, LocalPrefix] = dict(local_prefix or {})
        """P url -> its prefix index (only P's whose KV events the router reads)."""
        self.cpu_prefix: dict[str, LocalPrefix] = dict(cpu_prefix or {})
        """D url -> the index of its CPU tier (only D's whose KV events the router reads)."""
        self.relay = Relay(
            drain_timeout_s=config.upstream.drain_timeout_s, max_drains=config.upstream.max_drains
        )
        self.retention = Retention(
            config, store, leases or MemoryLeases(), pool.decode, self.release, metrics
        )
        self._background = TaskSet()
        for engine in pool.decode:
            engine.on_eject.append(self._drop_handles_of)
            engine.on_new_identity.append(self._drop_handles_of_old)
        self._decode_by_url = {e.url: e for e in pool.decode}
        self._prefill_by_url = {e.url: e for e in pool.prefill}
        self.curves = load_curves(config.paths.costs)
        self.in_flight = InFlight()
        """Each D's decode-in-place prompt tokens, until D's first bytes arrive."""
        self._budget = DecodeBudget(
            config.paths.decode_max_new_tokens, config.paths.decode_tokens_in_flight
        )

    # -- background work -------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        self._background.spawn(coro)

    def start(self) -> None:
        self.retention.start()

    async def drain(self) -> None:
        await self.retention.aclose()
        await self._background.wait()
        await self.relay.aclose()

    def _drop_handles_of(self, engine: Upstream) -> None:
        async def drop() -> None:
            n = await self.store.drop_decode(engine.url)
            if n:
                self.metrics.dropped.labels("ejected").inc(n)
                log.warning("dropped %d handles of ejected decode %s", n, engine.url)

        self._spawn(drop())

    def _drop_handles_of_old(self, engine: Upstream, engine_id: str) -> None:
        """A new engine behind a D's URL: its predecessor's handles name blocks that are gone
        (or, worse, blocks the new engine uses for other tokens). Dropped, never released: a
        notify would go to the new engine about a request it never had."""
        self.metrics.restarts.labels(engine.role).inc()

        async def drop() -> None:
            n = await self.store.drop_decode(engine.url, except_engine_id=engine_id)
            if n:
                self.metrics.dropped.labels("restarted").inc(n)
                log.warning("dropped %d handles of restarted decode %s", n, engine.url)

        self._spawn(drop())

    async def release(self, handle: StoredHandle, reason: str) -> None:
        """Tell D to free a handle's blocks now (:func:`~agentkv.router.upstream.release`);
        never a new engine behind its URL (it never had the request)."""
        d = self._decode_by_url.get(handle.decode_url)
        if d is not None and d.identity not in (None, kvt.engine_id(handle.params)):
            return
        failed = self.metrics.upstream_errors.labels("prefill", "release").inc
        if await release(self.pool, handle, self.config, on_error=failed):
            self.metrics.released.labels(reason).inc()

    async def _release_after(self, action: core.Release, first: asyncio.Event | None) -> None:
        """A release during a turn waits for D's first bytes: a decode-in-place turn's superseded
        blocks stay D's prefix cache hit until D's prefill has used them."""
        if first is not None:
            await first.wait()
        await self.release(action.handle, action.reason)

    async def close_conversation(self, tenant: str, conversation_id: str) -> bool:
        await self.retention.drop((tenant, conversation_id))
        await self.identity.drop((tenant, conversation_id))
        handles = await self.store.delete((tenant, conversation_id))
        for handle in handles:
            await self.release(handle, "closed")
        return bool(handles)

    # -- prompt ids ---------------------------------------------------------------------------
    async def prompt_ids(self, req: ClientRequest) -> TokenIds:
        return await self.tokenizer.prompt_ids(req)

    async def ask_tokenizer(self, path: str, body: dict[str, Any]) -> Any:
        return await self.tokenizer.ask(path, body)

    # -- 3. prefill --------------------------------------------------------------------------
    async def _prefill(self, req: ClientRequest, action: core.Prefill) -> Any:
        """P's request; what came of it, for the turn core."""
        cfg = self.config
        engine, ids = self._prefill_by_url[action.url], action.prompt
        body = prefill_body(req, action)
        timeout = (
            cfg.upstream.prefill_deadline_s
            + len(ids) / 1000 * cfg.upstream.prefill_deadline_per_1k_s
        )
        new = max(1, len(ids) - kvt.num_tokens(action.params) * action.reads)
        engine.count_prefill(len(ids), new)
        started = time.perf_counter()
        try:
            r = await engine.client.post(
                "/v1/completions", body, timeout=timeout, headers=trace_headers()
            )
        except Timeout:
            self.metrics.upstream_errors.labels("prefill", "timeout").inc()
            if action.reads:
                log.warning(
                    "prefill read passed its deadline conv=%s: retrying without the handle",
                    safe(req.conversation_id),
                )
            else:
                log.warning("prefill %s passed its deadline: retrying on another", engine.url)
                engine.failed(1)  # a stalled P: out of rotation until its check passes
            return core.PrefillTimedOut()
        except TransportError:
            self.metrics.upstream_errors.labels("prefill", "connect").inc()
            engine.failed(cfg.upstream.eject_after_failures)
            return core.PrefillUnreachable()
        finally:
            engine.count_prefill(-len(ids), -new)
            self.metrics.p_seconds.observe(time.perf_counter() - started)
        if r.status == 200:
            engine.ok()
            handle = r.json().get("kv_transfer_params")
            side = engine.backend.side_channel_host
            params = core.reachable(handle, engine.url, side) if handle else None
            return core.PrefillDone(params, sim_receipt(r.headers, {}))
        self.metrics.upstream_errors.labels("prefill", str(r.status)).inc()
        if r.status < 500 and r.status != 429:
            return core.PrefillRefused(r.status, r.body)
        if not action.attached or r.status == 429:
            engine.failed(
                cfg.upstream.eject_after_failures
            )  # a failed read is the handle's, not P's
        return core.PrefillFailed(r.status)

    # -- a turn -------------------------------------------------------------------------------
    async def turn(self, req: ClientRequest) -> Response:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if req.chat else "text_completion",
            "agentkv.tenant": req.tenant,
            "agentkv.epoch": req.epoch,
        }
        if req.conversation_id:
            attrs["gen_ai.conversation.id"] = req.conversation_id
        with _tracer.start_as_current_span(
            "agentkv.router.turn", kind=trace.SpanKind.SERVER, attributes=attrs
        ) as span:
            return await self._turn(req, span)

    async def _turn(self, req: ClientRequest, span: trace.Span) -> Response:
        turn = _Turn(req, time.perf_counter())
        known = [e.max_model_len for e in self.pool.all if e.max_model_len is not None]
        t = core.TurnInput(
            key=(req.tenant, req.conversation_id) if req.conversation_id else None,
            epoch=req.epoch,
            model=req.body.get("model") or self.pool.served_model,
            cache_salt=req.cache_salt,
            decode_urls=tuple(self._decode_by_url),
            prompt_ids=req.prompt_ids,
            lease_s=req.lease_s,
            max_tokens=req.body.get("max_completion_tokens") or req.body.get("max_tokens"),
            context_limit=min(known) if known else None,
            curves=self.curves,
        )
        end = await _drive(core.turn_plan(t, self.config), lambda a: self._perform(a, turn))
        if isinstance(end, core.Fail):
            if end.body is not None:
                raise UpstreamError(end.status, end.body)
            raise APIError(end.status, end.message, param=end.param)
        receipt, urls = replace(end.receipt, found=turn.found), (end.prefill_url, end.decode_url)
        account(self.metrics, req, len(end.prompt), receipt, *urls, span, turn.started)
        assert turn.response is not None
        return turn.response

    async def _perform(self, action: core.Action, turn: _Turn | None = None) -> Any:
        """Perform one of the turn core's actions; its outcome."""
        cfg, store = self.config, self.store
        if isinstance(action, core.Candidates):
            handles = await store.candidates(action.key)
            can_pull = any(e.healthy and e.backend.bidirectional for e in self.pool.prefill)
            engines = {e.url: e.identity for e in self.pool.decode}
            out, running, queued = load(self.pool.decode, self.pool.prefill)
            flight = self.in_flight.snapshot()
            return core.Found(handles, engines, can_pull, flight, out, running, queued)
        if isinstance(action, core.Discard):
            if action.reason:
                self.metrics.dropped.labels(action.reason).inc()
            self._spawn(store.take(action.key, action.handle_id))
        elif isinstance(action, core.Take):
            taken = await store.take(action.key, action.handle_id)
            if taken is not None:
                self.metrics.handle_age.observe(taken.age_s)
                if action.releases:
                    self.metrics.released.labels(action.releases).inc()
            return taken
        elif isinstance(action, core.Restore):
            taken, ttl = action.taken, cfg.retention.decoder_kv_blocks_ttl_s
            return await store.put(action.key, taken.handle, ttl, age_s=taken.age_s)
        elif isinstance(action, core.Store):
            return await store.put(action.key, action.handle, cfg.retention.decoder_kv_blocks_ttl_s)
        elif isinstance(action, core.Release):
            self._spawn(self._release_after(action, turn.first if turn else None))
        elif isinstance(action, core.Retry):
            self.metrics.retries.labels(action.reason).inc()
        elif isinstance(action, core.Record):
            await self.identity.record(action.pending, action.prompt, action.output, action.message)
        elif isinstance(action, core.Identify):
            self._decode_by_url[action.url].identify(action.engine_id)
        elif isinstance(action, core.CpuHeld):
            return cpu_held(self.pool.decode, self.cpu_prefix, action.prompt, action.cache_salt)
        elif isinstance(action, core.Reserve):
            return self.in_flight.reserve(action.url, action.tokens, self._budget)
        elif isinstance(action, core.PickDecode):
            engine = pick_decode([self._decode_by_url[u] for u in action.candidates], action.holder)
            return None if engine is None else engine.url
        else:
            assert turn is not None
            return await self._perform_turn(action, turn)
        return None

    async def _perform_turn(self, action: core.Action, turn: _Turn) -> Any:
        req = turn.req
        if isinstance(action, core.Resolve):
            return await self.identity.resolve(req, self.ask_tokenizer)
        if isinstance(action, core.Tokenize):
            return await self.prompt_ids(req)
        if isinstance(action, core.Renew):
            return await self.retention.renew(action.key, action.seconds)
        if isinstance(action, core.PickPrefill):
            engine, local = pick_prefill_by_prefix(
                self.pool.prefill,
                self.local_prefix,
                req.conversation_id,
                action.prompt,
                req.cache_salt,
                block_size=self.config.upstream.block_size,
                cap_tokens=self.config.upstream.affinity_max_in_flight,
                need_bidirectional=action.bidirectional,
            )
            return None if engine is None else core.PrefillChoice(engine.url, local)
        if isinstance(action, core.Prefill):
            return await self._prefill(req, action)
        assert isinstance(action, core.Decode)
        turn.give_back = self.in_flight.give_back(action.url, action.reserved)
        try:
            return await self._decode(turn, action, self._decode_by_url[action.url])
        finally:  # D answered whole, or failed; a stream gives them back at its first bytes
            if not turn.relayed:
                turn.give_back()

    # -- decode ------------------------------------------------------------------------------
    async def _decode(self, turn: _Turn, action: core.Decode, engine: Upstream) -> Any:
        """D's request; the client's response goes in ``turn`` once D has answered."""
        req, started, receipt = turn.req, turn.started, action.receipt
        ids = action.remember.prompt.prompt
        headers = receipt.headers()
        relay = req.stream and engine.backend.handle_on_stream
        body = decode_body(req, action, relay=relay)
        engine.outstanding_requests += 1
        t0 = time.perf_counter()
        most = req.body.get("max_completion_tokens") or req.body.get("max_tokens")
        first_byte = first_byte_deadline(self.config, engine, most, len(ids), relay)
        try:
            send = engine.client.stream(req.path, body, trace_headers())
            upstream = await asyncio.wait_for(send, first_byte)
        except (TransportError, asyncio.TimeoutError) as exc:
            engine.outstanding_requests -= 1
            kind = "first_byte" if isinstance(exc, asyncio.TimeoutError) else "connect"
            if kind == "first_byte":
                log.warning("decode %s sent nothing within %.0f s", engine.url, first_byte)
                engine.failed(1)  # a stalled engine: out of rotation until its check passes
            else:
                engine.suspect()  # unreachable: it may come back as another engine
                engine.failed(self.config.upstream.eject_after_failures)
            self.metrics.upstream_errors.labels("decode", kind).inc()
            return core.DecodeFailed("deadline" if kind == "first_byte" else "unreachable")
        if upstream.status != 200:
            content = await upstream.read()
            await upstream.aclose()
            engine.outstanding_requests -= 1
            self.metrics.upstream_errors.labels("decode", str(upstream.status)).inc()
            if upstream.status >= 500 or upstream.status == 429:
                engine.failed(self.config.upstream.eject_after_failures)
                return core.DecodeFailed()
            return core.DecodeRefused(upstream.status, content)
        engine.identify(upstream.headers.get(HEADER_SIM_ENGINE_ID))
        self.metrics.d_first_byte.observe(time.perf_counter() - t0)
        self.metrics.first_byte.labels(receipt.decision).observe(time.perf_counter() - started)
        headers.update(sim_receipt(action.sim_headers, upstream.headers))
        if action.prefill_url is None:  # decoded in place: what D says it found cached
            turn.found = decode_found(upstream.headers)
            headers.update(replace(receipt, found=turn.found).headers())
        if not relay:
            try:
                data = orjson.loads(await upstream.read())
            except (TransportError, orjson.JSONDecodeError):
                engine.failed(self.config.upstream.eject_after_failures)
                return core.DecodeFailed()
            finally:
                await upstream.aclose()
                engine.outstanding_requests -= 1
            engine.ok()
            if action.prefill_url is None and turn.found is None:
                turn.found = decode_found({}, data)
                headers.update(replace(receipt, found=turn.found).headers())
            captured = clean_response(
                data, keep_ids=req.wants_token_ids, keep_prompt_ids=req.wants_prompt_ids
            )
            await self._remember(action.remember, captured, engine)
            self.metrics.turn_seconds.labels(receipt.decision).observe(
                time.perf_counter() - started
            )
            turn.response = answer_response(req, data, headers)
            return core.DecodeStarted()
        engine.ok()

        async def on_handle(captured: Captured) -> None:
            await self._remember(action.remember, captured, engine)

        def on_end(outcome: StreamOutcome) -> None:
            engine.outstanding_requests -= 1
            self.metrics.turn_seconds.labels(receipt.decision).observe(
                time.perf_counter() - started
            )
            if outcome.failed:
                self.metrics.upstream_errors.labels("decode", "stream").inc()
                engine.failed(self.config.upstream.eject_after_failures)
            elif outcome.abandoned:
                self.metrics.abandoned.labels("drained" if outcome.drained else "aborted").inc()
            elif not outcome.done:
                log.warning(
                    "decode stream ended without [DONE] conversation=%s", safe(req.conversation_id)
                )

        turn.relayed, turn.first = True, asyncio.Event()
        stream = self.relay.stream(
            upstream,
            keep_ids=req.wants_token_ids,
            keep_prompt_ids=req.wants_prompt_ids,
            on_handle=on_handle,
            on_end=on_end,
            accumulate=action.remember.pending is not None,
            on_first=turn.first_bytes,
        )
        turn.response = StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return core.DecodeStarted()

    async def _remember(self, job: core.RememberJob, captured: Captured, engine: Upstream) -> None:
        """Keep what D's answer leaves behind (:func:`~agentkv.router.turn.remember_plan`)."""
        plan = core.remember_plan(job, captured, engine.url, engine.backend.side_channel_host)
        if await _drive(plan, self._perform) == "unknown":
            log.warning("decode %s returned a handle of an unknown shape: not kept", engine.url)
