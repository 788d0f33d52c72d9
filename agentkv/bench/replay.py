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
* ``unverified``: the same requests to a router with ``reuse_policy = "unverified"`` (vLLM's
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

Every turn's **ideal** reuse is computed on the wire: the longest common prefix of the new
prompt and what D holds from the previous turn (its prompt and output but the last token), all
of it when the prompt repeats all of it, else cut to whole blocks, never the last prompt token;
and only when the trace's gap is within the router's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from agentkv.bench.content import ScriptedTurn
from agentkv.bench.retention import LeaseParams, lease_hold_for
from agentkv.bench.wire import HEADER_IDENTITY, ClientName
from agentkv.protocol import (
    HEADER_CONVERSATION_ID,
    HEADER_SIM_MODEL_TTFT_MS,
    HEADER_SIM_WRONG_KV_TOKENS,
    HEADER_TRIM_CAUSE,
    Metric,
)

__all__ = [
    "POLICIES",
    "Policy",
    "PolicyRun",
    "ReplaySettings",
    "SessionScript",
    "TurnRecord",
    "ideal_tokens",
    "modelled_retention",
    "real_gap",
    "replay_policy",
    "wait_drained",
]

Policy = Literal["none", "unverified", "agentkv", "lease"]
POLICIES: tuple[Policy, ...] = ("none", "unverified", "agentkv", "lease")


@dataclass(frozen=True)
class SessionScript:
    """One session to replay."""

    id: str
    turns: Sequence[ScriptedTurn]
    start_s: float = 0.0
    """Trace seconds after the run's start before the session may begin (Mooncake)."""
    next_gap_s: float | None = None
    """The trace's gap after the last replayed turn when the session was cut short (None: the
    session ends there)."""


@dataclass(frozen=True)
class ReplaySettings:
    """How to replay (times are trace seconds unless named ``_real``)."""

    model: str
    block_size: int = 16
    time_scale: float = 1.0
    """Real seconds per trace second for the gaps."""
    router_ttl_s: float = 450.0
    decoder_ttl_s: float = 480.0
    gap_cap_real_s: float | None = None
    """Longer real gaps are shortened to this (the handle has expired either way)."""
    concurrency: int = 8
    honor_starts: bool = False
    """Start sessions at their trace start times (scaled), not as soon as a slot is free."""
    request_timeout_s: float = 600.0
    extra_output_tokens: int = 16
    """``max_tokens`` = the scripted answer's words + this (template tags, end of turn)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=lambda: {"enable_thinking": False})
    """Thinking off: an answer is its content only, so a re-rendered history (after a strip or
    rewrite) is token-identical to the exact one up to the change; scripted reasoning is still
    written as a think block, which the strip removes."""
    lease: LeaseParams | None = None
    """The ``lease`` policy's liveness model (trace seconds); ``router_ttl_s`` and
    ``decoder_ttl_s`` are then its deployment's (D's TTL ``lease.max_hold_s``)."""
    client: ClientName = "sdk"
    """Who sends the turns: agentkv's SDK (exact mode), or a raw HTTP client that knows nothing
    of agentkv (``chat``, ``messages``, ``responses``: :mod:`agentkv.bench.wire`)."""

    def reuse_until_s(self, tool_wait: bool) -> float:
        """The longest gap after which the next turn still finds the KV held."""
        if self.lease is None:
            return self.router_ttl_s
        return min(self.router_ttl_s, lease_hold_for(tool_wait, self.lease).reuse_until_s)

    def hold_s(self, tool_wait: bool) -> float:
        """How long D holds a wait's KV when the next turn does not come in time."""
        if self.lease is None:
            return self.decoder_ttl_s
        return min(self.decoder_ttl_s, lease_hold_for(tool_wait, self.lease).paid_s)

    @property
    def tail_hold_s(self) -> float:
        """How long D holds a session's last blocks (its agent gone without ``close()``)."""
        return self.decoder_ttl_s if self.lease is None else self.lease.lease_s


