"""One turn through P and D, with verified reuse and faults degraded to recompute.

1. **Prompt ids**: the client's exact ids; the conversation's previous prompt + generated ids +
   the new messages' ids when its history repeats the answer as returned
   (:mod:`~agentkv.router.identity`); else P's ``/tokenize`` of the same messages. Both P and D
   then get these ids, so all agree.
2. **Handle**: the conversation keeps up to K handles (branches); each is verified against the
   prompt by chained block hashes from a root of model + salt, whatever its epoch
   (:func:`~agentkv.router.verify.plan_reuse`). The one with the longest verified prefix C is
   taken (single use) and attached trimmed to C; a handle the client rewrote past is released
   (``remote_num_tokens: 0``).
3. **P**: the P with the longest local prefix L (its KV events; ties: affinity and load). P reads
   M = max(0, min(C, N) − L) tokens from D, when M clears the threshold. A request that reads a
   handle has a deadline and is retried without it when it passes (real vLLM never answers a
   read of an expired handle); a 500 with a handle is retried once without it; failures move to
   another P. The handle is spent only when a P accepts the request: a rejection or a failure
   before that puts it back.
4. **D**: the client's request with P's params and the ids, streamed as the client asked; a D
   failing before its first byte (or not sending it within the deadline) is retried on another
   D after a fresh P pass. A stream is read to the end even when the client leaves.
5. **Remember** D's handle with the hashes of the blocks it holds, keyed by (tenant,
   conversation id); handles it displaces, and those of turns without a conversation id, are
   released at once so D does not pin their blocks until its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

import orjson
from opentelemetry import trace
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from agentkv.protocol import HEADER_SIM_ENGINE_ID, KVTransferParams
from agentkv.protocol import kv_transfer as kvt
from agentkv.protocol.http import ORJSONResponse
from agentkv.router.config import RouterConfig
from agentkv.router.errors import UpstreamError
from agentkv.router.guard import GuardedStore
from agentkv.router.http import Timeout, TransportError
from agentkv.router.identity import Identity, MemoryLedger, Pending, Resolved
from agentkv.router.leases import Leases, MemoryLeases
from agentkv.router.logs import safe
from agentkv.router.metrics import RouterMetrics
from agentkv.router.receipt import Receipt, account, sim_receipt
from agentkv.router.relay import Relay, StreamOutcome
from agentkv.router.request import ClientRequest, RouterError, TokenIds, checked_ids, wire_ids
from agentkv.router.retention import Retention
from agentkv.router.sse import Captured, clean_response, synthesize_stream
from agentkv.router.store import StoredHandle, StoreKey, Taken
from agentkv.router.tracing import trace_headers
from agentkv.router.upstream import EnginePool, Upstream, pick_decode, pick_prefill
from agentkv.router.verify import PromptHashes, ReusePlan, hash_root, held_record, plan_reuse

__all__ = ["LocalPrefix", "Receipt", "Router", "UpstreamError"]

log = logging.getLogger("agentkv.router")
_tracer = trace.get_tracer("agentkv.router")
_LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "0.0.0.0", "::1"}


class LocalPrefix(Protocol):
    """What P holds in its own prefix cache (an index fed by P's KV events; None: unknown, the
    index is not in sync with P)."""

    def local_prefix_tokens(
        self, prompt_ids: Sequence[int], cache_salt: str | None
    ) -> int | None: ...


@dataclass
class _Prefilled:
    params: dict[str, Any]
    engine: Upstream
    receipt: Receipt
    sim_headers: dict[str, str] = field(default_factory=dict)
    """P's simulator receipt headers (agentkv's engine simulator only)."""


@dataclass
class _Attempt:
    """The plan as P's attempts change it (a handle lost to a failed read is dropped from it)."""

    plan: ReusePlan
    key: StoreKey | None


