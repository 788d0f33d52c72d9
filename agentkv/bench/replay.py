"""Replay scripted sessions through the SDK against a router, one policy at a time.

Each session runs as an :class:`agentkv.AsyncConversation` in exact mode: messages are added,
stripped and rewritten as the script says (:mod:`agentkv.bench.content`), every turn streams
(the wall-clock TTFT is the first token's arrival) and its receipt gives the router's decision
and the tokens prefill did not compute. The simulator's receipt headers (modelled TTFT,
wrong-KV tokens), which the router forwards, are read with an ``httpx`` response hook. With
``settings.client`` other than ``sdk`` the same turns go through a raw HTTP client instead
(:mod:`agentkv.bench.replay_raw`).

Policies:

* ``agentkv``: one conversation id and epoch per session, verified reuse (agentkv's router);
* ``unverified``: the same requests to a router with ``paths.reuse_policy = "unverified"`` (vLLM's
  example proxy: the conversation's handle is attached whatever the prompt);
* ``none``: no reuse, the published baseline: a fresh conversation id every turn, released
  right after the turn (``close()``), so nothing is read back and D holds nothing between turns;
* ``lease``: agentkv's router with retention leases, on a deployment whose D keeps blocks for
  ``lease.max_hold_s``: each agent is an ``AsyncClient(lease_s=…)`` that renews its lease while
  it is alive (tool waits: always; user waits: until the UI idle timeout ``lease.ui_idle_s``) and
  dies without releasing anything (its client closed, renewals stop) when the UI idle timeout
  passes and after its last turn; the router frees D's blocks when the lease lapses. A session
  that comes back after its agent died resumes the same conversation in a new client.

Under every policy but ``none`` a session ends as most agents do: without ``close()`` (D's timer,
or the lapsed lease, frees its last blocks).

What each turn records, its ideal reuse and its modelled retention:
:mod:`agentkv.bench.replay_records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentkv.bench.replay_records import (
    Policy,
    ReplaySettings,
    SessionScript,
    TurnRecord,
    ideal_tokens,
    session_done,
    start_record,
)
from agentkv.protocol import HEADER_CONVERSATION_ID, Metric

__all__ = ["PolicyRun", "replay_policy", "wait_drained"]


@dataclass
class _Capture:
    """Response headers of each conversation's last chat request."""

    headers: dict[str, dict[str, str]] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)
    """When each conversation's last chat request left (``perf_counter``)."""

    async def on_request(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            conv = request.headers.get(HEADER_CONVERSATION_ID)
            if conv:
                self.sent[conv] = time.perf_counter()

    async def hook(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            conv = response.request.headers.get(HEADER_CONVERSATION_ID)
            if conv:
                self.headers[conv] = {k.lower(): v for k, v in response.headers.items()}


class _Agents:
    """The SDK clients of one policy's run: one client for every session, or (``lease``) one
    client per agent life, so that an agent's death stops its lease renewals and nothing else."""

    def __init__(self, base_url: str, api_key: str, capture: _Capture, settings: ReplaySettings):
        self.base_url, self.api_key, self.capture, self.settings = (
            base_url,
            api_key,
            capture,
            settings,
        )
        self.lease_s = (
            None if settings.lease is None else settings.lease.lease_s * settings.time_scale
        )
        self._shared: Any = None
        self.deaths = 0
        self.last_death = 0.0
        """``perf_counter`` of the last agent's death (``lease``)."""

    def _http(self) -> httpx.AsyncClient:
        per_client = 2 if self.lease_s is not None else max(8, self.settings.concurrency)
        return httpx.AsyncClient(
            event_hooks={"request": [self.capture.on_request], "response": [self.capture.hook]},
            timeout=self.settings.request_timeout_s,
            trust_env=False,
            limits=httpx.Limits(max_connections=2 * per_client),
        )

    def _new(self) -> Any:
        import agentkv

        return agentkv.AsyncClient(
            base_url=self.base_url,
            api_key=self.api_key,
            http_client=self._http(),
            lease_s=self.lease_s,
        )

    async def __aenter__(self) -> _Agents:
        if self.lease_s is None:
            self._shared = self._new()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._shared is not None:
            await self._shared.aclose()

    def born(self) -> Any:
        """A client for an agent that starts (or comes back)."""
        return self._shared if self._shared is not None else self._new()

    async def died(self, client: Any) -> None:
        """The agent is gone: its renewals stop, nothing is released (``lease``)."""
        if client is not self._shared:
            await client.aclose()
            self.deaths += 1
            self.last_death = time.perf_counter()


async def _run_session(
    agents: _Agents,
    script: SessionScript,
    policy: Policy,
    salt: str,
    t0: float,
    on_turn: Callable[[TurnRecord], None],
) -> list[TurnRecord]:
    settings, capture = agents.settings, agents.capture
    records: list[TurnRecord] = []
    base_id = f"bench-{policy}-{script.id}-{uuid.uuid4().hex[:8]}"
    client = agents.born()
    conv = client.conversation(
        base_id, model=settings.model, chat_template_kwargs=settings.chat_template_kwargs
    )
    held: list[int] = []
    answered = time.perf_counter()  # when the previous answer ended
    render_s = 0.0  # how long the SDK took from create() to sending, last turn
    tool_wait = False  # the previous answer ended in a tool call
    for turn in script.turns:
        rec = start_record(policy, script.id, turn, settings, tool_wait=tool_wait)
        gap_real = rec.gap_real_s
        lease = settings.lease
        if turn.index and lease is not None and not tool_wait and turn.gap_s > lease.ui_idle_s:
            # a user wait past the UI idle timeout: the agent dies then, and comes back later
            idle_end = answered + lease.ui_idle_s * settings.time_scale
            await asyncio.sleep(max(0.0, idle_end - time.perf_counter()))
            state = conv.to_state()
            await agents.died(client)
            client = agents.born()
            conv = client.resume(state)
        # the request should reach the router `gap_real` after the previous answer ended
        wait = answered + gap_real - render_s - time.perf_counter()
        if turn.index and wait > 0:
            await asyncio.sleep(wait)
        if turn.keep is not None:
            kept = conv.messages[: turn.keep]
            conv.rewrite([*kept, *({"role": m.role, "content": m.content} for m in turn.add)])
        else:
            if turn.strip:
                conv.strip_reasoning()
            for m in turn.add:
                conv.add({"role": m.role, "content": m.content})
        if policy == "none":
            conv = client.resume({**conv.to_state(), "id": f"{base_id}-t{turn.index}"})
        rec.started_s = time.perf_counter() - t0
        started = time.perf_counter()
        capture.sent.pop(conv.id, None)
        try:
            stream = await conv.create(
                stream=True,
                max_tokens=turn.output_tokens + settings.extra_output_tokens,
                extra_body={"agentkv_sim": turn.sim_script, "cache_salt": salt},
            )
            async for chunk in stream:
                if rec.wall_ttft_ms is None and chunk.choices:
                    delta = chunk.choices[0].delta
                    extra = delta.model_extra or {}
                    if delta.content or extra.get("reasoning") or extra.get("reasoning_content"):
                        rec.wall_ttft_ms = (time.perf_counter() - started) * 1000
            receipt = stream.receipt
            answered = time.perf_counter()
            render_s = max(0.0, capture.sent.get(conv.id, started) - started)
        except Exception as exc:  # recorded; the session stops here
            rec.record_error(exc)
            records.append(rec)
            on_turn(rec)
            break
        rec.latency_ms = (time.perf_counter() - started) * 1000
        assert receipt is not None
        ids = list(conv.token_ids or [])
        prompt = ids[: len(ids) - receipt.completion_tokens]
        rec.prompt_tokens = len(prompt)
        rec.output_tokens = receipt.completion_tokens
        rec.held_tokens = len(held)
        ideal, lcp = ideal_tokens(prompt, held, settings.block_size) if held else (0, 0)
        rec.lcp_tokens = lcp
        rec.reusable_tokens = ideal
        rec.ideal_tokens = ideal if rec.within_ttl else 0
        rec.read_reuse(receipt.decision or "", receipt.cached_tokens)
        if rec.decision == "cpu":  # D's CPU tier held it past the TTL: reusable after all
            rec.ideal_tokens = ideal
        rec.router_reused_tokens = receipt.reused_tokens or 0
        rec.read_headers(capture.headers.pop(conv.id, {}))
        rec.verified_tokens = receipt.verified_prefix_tokens or 0
        held = ids[:-1]
        rec.retained_blocks = math.ceil(len(held) / settings.block_size)
        tool_wait = turn.trace.tool_call
        if policy == "none":
            await conv.aclose()
        records.append(rec)
        on_turn(rec)
    # the agent leaves without close(): D's timer, or the lapsed lease, frees its last blocks
    await agents.died(client)
    return session_done(records, settings, script)


@dataclass
class PolicyRun:
    """One policy's replay: its turns, and when its last agent died (``lease``)."""

    records: list[TurnRecord]
    last_death: float | None = None
    """``perf_counter`` of the last agent's death (renewals stopped), under ``lease``."""


async def replay_policy(
    scripts: Sequence[SessionScript],
    base_url: str,
    policy: Policy,
    settings: ReplaySettings,
    *,
    api_key: str = "agentkv-bench",
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> PolicyRun:
    """Replay every session under ``policy`` against the router at ``base_url``; at most
    ``settings.concurrency`` sessions at once. A per-run ``cache_salt`` keeps runs from
    finding each other's blocks in the engines' prefix caches. ``policy == "lease"`` needs
    ``settings.lease``."""
    if (policy == "lease") != (settings.lease is not None):
        raise ValueError("the lease policy, and only it, replays with settings.lease")
    if policy == "lease" and settings.client != "sdk":
        raise ValueError("leases are the SDK's (X-AgentKV-Lease): no raw client sends them")
    salt = f"bench-{policy}-{uuid.uuid4().hex[:12]}"
    gate = asyncio.Semaphore(max(1, settings.concurrency))
    t0 = time.perf_counter()
    notify = on_turn or (lambda _r: None)
    run_one: Callable[[SessionScript], Awaitable[list[TurnRecord]]]

    async def one(script: SessionScript) -> list[TurnRecord]:
        if settings.honor_starts and script.start_s > 0:
            wait = script.start_s * settings.time_scale - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
        async with gate:
            return await run_one(script)

    if settings.client != "sdk":
        from agentkv.bench.replay_raw import RawClients

        async with RawClients(settings.client, base_url, api_key, settings) as raw:

            def run_one(s: SessionScript) -> Awaitable[list[TurnRecord]]:
                return raw.run_session(s, policy, salt, t0, notify)

            results = await asyncio.gather(*(one(s) for s in scripts))
        return PolicyRun([r for session in results for r in session])
    capture = _Capture()
    async with _Agents(base_url, api_key, capture, settings) as agents:

        def run_one(s: SessionScript) -> Awaitable[list[TurnRecord]]:
            return _run_session(agents, s, policy, salt, t0, notify)

        results = await asyncio.gather(*(one(s) for s in scripts))
    records = [r for session in results for r in session]
    return PolicyRun(records, agents.last_death if agents.deaths else None)


async def wait_drained(decode_urls: Sequence[str], timeout_s: float) -> bool:
    """Wait until no decode instance retains blocks for a next turn."""
    from agentkv.protocol.promtext import parse_metrics

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        while True:
            total = 0.0
            for url in decode_urls:
                with contextlib.suppress(httpx.HTTPError):
                    text = (await client.get(f"{url}/metrics")).text
                    total += parse_metrics(text).get(Metric.SIM_RETAINED_BLOCKS, 0.0)
            if total == 0:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.25)