@dataclass
class TurnRecord:
    """One turn of one session under one policy (a row of the CSV)."""

    policy: str
    session: str
    turn: int
    kind: str
    gap_trace_s: float
    gap_real_s: float
    within_ttl: bool
    """The gap is short enough for the policy to still hold the KV (the router's TTL; with
    leases, the agent's liveness too)."""
    trace_input_tokens: int
    trace_output_tokens: int
    tool_call: bool = False
    """The trace's response ended in a tool call: the wait after this turn is a tool wait."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    held_tokens: int = 0
    """Tokens D held from the previous turn."""
    ideal_tokens: int = 0
    """What a verifying router could let prefill read (0 when the gap is beyond the TTL)."""
    lcp_tokens: int = 0
    """Common prefix of the prompt and what D held, whatever the gap."""
    reusable_tokens: int = 0
    """The ideal whatever the gap: what any retention policy could let prefill read."""
    decision: str = ""
    router_reused_tokens: int = 0
    """``X-AgentKV-Reused-Tokens``: what the router attached."""
    reused_tokens: int = 0
    """Prompt tokens prefill did not compute (``usage.prompt_tokens_details.cached_tokens``)."""
    recomputed_tokens: int = 0
    wrong_kv_tokens: int | None = None
    model_ttft_ms: float | None = None
    wall_ttft_ms: float | None = None
    latency_ms: float = 0.0
    expired: bool = False
    """The previous turn's handle had expired (``expired``, or ``miss``: the router's store
    had dropped it at its TTL)."""
    retained_blocks: int = 0
    """Blocks D holds after this turn for the next one."""
    retained_block_s: float = 0.0
    """Blocks × trace seconds D holds them (modelled from the gaps, see ``modelled_retention``)."""
    held_to_ttl: bool = False
    """D held them until it freed them unread (its TTL, or a lapsed lease): the next turn came
    too late, or never."""
    started_s: float = 0.0
    """Real seconds since the policy's run began."""
    error: str | None = None
    client: str = "sdk"
    """Who sent the turn (``sdk``, ``chat``, ``messages``, ``responses``)."""
    verified_tokens: int = 0
    """``X-AgentKV-Verified-Prefix-Tokens``: what D's handle held for this prompt."""
    trim_cause: str | None = None
    """``X-AgentKV-Trim-Cause`` (``rewrite``, ``drift``), when less than the handle was used."""
    identity: str | None = None
    """``X-AgentKV-Identity``, when the router keeps token identity for the client."""
    generated_known: bool | None = None
    """Raw clients: the answer's generated ids were known for the ideal (its text, re-tokenized,
    has the answer's token count); False: they counted as unknown (matching nothing)."""
    ideal_generated_tokens: int | None = None
    """Raw clients: the ideal with every answer as generated, also those the client changed
    (whose tool call a template that writes only text drops): no client can be given more than
    ``ideal_tokens`` of it."""
    shortfall_cause: str | None = None
    """Why less than the ideal was read back (:func:`agentkv.bench.report.shortfall_cause`),
    None when all was."""

    @property
    def useful_reuse(self) -> int:
        """Reused tokens that ran on the right KV, capped by the ideal."""
        wrong = self.wrong_kv_tokens or 0
        return max(0, min(self.ideal_tokens, self.reused_tokens - wrong))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def read_reuse(self, decision: str, cached_tokens: int | None) -> None:
        """The router's decision and what prefill did not compute (``prompt_tokens`` set)."""
        self.decision = decision
        # past the router's TTL the store has dropped the handle (``miss``) or is about to
        gone = decision in ("expired", "miss")
        self.expired = self.policy != "none" and self.turn > 0 and gone
        self.reused_tokens = cached_tokens or 0
        self.recomputed_tokens = self.prompt_tokens - self.reused_tokens

    def read_headers(self, headers: Mapping[str, str]) -> None:
        """What the router's and the simulator's answer headers (lower-case names) say."""
        if HEADER_SIM_WRONG_KV_TOKENS.lower() in headers:
            self.wrong_kv_tokens = int(headers[HEADER_SIM_WRONG_KV_TOKENS.lower()])
        if HEADER_SIM_MODEL_TTFT_MS.lower() in headers:
            self.model_ttft_ms = float(headers[HEADER_SIM_MODEL_TTFT_MS.lower()])
        self.trim_cause = headers.get(HEADER_TRIM_CAUSE.lower())
        self.identity = headers.get(HEADER_IDENTITY.lower())