def _reachable(params: dict[str, Any], engine: Upstream) -> dict[str, Any]:
    """The handle with an owner address its reader can reach."""
    host = engine.backend.side_channel_host
    if host is None and kvt.owner_host(params) in _LOCAL_HOSTS:
        url_host = urlsplit(engine.url).hostname or ""
        host = url_host if url_host not in _LOCAL_HOSTS else None
    return kvt.with_owner_host(params, host) if host else dict(params)


def _cap_local(local: int, n: int, block_size: int) -> int:
    """vLLM's prefix-cache hit never covers the last prompt token (at most (n-1)//bs blocks)."""
    return min(local, (n - 1) // block_size * block_size) if n > 0 else 0


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
        leases: Leases | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.config, self.pool, self.store, self.metrics = config, pool, store, metrics
        self.identity = identity or Identity(
            MemoryLedger(
                max_tokens=config.identity_max_tokens,
                per_conversation=config.identity_max_tokens_per_conversation,
                branches=config.handles_per_conversation,
                ttl_s=config.router_ttl_s,
            ),
            enabled=config.keep_token_identity,
            on_error=lambda op: metrics.store_errors.labels(op).inc(),
        )
        self.local_prefix: dict[str, LocalPrefix] = dict(local_prefix or {})
        """P url -> its prefix index (only P's whose KV events the router reads)."""
        self.relay = Relay(drain_timeout_s=config.drain_timeout_s, max_drains=config.max_drains)
        self.retention = Retention(
            config, store, leases or MemoryLeases(), pool.decode, self.release, metrics
        )
        self._background: set[asyncio.Task[None]] = set()
        for engine in pool.decode:
            engine.on_eject.append(self._drop_handles_of)
            engine.on_new_identity.append(self._drop_handles_of_old)
        self._decode_by_url = {e.url: e for e in pool.decode}

    # -- background work -------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def start(self) -> None:
        self.retention.start()

    async def drain(self) -> None:
        await self.retention.aclose()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
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

    def _readable(self, candidate: Taken) -> bool | None:
        """Whether a stored handle's D is the engine that issued it: True, False (it is gone:
        another engine is behind the URL, or the URL left the configuration), or None (the D is
        not identified now: the handle waits)."""
        handle = candidate.handle
        engine = self._decode_by_url.get(handle.decode_url)
        if engine is None:
            return False
        if engine.identity is None:
            return None
        return kvt.engine_id(handle.params) == engine.identity

    async def release(self, handle: StoredHandle, reason: str) -> None:
        """Tell D to free a handle's blocks now: a notify-only P request, tried like a turn's
        P request (``retries`` more times), so one failing P does not leave D pinning the
        blocks until its TTL."""
        params = KVTransferParams.model_validate(handle.params).for_reading().release_only()
        body = {
            "prompt": handle.tail_tokens[:1] or [0],
            "max_tokens": 1,
            "kv_transfer_params": params.to_wire(),
        }
        for _attempt in range(self.config.retries + 1):
            engine = pick_prefill(
                self.pool.prefill, None, cap_tokens=1 << 62, need_bidirectional=True
            )
            if engine is None:
                return
            try:
                r = await engine.client.post(
                    "/v1/completions", body, timeout=self.config.prefill_deadline_s
                )
            except TransportError:
                self.metrics.upstream_errors.labels("prefill", "release").inc()
                continue
            if r.status_code == 200:
                self.metrics.released.labels(reason).inc()
                return
            self.metrics.upstream_errors.labels("prefill", "release").inc()
            if r.status_code < 500 and r.status_code != 429:
                return  # P refused the notify itself: trying again changes nothing

    async def close_conversation(self, tenant: str, conversation_id: str) -> bool:
        await self.retention.drop((tenant, conversation_id))
        await self.identity.drop((tenant, conversation_id))
        handles = await self.store.delete((tenant, conversation_id))
        for handle in handles:
            await self.release(handle, "closed")
        return bool(handles)

    # -- 1. prompt ids -----------------------------------------------------------------------
    async def prompt_ids(self, req: ClientRequest) -> TokenIds:
        if req.prompt_ids is not None:
            return req.prompt_ids
        body: dict[str, Any]
        if req.chat:
            keys = (
                "messages",
                "tools",
                "chat_template",
                "chat_template_kwargs",
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
                "model",
            )
            body = {k: req.body[k] for k in keys if k in req.body}
        else:
            body = {
                k: req.body[k] for k in ("prompt", "add_special_tokens", "model") if k in req.body
            }
            if isinstance(body.get("prompt"), list):
                body["prompt"] = body["prompt"][0]
        ids = checked_ids((await self.ask_tokenizer("/tokenize", body)).get("tokens"))
        if ids is None:
            raise RouterError(502, "The prefill instance's /tokenize returned no token ids.")
        return ids

    async def ask_tokenizer(self, path: str, body: dict[str, Any]) -> Any:
        """The JSON answer of a tokenizing instance (``tokenize_with``) to ``POST path``, tried
        on ``retries`` more when one fails; its 4xx is the client's error."""
        engines = self.pool.prefill if self.config.tokenize_with == "prefill" else self.pool.decode
        candidates = [e for e in engines if e.healthy] or list(engines)
        last: Exception | None = None
        tries = [candidates[i % len(candidates)] for i in range(self.config.retries + 1)]
        data = orjson.dumps(body)
        for engine in tries:
            try:
                r = await engine.client.post(path, data)
            except TransportError as exc:
                engine.failed(self.config.eject_after_failures)
                self.metrics.upstream_errors.labels("prefill", "tokenize").inc()
                last = exc
                continue
            if r.status_code == 200:
                return r.json()
            if r.status_code < 500:
                raise UpstreamError(r.status_code, r.content)
            last = RuntimeError(f"{path} answered {r.status_code}")
        log.warning("could not tokenize a prompt: %s", safe(repr(last)))
        raise RouterError(503, "Could not tokenize the prompt: no prefill instance answered.")

    def _check_context(self, req: ClientRequest, n: int) -> None:
        """Refuse what the engines would (vLLM's messages): a prompt or ``max_tokens`` past the
        served context length. P alone would accept it and read D's blocks, and D's refusal
        would come after the conversation's handle was spent."""
        known = [e.max_model_len for e in self.pool.all if e.max_model_len is not None]
        if not known:
            return
        limit = min(known)
        if n > limit:
            raise RouterError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {n} input tokens, which exceeds this limit even without any output "
                "tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        most = req.body.get("max_completion_tokens") or req.body.get("max_tokens")
        if isinstance(most, int) and n + most > limit:
            raise RouterError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{most} output tokens and your prompt contains {n} input tokens, for a total of "
                f"{n + most} tokens. Please reduce the length of the input prompt or the number "
                "of requested output tokens.",
                param="max_tokens",
            )

    # -- 3. prefill --------------------------------------------------------------------------
    def _choose_prefill(
        self, req: ClientRequest, ids: list[int], need_bidirectional: bool
    ) -> tuple[Upstream | None, int | None]:
        """(P, L): with KV events, the P with the longest local prefix (ties: the affinity P,
        else configuration order)."""
        preferred = pick_prefill(
            self.pool.prefill,
            req.conversation_id,
            cap_tokens=self.config.affinity_max_outstanding_tokens,
            need_bidirectional=need_bidirectional,
        )
        if preferred is None or preferred.url not in self.local_prefix:
            return preferred, None
        bs = self.config.block_size

        def local(e: Upstream) -> int | None:
            held = self.local_prefix[e.url].local_prefix_tokens(ids, req.cache_salt)
            return None if held is None else _cap_local(held, len(ids), bs)

        best, best_local = preferred, local(preferred)
        able = [
            e
            for e in self.pool.prefill
            if e.healthy
            and e.url in self.local_prefix
            and (e.backend.bidirectional or not need_bidirectional)
            and e.outstanding_tokens <= self.config.affinity_max_outstanding_tokens
        ]
        for e in able:
            n = local(e)
            if n is not None and n > (best_local or 0):
                best, best_local = e, n
        return best, best_local

    def _covered_locally(self, plan: ReusePlan, n: int, local: int | None) -> bool:
        """A partly verified handle whose verified part P holds itself (M below threshold)."""
        if plan.params is None or plan.release or plan.taken is None or local is None:
            return False
        if plan.verified_tokens >= plan.taken.handle.num_tokens:
            return False  # all of it is this prompt's: this turn's own handle supersedes it
        return not self._p_reads(min(plan.attached_tokens, n) - local)

    def _p_reads(self, m: int) -> bool:
        """Whether P reads M tokens from D (vLLM skips reads below its recompute threshold)."""
        threshold = self.config.kv_recompute_threshold
        return m > 0 and not (threshold > 0 and m < threshold)

    def _receipt(self, plan: ReusePlan, n: int, local: int | None) -> Receipt:
        """M = max(0, min(C, N) − L), zero when below P's threshold (P then only notifies D)."""
        if plan.params is None or plan.release:
            return Receipt(plan.decision, 0, plan.verified_tokens, local, plan.cause)
        offered = min(plan.attached_tokens, n)
        m = max(0, offered - (local or 0))
        if local is not None and not self._p_reads(m):
            # P's own prefix cache covers what D offers: P reads nothing, D frees the blocks
            return Receipt("local", 0, plan.verified_tokens, local, plan.cause)
        return Receipt(plan.decision, m, plan.verified_tokens, local, plan.cause)

    async def _prefill(self, req: ClientRequest, ids: list[int], at: _Attempt) -> _Prefilled:
        """Run P with ``at.plan``; on the way ``at.plan`` loses a handle P may have started to
        read (released) and keeps one no P has seen (the caller puts it back on failure)."""
        cfg = self.config
        for _attempt in range(cfg.retries + 2):
            plan = at.plan
            engine, local = self._choose_prefill(req, ids, plan.params is not None)
            if engine is None and plan.params is not None:
                # no P can read it: put it back for a later turn
                self._spawn(self._restore(at.key, plan))
                at.plan = plan.without_handle("local")
                continue
            if engine is None:
                raise RouterError(503, "No healthy prefill instance.")
            if self._covered_locally(plan, len(ids), local):
                # P's own prefix cache already holds what this handle shares with the prompt,
                # and the handle holds more. After the client's rewrite that is history nobody
                # reads again: P only notifies D to free it. Otherwise it is another branch's
                # history: reading it would only spend it, so it stays for its branch.
                assert plan.params is not None
                if plan.cause == "rewrite":
                    at.plan = plan = replace(
                        plan, decision="local", params=plan.params.release_only(), release=True
                    )
                else:
                    self._spawn(self._restore(at.key, plan))
                    at.plan = plan = plan.without_handle("local")
            params = (
                plan.params.to_wire()
                if plan.params is not None
                else KVTransferParams.for_prefill().to_wire()
            )
            body: dict[str, Any] = {
                "prompt": wire_ids(ids),
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": params,
            }
            for key in ("model", "cache_salt", "priority"):
                if key in req.body:
                    body[key] = req.body[key]
            reads = plan.params is not None and not plan.release
            per_1k = cfg.prefill_deadline_per_1k_tokens_s
            timeout = cfg.prefill_deadline_s + len(ids) / 1000 * per_1k
            engine.outstanding_tokens += len(ids)
            started = time.perf_counter()
            try:
                r = await engine.client.post(
                    "/v1/completions", body, timeout=timeout, headers=trace_headers()
                )
            except Timeout:
                self.metrics.upstream_errors.labels("prefill", "timeout").inc()
                if reads:
                    log.warning(
                        "prefill read passed its deadline conv=%s: retrying without the handle",
                        safe(req.conversation_id),
                    )
                    self.metrics.retries.labels("deadline").inc()
                else:
                    log.warning("prefill %s passed its deadline: retrying on another", engine.url)
                    self.metrics.retries.labels("prefill_deadline").inc()
                    engine.failed(1)  # a stalled P: out of rotation until its check passes
                self._lost(at, "deadline")
                continue
            except TransportError:
                # never reached P (or P died): the handle is unread, keep it attached elsewhere
                self.metrics.upstream_errors.labels("prefill", "connect").inc()
                engine.failed(cfg.eject_after_failures)
                self.metrics.retries.labels("prefill_error").inc()
                continue
            finally:
                engine.outstanding_tokens -= len(ids)
                self.metrics.p_seconds.observe(time.perf_counter() - started)
            if r.status_code == 200:
                engine.ok()
                handle = r.json().get("kv_transfer_params")
                if not handle:
                    raise RouterError(
                        502, f"Prefill instance {engine.url} returned no kv_transfer_params."
                    )
                sim = sim_receipt(r.headers, {})
                receipt = self._receipt(plan, len(ids), local)
                return _Prefilled(_reachable(handle, engine), engine, receipt, sim)
            self.metrics.upstream_errors.labels("prefill", str(r.status_code)).inc()
            if r.status_code < 500 and r.status_code != 429:
                raise UpstreamError(r.status_code, r.content)
            if plan.params is not None and r.status_code != 429:
                # 500 with a handle (kv_load_failure_policy "fail"): once more, without it
                self.metrics.retries.labels("handle_failed").inc()
                self._lost(at, "prefill_failed")
                continue
            engine.failed(cfg.eject_after_failures)
            self.metrics.retries.labels("prefill_error").inc()
        raise RouterError(503, "No prefill instance answered.")

    def _lost(self, at: _Attempt, reason: str) -> None:
        """P failed with the handle attached: D still pins its blocks; free them, go on without."""
        if at.plan.taken is not None and not at.plan.release:
            self._spawn(self.release(at.plan.taken.handle, reason))
        at.plan = at.plan.without_handle()

    # -- 2-5. a turn --------------------------------------------------------------------------
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

    async def _plan(
        self, req: ClientRequest, key: StoreKey | None, hashes: PromptHashes
    ) -> ReusePlan:
        """Choose and take a handle; a handle another replica took first is skipped."""
        can_pull = any(e.healthy and e.backend.bidirectional for e in self.pool.prefill)
        candidates = []
        for candidate in await self.store.candidates(key) if key else []:
            readable = self._readable(candidate)
            if readable:
                candidates.append(candidate)
            elif readable is False and key is not None:
                self.metrics.dropped.labels("restarted").inc()
                self._spawn(self.store.take(key, candidate.handle.id))
        for _ in range(3):
            plan = plan_reuse(
                candidates,
                hashes,
                epoch=req.epoch,
                router_ttl_s=self.config.router_ttl_s,
                threshold=self.config.kv_recompute_threshold,
                can_pull=can_pull,
                verify=self.config.reuse_policy == "verified",
            )
            if key is not None:
                for gone in plan.expired:
                    self._spawn(self.store.take(key, gone.handle.id))
            if plan.taken is None or key is None:
                return plan
            taken = await self.store.take(key, plan.taken.handle.id)
            if taken is not None:
                self.metrics.handle_age.observe(taken.age_s)
                return replace(plan, taken=taken)
            candidates = [c for c in candidates if c.handle.id != plan.taken.handle.id]
        return ReusePlan("miss", None, 0, 0, False)

    async def _restore(self, key: StoreKey | None, plan: ReusePlan) -> None:
        """Put an unspent handle back (it keeps its age); a release-only plan releases it."""
        if key is None or plan.taken is None:
            return
        taken, ttl = plan.taken, self.config.decoder_kv_blocks_ttl_s
        displaced = await self.store.put(key, taken.handle, ttl, age_s=taken.age_s)
        for old in displaced:
            self._spawn(self.release(old, "displaced"))

    async def _turn(self, req: ClientRequest, span: trace.Span) -> Response:
        started = time.perf_counter()
        kept: Resolved = await self.identity.resolve(req, self.ask_tokenizer)
        ids = TokenIds(kept.ids) if kept.ids is not None else await self.prompt_ids(req)
        self._check_context(req, len(ids))
        key: StoreKey | None = (req.tenant, req.conversation_id) if req.conversation_id else None
        if key is not None and req.lease_s is not None:
            await self.retention.renew(key, req.lease_s)
        # the prompt is hashed once a turn: for verification, and again for what D will hold
        root = hash_root(req.body.get("model") or self.pool.served_model, req.cache_salt)
        hashes = PromptHashes(ids, self.config.block_size, root)
        plan = await self._plan(req, key, hashes)
        if plan.release and plan.taken is not None:
            self.metrics.released.labels(plan.decision).inc()
        tried: set[str] = set()
        holder = plan.taken.handle.decode_url if plan.taken else None
        for attempt in range(self.config.retries + 1):
            # a retry after D failed is a fresh P pass: P's own cache now holds the prompt
            at = _Attempt(plan if attempt == 0 else plan.without_handle(), key)
            try:
                pre = await self._prefill(req, ids, at)
            except (UpstreamError, RouterError):
                # no P accepted the request: the handle is not spent
                await self._restore(key, at.plan)
                raise
            if attempt > 0:
                # P's events of the earlier pass may not have reached the index yet: what P
                # found in its own cache on this pass is not known, so the receipt says estimated
                pre.receipt = replace(pre.receipt, local=None)
            candidates = [e for e in self.pool.decode if e.url not in tried] or self.pool.decode
            engine = pick_decode(candidates, holder)
            if engine is None:
                raise RouterError(503, "No healthy decode instance.")
            tried.add(engine.url)
            pre.receipt = replace(pre.receipt, identity=kept.outcome)
            try:
                response = await self._decode(req, hashes, pre, engine, key, started, kept.pending)
            except _BeforeFirstByte:
                self.metrics.retries.labels("decode_error").inc()
                continue
            account(self.metrics, req, ids, pre.receipt, pre.engine.url, engine.url, span, started)
            return response
        raise RouterError(502, "No decode instance answered.")

    # -- 4. decode ----------------------------------------------------------------------------
    async def _decode(
        self,
        req: ClientRequest,
        hashes: PromptHashes,
        pre: _Prefilled,
        engine: Upstream,
        key: StoreKey | None,
        started: float,
        pending: Pending | None = None,
    ) -> Response:
        ids = hashes.prompt
        body = req.copy_body()
        if req.chat:
            body["kv_transfer_params"] = dict(pre.params, prompt_token_ids=wire_ids(ids))
        else:
            body["prompt"] = wire_ids(ids)
            body["kv_transfer_params"] = pre.params
        body["return_token_ids"] = True
        headers = pre.receipt.headers()
        relay = req.stream and engine.backend.handle_on_stream
        if not relay:
            body["stream"] = False
            body.pop("stream_options", None)
        engine.outstanding_requests += 1
        t0 = time.perf_counter()
        first_byte = self._first_byte_deadline(req, len(ids), engine, relay)
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
                engine.failed(self.config.eject_after_failures)
            self.metrics.upstream_errors.labels("decode", kind).inc()
            raise _BeforeFirstByte() from None
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            engine.outstanding_requests -= 1
            self.metrics.upstream_errors.labels("decode", str(upstream.status_code)).inc()
            if upstream.status_code >= 500 or upstream.status_code == 429:
                engine.failed(self.config.eject_after_failures)
                raise _BeforeFirstByte()
            raise UpstreamError(upstream.status_code, content)
        engine.identify(upstream.headers.get(HEADER_SIM_ENGINE_ID))
        self.metrics.d_first_byte.observe(time.perf_counter() - t0)
        self.metrics.first_byte.labels(pre.receipt.decision).observe(time.perf_counter() - started)
        headers.update(sim_receipt(pre.sim_headers, upstream.headers))
        if not relay:
            try:
                data = orjson.loads(await upstream.aread())
            except (TransportError, orjson.JSONDecodeError):
                engine.failed(self.config.eject_after_failures)
                raise _BeforeFirstByte() from None
            finally:
                await upstream.aclose()
                engine.outstanding_requests -= 1
            engine.ok()
            captured = clean_response(
                data, keep_ids=req.wants_token_ids, keep_prompt_ids=req.wants_prompt_ids
            )
            await self._remember(req, key, hashes, captured, engine, pending)
            self.metrics.turn_seconds.labels(pre.receipt.decision).observe(
                time.perf_counter() - started
            )
            if req.stream:
                opts = req.body.get("stream_options") or {}
                chunks = synthesize_stream(
                    data, chat=req.chat, include_usage=bool(opts.get("include_usage"))
                )
                return StreamingResponse(
                    _iterate(chunks), media_type="text/event-stream", headers=headers
                )
            return ORJSONResponse(data, headers=headers)
        engine.ok()

        async def on_handle(captured: Captured) -> None:
            await self._remember(req, key, hashes, captured, engine, pending)

        def on_end(outcome: StreamOutcome) -> None:
            engine.outstanding_requests -= 1
            self.metrics.turn_seconds.labels(pre.receipt.decision).observe(
                time.perf_counter() - started
            )
            if outcome.failed:
                self.metrics.upstream_errors.labels("decode", "stream").inc()
                engine.failed(self.config.eject_after_failures)
            elif outcome.abandoned:
                self.metrics.abandoned.labels("drained" if outcome.drained else "aborted").inc()
            elif not outcome.done:
                log.warning(
                    "decode stream ended without [DONE] conversation=%s", safe(req.conversation_id)
                )

        stream = self.relay.stream(
            upstream,
            keep_ids=req.wants_token_ids,
            keep_prompt_ids=req.wants_prompt_ids,
            on_handle=on_handle,
            on_end=on_end,
            accumulate=pending is not None,
        )
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    def _first_byte_deadline(
        self, req: ClientRequest, n: int, engine: Upstream, relay: bool
    ) -> float:
        """How long D may take to its first byte: a stream's first chunk, or a non-streamed
        answer whole (vLLM sends its headers with the body)."""
        cfg = self.config
        if relay:
            return cfg.decode_first_byte_timeout_s
        most = req.body.get("max_completion_tokens") or req.body.get("max_tokens")
        if not isinstance(most, int):
            most = max(1, (engine.max_model_len or n + 32_768) - n)
        return cfg.decode_first_byte_timeout_s + most * cfg.decode_token_timeout_s

    # -- 5. remember --------------------------------------------------------------------------
    async def _remember(
        self,
        req: ClientRequest,
        key: StoreKey | None,
        prompt: PromptHashes,
        captured: Captured,
        engine: Upstream,
        pending: Pending | None = None,
    ) -> None:
        if pending is not None:
            # before the client can see the end of the turn (and send the next one)
            await self.identity.record(
                pending, prompt.ids(), captured.output_ids, captured.assistant_message()
            )
        handle = captured.handle
        try:
            parsed = KVTransferParams.from_wire(handle) if handle else None
        except ValidationError:
            log.warning("decode %s returned a handle of an unknown shape: not kept", engine.url)
            return
        if handle is None or parsed is None or not parsed.has_blocks:
            return
        engine.identify(kvt.engine_id(handle))  # before it is stored: a new engine drops the old
        num = parsed.num_tokens
        bs = self.config.block_size
        held = held_record(captured.output_ids, num, prompt)
        stored = StoredHandle(
            params=_reachable(handle, engine),
            block_hashes=held.digests,
            tail_tokens=held.tail,
            num_tokens=num,
            block_size=bs,
            epoch=req.epoch,
            decode_url=engine.url,
            root=prompt.root,
            prefix_digest=held.prefix,
        )
        if key is None:
            self._spawn(self.release(stored, "anonymous"))
            return
        displaced = await self.store.put(key, stored, self.config.decoder_kv_blocks_ttl_s)
        for old in displaced:
            self._spawn(self.release(old, "displaced" if old is not stored else "store_down"))


class _BeforeFirstByte(Exception):
    """D failed before sending anything: the turn can be retried."""


async def _iterate(chunks: Any) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
