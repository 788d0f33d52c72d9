"""What a replay is given and what it records: the policies, a session's script, the replay's
settings, and one :class:`TurnRecord` per turn with its ideal reuse and the retention it costs
(modelled from the trace's gaps).

Every turn's **ideal** reuse is computed on the wire: the longest common prefix of the new
prompt and what D holds from the previous turn (its prompt and output but the last token), all
of it when the prompt repeats all of it, else cut to whole blocks, never the last prompt token;
and only when the trace's gap is within the router's TTL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from agentkv.bench.content import ScriptedTurn
from agentkv.bench.retention import LeaseParams, lease_hold_for
from agentkv.bench.wire import HEADER_IDENTITY, ClientName
from agentkv.protocol import (
    HEADER_SIM_MODEL_TTFT_MS,
    HEADER_SIM_WRONG_KV_TOKENS,
    HEADER_TRIM_CAUSE,
)

__all__ = [
    "POLICIES",
    "Policy",
    "ReplaySettings",
    "SessionScript",
    "TurnRecord",
    "ideal_tokens",
    "modelled_retention",
    "real_gap",
    "session_done",
    "start_record",
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

    def record_error(self, exc: BaseException, stage: str = "") -> None:
        """``exc`` as the turn's error (``stage`` before it, 300 characters at most), unless it
        already has one."""
        self.error = self.error or f"{stage}{type(exc).__name__}: {exc}"[:300]

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