def ideal_tokens(prompt: Sequence[int], held: Sequence[int], block_size: int) -> tuple[int, int]:
    """(ideal reuse, common prefix) of ``prompt`` against what D holds."""
    n = 0
    for a, b in zip(prompt, held, strict=False):
        if a != b:
            break
        n += 1
    ideal = n if n == len(held) else n // block_size * block_size
    return max(0, min(ideal, len(prompt) - 1)), n


def session_done(
    records: list[TurnRecord], settings: ReplaySettings, script: SessionScript
) -> list[TurnRecord]:
    """A session's records, their retention modelled (see :func:`modelled_retention`)."""
    complete = len(records) == len(script.turns) and not any(r.error for r in records)
    modelled_retention(records, settings, script.next_gap_s if complete else None)
    return records


def modelled_retention(
    records: list[TurnRecord], settings: ReplaySettings, next_gap_s: float | None = None
) -> None:
    """Fill ``retained_block_s`` of one session's records (in order): D holds a turn's blocks
    until the next turn reads or releases them (its trace gap), or, when the next turn comes too
    late, for as long as the policy holds them (D's TTL; with leases, the agent's liveness plus
    the lapse); after the session's last turn (``next_gap_s``: the gap after the last record,
    when the session was cut short) for D's TTL, or with leases until the lease lapses. The
    ``none`` policy releases them at once."""
    for i, rec in enumerate(records):
        if rec.policy == "none" or rec.error:
            rec.retained_block_s = 0.0
            continue
        nxt = records[i + 1] if i + 1 < len(records) else None
        gap = nxt.gap_trace_s if nxt is not None and not nxt.error else None
        if nxt is None and next_gap_s is not None:
            gap = next_gap_s
        tool_wait = rec.tool_call
        if gap is not None and gap < settings.reuse_until_s(tool_wait):
            hold = gap
        else:
            hold = settings.hold_s(tool_wait) if nxt is not None else settings.tail_hold_s
            rec.held_to_ttl = True
        rec.retained_block_s = rec.retained_blocks * hold


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


def real_gap(turn: ScriptedTurn, settings: ReplaySettings) -> float:
    """The real seconds to wait before ``turn``: its trace gap scaled, capped."""
    gap = turn.gap_s * settings.time_scale
    if settings.gap_cap_real_s is not None:
        gap = min(gap, settings.gap_cap_real_s)
    return gap


def start_record(
    policy: str,
    session: str,
    turn: ScriptedTurn,
    settings: ReplaySettings,
    *,
    tool_wait: bool,
    client: str = "sdk",
) -> TurnRecord:
    """The record of ``turn`` before it is sent: what the trace says of it and its real gap
    (``tool_wait``: the previous answer ended in a tool call)."""
    return TurnRecord(
        policy=policy,
        session=session,
        turn=turn.index,
        kind=turn.kind,
        gap_trace_s=turn.gap_s,
        gap_real_s=real_gap(turn, settings) if turn.index else 0.0,
        within_ttl=turn.index > 0 and turn.gap_s < settings.reuse_until_s(tool_wait),
        trace_input_tokens=turn.trace.input_tokens,
        trace_output_tokens=turn.trace.output_tokens,
        tool_call=turn.trace.tool_call,
        client=client,
    )


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
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
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
