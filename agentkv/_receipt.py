"""What each turn did: :class:`TurnReceipt` (and the drift report of messages mode)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from agentkv.protocol import (
    HEADER_DECISION,
    HEADER_ESTIMATED,
    HEADER_LOCAL_PREFIX_TOKENS,
    HEADER_REUSED_TOKENS,
    HEADER_SIM_MODEL_TTFT_MS,
    HEADER_TRIM_CAUSE,
    HEADER_VERIFIED_PREFIX_TOKENS,
)

__all__ = ["Drift", "RewriteReport", "TurnReceipt"]

Mode = Literal["exact", "messages"]


@dataclass(frozen=True)
class Drift:
    """Where a re-rendered prompt stopped matching the previous prompt + generated tokens."""

    matched_tokens: int
    """Tokens of (previous prompt + previous output) the new prompt still starts with."""
    expected_tokens: int
    """Length of previous prompt + previous output."""
    message_index: int | None
    """Index in ``conversation.messages`` of the message where the difference starts."""
    hazard: str
    """A name from the hazard catalogue, e.g. ``reasoning-pruned``, ``retokenized``."""
    detail: str

    @property
    def lost_tokens(self) -> int:
        return self.expected_tokens - self.matched_tokens


@dataclass(frozen=True)
class RewriteReport:
    """What survived a rewrite of the history."""

    reason: str
    epoch: int
    surviving_messages: int
    """Messages at the start of the history that are unchanged."""
    surviving_tokens: int | None
    """Token ids at the start of the exact history that are unchanged (exact mode)."""
    dropped_tokens: int | None


@dataclass(frozen=True)
class TurnReceipt:
    """One turn's outcome, from the response and (behind agentkv's router) its headers."""

    conversation_id: str
    turn: int
    epoch: int
    mode: Mode
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    """``usage.prompt_tokens_details.cached_tokens`` as the server reported it."""
    decision: str | None
    """``X-AgentKV-Decision`` (``pull``, ``decode``: decoded in place on D without P, ``cpu``:
    on the D whose CPU tier held the prefix, without P, ``local``, ``recompute``, ``miss``,
    ``stale``, ``expired``); None when no agentkv router answered."""
    reused_tokens: int | None
    """M: prompt tokens P read from D's blocks (``X-AgentKV-Reused-Tokens``); an upper bound
    when ``estimated``."""
    verified_prefix_tokens: int | None
    """C: prompt tokens D's handle held, verified by token ids."""
    finish_reason: str | None
    latency_s: float
    ttft_s: float | None = None
    drift: Drift | None = None
    rewrite: RewriteReport | None = None
    request_id: str | None = None
    local_prefix_tokens: int | None = None
    """L: prompt tokens P already held in its own prefix cache (None: unknown)."""
    estimated: bool = False
    """True when L was unknown (P's KV events off): ``reused_tokens`` is what D offered, and P
    may have read less of it."""
    trim_cause: str | None = None
    """Why less than the whole handle was usable: ``rewrite`` or ``drift``."""
    model_ttft_ms: float | None = None
    """agentkv's engine simulator only: its cost model's time to first token for this turn
    (P's + D's, noise-free; ``X-AgentKV-Sim-Model-TTFT-Ms``, passed on by the router). None
    with real vLLM."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RouterFields(NamedTuple):
    """The receipt headers of agentkv's router (all None without one)."""

    decision: str | None
    reused: int | None
    verified: int | None
    local: int | None
    estimated: bool
    cause: str | None
    model_ttft_ms: float | None = None


def router_fields(headers: Mapping[str, str]) -> RouterFields:
    """agentkv's response headers, parsed."""
    lower = {k.lower(): v for k, v in headers.items()}

    def number(name: str) -> int | None:
        value = lower.get(name.lower())
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None

    return RouterFields(
        lower.get(HEADER_DECISION.lower()),
        number(HEADER_REUSED_TOKENS),
        number(HEADER_VERIFIED_PREFIX_TOKENS),
        number(HEADER_LOCAL_PREFIX_TOKENS),
        lower.get(HEADER_ESTIMATED.lower()) == "1",
        lower.get(HEADER_TRIM_CAUSE.lower()),
        _float(lower.get(HEADER_SIM_MODEL_TTFT_MS.lower())),
    )


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
