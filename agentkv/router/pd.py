"""One turn through P and D, with verified reuse and faults degraded to recompute.

1. **Prompt ids**: the client's exact ids, or P's ``/tokenize`` of the same messages; both P and
   D then get these ids, so all agree.
2. **Handle**: take the conversation's stored D handle (single use) and decide
   (:func:`~agentkv.router.verify.plan_reuse`): attach it trimmed to the verified prefix, release
   it (``remote_num_tokens: 0``), or drop it (expired, no bidirectional P).
3. **P** (``/v1/completions``, the ids, ``max_tokens: 1``): a request that reads a handle has a
   deadline and is retried without it when it passes (real vLLM 0.32 never answers a read of an
   expired handle); a 500 with a handle is retried once without it; failures move to another P.
4. **D**: the client's request with P's params and the ids, streamed as the client asked; a D
   failing before its first byte is retried on another D after a fresh P pass.
5. **Remember** D's handle with the hashes of the blocks it holds, keyed by (tenant,
   conversation id); handles it displaces, and those of turns without a conversation id, are
   released at once so D does not pin their blocks until its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from opentelemetry import trace
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentkv.protocol import (
    HEADER_DECISION,
    HEADER_REUSED_TOKENS,
    HEADER_SIM_MODEL_TTFT_MS,
    HEADER_SIM_WRONG_KV_TOKENS,
    HEADER_VERIFIED_PREFIX_TOKENS,
    KVTransferParams,
)
from agentkv.router.config import RouterConfig
from agentkv.router.metrics import RouterMetrics
from agentkv.router.request import ClientRequest, RouterError
from agentkv.router.sse import Captured, clean_response, rewrite_chunk, sse, synthesize_stream
from agentkv.router.store import HandleStore, StoredHandle, StoreKey
from agentkv.router.upstream import Engine, EnginePool, pick_decode, pick_prefill
from agentkv.router.verify import Plan, held_record, plan_reuse

__all__ = ["Router", "UpstreamError"]

log = logging.getLogger("agentkv.router")
_tracer = trace.get_tracer("agentkv.router")
_LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "0.0.0.0", "::1"}


class UpstreamError(Exception):
    """An engine's own client error (4xx), passed to the client unchanged."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


@dataclass
class _Prefilled:
    params: dict[str, Any]
    engine: Engine
    plan: Plan
    sim_headers: dict[str, str] = field(default_factory=dict)
    """P's simulator receipt headers (agentkv's engine simulator only)."""


def _sim_receipt(prefill: Mapping[str, str], decode: Mapping[str, str]) -> dict[str, str]:
    """The turn's simulator receipt from P's and D's (absent with real vLLM): the modelled TTFT
    is P's plus D's, the wrong-KV tokens the larger count (D's wrong tokens are those it pulled
    from a P that read wrong KV, plus its own poisoned prefix cache)."""
    out: dict[str, str] = {}
    ttft = [
        float(h[HEADER_SIM_MODEL_TTFT_MS])
        for h in (prefill, decode)
        if HEADER_SIM_MODEL_TTFT_MS in h
    ]
    if ttft:
        out[HEADER_SIM_MODEL_TTFT_MS] = f"{sum(ttft):.3f}"
    wrong = [
        int(h[HEADER_SIM_WRONG_KV_TOKENS])
        for h in (prefill, decode)
        if HEADER_SIM_WRONG_KV_TOKENS in h
    ]
    if wrong:
        out[HEADER_SIM_WRONG_KV_TOKENS] = str(max(wrong))
    return out


def _reachable(params: dict[str, Any], engine: Engine) -> dict[str, Any]:
    """The handle with a ``remote_host`` its reader can reach."""
    out = dict(params)
    host = engine.backend.side_channel_host
    if host is None and str(out.get("remote_host") or "") in _LOCAL_HOSTS:
        url_host = urlsplit(engine.url).hostname or ""
        host = url_host if url_host not in _LOCAL_HOSTS else None
    if host:
        out["remote_host"] = host
    return out


class Router:
    """The P/D orchestration of one router process."""

    def __init__(
        self, config: RouterConfig, pool: EnginePool, store: HandleStore, metrics: RouterMetrics
    ) -> None:
        self.config, self.pool, self.store, self.metrics = config, pool, store, metrics
        self._background: set[asyncio.Task[None]] = set()
        for engine in pool.decode:
            engine.on_eject.append(self._drop_handles_of)

    # -- background work -------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def _drop_handles_of(self, engine: Engine) -> None:
        async def drop() -> None:
            n = await self.store.drop_decode(engine.url)
            if n:
                log.warning("dropped %d handles of ejected decode %s", n, engine.url)

        self._spawn(drop())

    async def release(self, handle: StoredHandle, reason: str) -> None:
        """Tell D to free a handle's blocks now: a notify-only P request."""
        engine = pick_prefill(self.pool.prefill, None, cap_tokens=1 << 62, need_bidirectional=True)
        if engine is None:
            return
        params = dict(
            handle.params, do_remote_decode=True, do_remote_prefill=False, remote_num_tokens=0
        )
        body = {
            "prompt": handle.tail_tokens[:1] or [0],
            "max_tokens": 1,
            "kv_transfer_params": params,
        }
        try:
            r = await engine.client.post(
                "/v1/completions", json=body, timeout=self.config.prefill_deadline_s
            )
            if r.status_code == 200:
                self.metrics.released.labels(reason).inc()
        except httpx.HTTPError:
            self.metrics.upstream_errors.labels("prefill", "release").inc()

    async def close_conversation(self, tenant: str, conversation_id: str) -> bool:
        handle = await self.store.delete((tenant, conversation_id))
        if handle is None:
            return False
        await self.release(handle, "closed")
        return True

    # -- 1. prompt ids -----------------------------------------------------------------------
    async def prompt_ids(self, req: ClientRequest) -> list[int]:
        if req.prompt_ids is not None:
            return req.prompt_ids
        engines = self.pool.prefill if self.config.tokenize_with == "prefill" else self.pool.decode
        candidates = [e for e in engines if e.healthy] or list(engines)
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
        last: Exception | None = None
        for engine in candidates[: self.config.retries + 1]:
            try:
                r = await engine.client.post("/tokenize", json=body)
            except httpx.HTTPError as exc:
                engine.failed(self.config.eject_after_failures)
                last = exc
                continue
            if r.status_code == 200:
                return [int(t) for t in r.json()["tokens"]]
            if r.status_code < 500:
                raise UpstreamError(r.status_code, r.content)
            last = RuntimeError(f"/tokenize answered {r.status_code}")
        raise RouterError(503, f"Could not tokenize the prompt: {last!r}")

    # -- 3. prefill --------------------------------------------------------------------------
    async def _prefill(self, req: ClientRequest, ids: list[int], plan: Plan) -> _Prefilled:
        cfg = self.config
        for _attempt in range(cfg.retries + 2):
            engine = pick_prefill(
                self.pool.prefill,
                req.conversation_id,
                cap_tokens=cfg.affinity_max_outstanding_tokens,
                need_bidirectional=plan.params is not None,
            )
            if engine is None and plan.params is not None:
                plan = Plan("local", None, 0, plan.verified_tokens, False)
                continue
            if engine is None:
                raise RouterError(503, "No healthy prefill instance.")
            params = (
                plan.params if plan.params is not None else KVTransferParams.for_prefill().to_wire()
            )
            body: dict[str, Any] = {
                "prompt": ids,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": params,
            }
            for key in ("model", "cache_salt", "priority"):
                if key in req.body:
                    body[key] = req.body[key]
            reads = plan.params is not None and not plan.release
            timeout = cfg.prefill_deadline_s if reads else cfg.request_timeout_s
            engine.outstanding_tokens += len(ids)
            started = time.perf_counter()
            try:
                r = await engine.client.post("/v1/completions", json=body, timeout=timeout)
            except httpx.TimeoutException:
                self.metrics.upstream_errors.labels("prefill", "timeout").inc()
                if reads:
                    log.warning(
                        "prefill read passed its deadline conv=%s: retrying without the handle",
                        req.conversation_id,
                    )
                    self.metrics.retries.labels("deadline").inc()
                else:
                    engine.failed(cfg.eject_after_failures)
                plan = Plan("recompute", None, 0, plan.verified_tokens, False)
                continue
            except httpx.HTTPError:
                self.metrics.upstream_errors.labels("prefill", "connect").inc()
                engine.failed(cfg.eject_after_failures)
                plan = (
                    Plan("recompute", None, 0, plan.verified_tokens, False) if plan.params else plan
                )
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
                sim = _sim_receipt(r.headers, {})
                return _Prefilled(_reachable(handle, engine), engine, plan, sim)
            self.metrics.upstream_errors.labels("prefill", str(r.status_code)).inc()
            if r.status_code < 500 and r.status_code != 429:
                raise UpstreamError(r.status_code, r.content)
            if plan.params is not None:
                # 500 with a handle (kv_load_failure_policy "fail"): once more, without it
                self.metrics.retries.labels("handle_failed").inc()
                plan = Plan("recompute", None, 0, plan.verified_tokens, False)
                continue
            engine.failed(cfg.eject_after_failures)
            self.metrics.retries.labels("prefill_error").inc()
        raise RouterError(503, "No prefill instance answered.")

    # -- 2-5. a turn --------------------------------------------------------------------------
    async def turn(self, req: ClientRequest) -> Response:
        attrs = {
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
        started = time.perf_counter()
        ids = await self.prompt_ids(req)
        key: StoreKey | None = (req.tenant, req.conversation_id) if req.conversation_id else None
        taken = await self.store.take(key) if key else None
        if taken is not None:
            self.metrics.handle_age.observe(taken.age_s)
        can_pull = any(e.healthy and e.backend.bidirectional for e in self.pool.prefill)
        plan = plan_reuse(
            taken.handle if taken else None,
            taken.age_s if taken else 0.0,
            ids,
            epoch=req.epoch,
            router_ttl_s=self.config.router_ttl_s,
            threshold=self.config.kv_recompute_threshold,
            can_pull=can_pull,
            verify=self.config.reuse_policy == "verified",
        )
        self.metrics.verified_tokens.inc(plan.verified_tokens)
        if plan.release:
            self.metrics.released.labels(plan.decision).inc()
        tried: set[str] = set()
        for attempt in range(self.config.retries + 1):
            pre = await self._prefill(
                req, ids, plan if attempt == 0 else Plan("recompute", None, 0, 0, False)
            )
            if attempt == 0:
                if plan.params is not None and pre.plan.params is None and taken is not None:
                    # P failed with the handle attached: D still pins its blocks; free them
                    self._spawn(self.release(taken.handle, "prefill_failed"))
                plan = pre.plan
            holder = taken.handle.decode_url if taken else None
            candidates = [e for e in self.pool.decode if e.url not in tried] or self.pool.decode
            engine = pick_decode(candidates, holder)
            if engine is None:
                raise RouterError(503, "No healthy decode instance.")
            tried.add(engine.url)
            try:
                response = await self._decode(req, ids, pre, engine, key, plan, started)
            except _BeforeFirstByte:
                self.metrics.retries.labels("decode_error").inc()
                continue
            self.metrics.requests.labels("chat" if req.chat else "completions", plan.decision).inc()
            self.metrics.reused_tokens.inc(plan.reused_tokens)
            span.set_attributes(
                {
                    "agentkv.decision": plan.decision,
                    "agentkv.reused_tokens": plan.reused_tokens,
                    "agentkv.verified_prefix_tokens": plan.verified_tokens,
                    "agentkv.prompt_tokens": len(ids),
                    "agentkv.prefill.url": pre.engine.url,
                    "agentkv.decode.url": engine.url,
                }
            )
            log.info(
                "turn conversation=%s tenant=%s epoch=%d decision=%s reused=%d verified=%d "
                "prompt_tokens=%d prefill=%s decode=%s ms=%.1f",
                req.conversation_id,
                req.tenant,
                req.epoch,
                plan.decision,
                plan.reused_tokens,
                plan.verified_tokens,
                len(ids),
                pre.engine.url,
                engine.url,
                (time.perf_counter() - started) * 1000,
            )
            return response
        raise RouterError(502, "No decode instance answered.")

    # -- 4. decode ----------------------------------------------------------------------------
    async def _decode(
        self,
        req: ClientRequest,
        ids: list[int],
        pre: _Prefilled,
        engine: Engine,
        key: StoreKey | None,
        plan: Plan,
        started: float,
    ) -> Response:
        body = req.copy_body()
        if req.chat:
            body["kv_transfer_params"] = dict(pre.params, prompt_token_ids=ids)
        else:
            body["prompt"] = ids
            body["kv_transfer_params"] = pre.params
        body["return_token_ids"] = True
        headers = {
            HEADER_DECISION: plan.decision,
            HEADER_REUSED_TOKENS: str(plan.reused_tokens),
            HEADER_VERIFIED_PREFIX_TOKENS: str(plan.verified_tokens),
        }
        relay = req.stream and engine.backend.handle_on_stream
        if not relay:
            body["stream"] = False
            body.pop("stream_options", None)
        engine.outstanding_requests += 1
        t0 = time.perf_counter()
        try:
            request = engine.client.build_request("POST", req.path, json=body)
            upstream = await engine.client.send(request, stream=True)
        except httpx.HTTPError:
            engine.outstanding_requests -= 1
            engine.failed(self.config.eject_after_failures)
            self.metrics.upstream_errors.labels("decode", "connect").inc()
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
        self.metrics.d_first_byte.observe(time.perf_counter() - t0)
        headers.update(_sim_receipt(pre.sim_headers, upstream.headers))
        if not relay:
            try:
                data = orjson.loads(await upstream.aread())
            except (httpx.HTTPError, orjson.JSONDecodeError):
                engine.failed(self.config.eject_after_failures)
                raise _BeforeFirstByte() from None
            finally:
                await upstream.aclose()
                engine.outstanding_requests -= 1
            engine.ok()
            captured = clean_response(data, keep_ids=req.wants_token_ids)
            await self._remember(req, key, ids, captured, engine)
            self.metrics.turn_seconds.observe(time.perf_counter() - started)
            if req.stream:
                opts = req.body.get("stream_options") or {}
                chunks = synthesize_stream(
                    data, chat=req.chat, include_usage=bool(opts.get("include_usage"))
                )
                return StreamingResponse(
                    _iterate(chunks), media_type="text/event-stream", headers=headers
                )
            return JSONResponse(data, headers=headers)
        engine.ok()
        return StreamingResponse(
            self._relay(req, ids, upstream, engine, key, started),
            media_type="text/event-stream",
            headers=headers,
        )

    async def _relay(
        self,
        req: ClientRequest,
        ids: list[int],
        upstream: httpx.Response,
        engine: Engine,
        key: StoreKey | None,
        started: float,
    ) -> AsyncIterator[bytes]:
        captured = Captured()
        done = remembered = False
        try:
            async for line in upstream.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload.strip() == "[DONE]":
                    done = True
                    yield sse("[DONE]")
                    continue
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                out = sse(rewrite_chunk(chunk, captured, keep_ids=req.wants_token_ids))
                if captured.handle is not None and not remembered:
                    # D's handle comes on the finish_reason chunk, with the last token: store it
                    # before the client sees the end and can send its next turn
                    remembered = True
                    await self._remember(req, key, ids, captured, engine)
                yield out
        except httpx.HTTPError:
            self.metrics.upstream_errors.labels("decode", "stream").inc()
            engine.failed(self.config.eject_after_failures)
            raise
        finally:
            await upstream.aclose()
            engine.outstanding_requests -= 1
            self.metrics.turn_seconds.observe(time.perf_counter() - started)
        if not done:
            log.warning("decode stream ended without [DONE] conversation=%s", req.conversation_id)

    # -- 5. remember --------------------------------------------------------------------------
    async def _remember(
        self,
        req: ClientRequest,
        key: StoreKey | None,
        ids: list[int],
        captured: Captured,
        engine: Engine,
    ) -> None:
        handle = captured.handle
        if not handle or not handle.get("remote_block_ids"):
            return
        num = int(handle.get("remote_num_tokens") or 0)
        hashes, tail = held_record([*ids, *captured.output_ids], num, self.config.block_size)
        stored = StoredHandle(
            params=_reachable(handle, engine),
            block_hashes=hashes,
            tail_tokens=tail,
            num_tokens=num,
            block_size=self.config.block_size,
            epoch=req.epoch,
            decode_url=engine.url,
        )
        if key is None:
            self._spawn(self.release(stored, "anonymous"))
            return
        displaced = await self.store.put(key, stored, self.config.decoder_kv_blocks_ttl_s)
        for old in displaced:
            self._spawn(self.release(old, "displaced"))


class _BeforeFirstByte(Exception):
    """D failed before sending anything: the turn can be retried."""


async def _iterate(chunks: Any) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
