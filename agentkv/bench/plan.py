"""``agentkv plan``: how long D should keep KV, and when reading it back pays, from a trace.

For every turn after the first, the trace gives the gap (how long the client waited after the
previous answer), what D holds from the previous turn (its prompt and output but the last
token) and how much of that the new prompt repeats (:func:`~agentkv.bench.traces.ideal_reuse`).
For a D TTL ``T`` and a ``kv_recompute_threshold`` ``θ``:

* the router's TTL is ``T − margin(T)`` (:func:`router_margin`); a turn whose gap is shorter
  reads back its reusable tokens ``r`` when ``r ≥ θ`` (prefill's prefix cache is off, as in the
  published benchmark, so nothing else is local), rewrites included: the router verifies a
  rewritten history's prefix by token ids and reads it (``epoch_rule=True`` models the router
  before reuse planner v2, which released the handle of a rewritten history unread);
* D holds the previous turn's blocks (``⌈held / block⌉``) for the gap when the next turn comes
  in time (it reads or releases them), else for ``T``; a session's last turn holds them for
  ``T``;
* prefill compute saved: ``prefill_s(n, 0) − prefill_s(n − r, r)`` of the cost model; TTFT
  saved: ``ttft_s(n, 0) − ttft_s(n, r)`` (a P/D turn: it also pays the transfer of ``r``).

Recommendations: ``kv_recompute_threshold`` is the break-even read: the fewest tokens (whole
blocks) whose transfer is faster than recomputing them (``transfer_s(N) < prefill_s(N, 0)``:
the rest of the prompt attends over them either way, so this does not depend on the prompt's
length). ``decoder_kv_blocks_ttl`` is the shortest TTL on the grid that captures ``target``
(95 %) of the reuse the longest one captures. Beyond it, a CPU offload tier pays when the turns
it would serve (gap between the TTL and the tier's horizon) hold at least 1 % of the reusable
tokens and reading their KV at ``offload_gbps`` is faster than recomputing it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agentkv.bench.traces import Session, ideal_reuse, transition
from agentkv.sim.costmodel import CostModel

__all__ = [
    "DEFAULT_THRESHOLDS",
    "DEFAULT_TTLS",
    "OffloadVerdict",
    "PlanRow",
    "Step",
    "TtlThresholdPlan",
    "break_even_tokens",
    "evaluate",
    "make_plan",
    "router_margin",
    "steps_of",
]

DEFAULT_TTLS: tuple[float, ...] = (15, 30, 60, 120, 240, 480, 900, 1800, 3600)
DEFAULT_THRESHOLDS: tuple[int, ...] = (0, 64, 256, 1024, 4096)


def router_margin(ttl_s: float) -> float:
    """The router's margin below D's TTL: 1/16 of it, at least 6 s (above P's 5 s expiry
    margin) and at most 30 s (agentkv's default, 450 of 480 s)."""
    return min(30.0, max(6.0, ttl_s / 16))


@dataclass(frozen=True)
class Step:
    """One turn after the first, in trace tokens."""

    session: str
    turn: int
    kind: str
    gap_s: float
    prompt_tokens: int
    held_tokens: int
    """What D holds from the previous turn."""
    reusable_tokens: int
    """What a verifying router could let prefill read back."""
    tool_wait: bool = False
    """The gap was a tool wait: the previous response ended in a tool call."""


@dataclass(frozen=True)
class Tail:
    """A session's last turn: D holds its blocks until its TTL."""

    session: str
    held_tokens: int


def steps_of(sessions: Iterable[Session], block_size: int = 16) -> tuple[list[Step], list[Tail]]:
    """Every transition of every session, and every session's last turn."""
    steps: list[Step] = []
    tails: list[Tail] = []
    for s in sessions:
        turns = s.turns
        for k in range(1, len(turns)):
            prev, cur = turns[k - 1], turns[k]
            step = transition(prev, cur, s.block_size)
            steps.append(
                Step(
                    session=s.id,
                    turn=k,
                    kind=step.kind,
                    gap_s=cur.gap_s,
                    prompt_tokens=cur.input_tokens,
                    held_tokens=prev.input_tokens + prev.output_tokens - 1,
                    reusable_tokens=ideal_reuse(prev, step, cur.input_tokens, block_size),
                    tool_wait=prev.tool_call,
                )
            )
        if turns:
            last = turns[-1]
            tails.append(Tail(s.id, last.input_tokens + last.output_tokens - 1))
    return steps, tails


def break_even_tokens(cost: CostModel, block_size: int, limit: int = 1 << 20) -> int | None:
    """The fewest tokens, in whole blocks, whose read is faster than recomputing them; None
    when no read up to ``limit`` is."""
    n = block_size
    while n <= limit:
        if cost.transfer_s(n) < cost.prefill_s(n, 0):
            return n
        n += block_size if n < 64 * block_size else n // 8 // block_size * block_size
    return None


@dataclass
class PlanRow:
    """The outcome of one (TTL, threshold) on the trace."""

    ttl_s: float
    router_ttl_s: float
    threshold: int
    reusable_tokens: int
    """What verified reads could capture with no TTL and no threshold."""
    captured_tokens: int
    turns: int
    turns_reused: int
    turns_expired: int
    """Turns whose gap passed the router's TTL while D held reusable tokens."""
    lost_to_ttl_tokens: int
    lost_to_threshold_tokens: int
    lost_to_rewrites_tokens: int
    """Reusable tokens of strip and rewrite turns (the epoch rule)."""
    retained_block_s: float
    prefill_s_saved: float
    ttft_s_saved: float
    ttft_s_recompute: float
    """TTFT of every turn without reuse (the baseline)."""

    @property
    def captured_pct(self) -> float:
        return 100.0 * self.captured_tokens / self.reusable_tokens if self.reusable_tokens else 0.0

    @property
    def ttft_saved_pct(self) -> float:
        return 100.0 * self.ttft_s_saved / self.ttft_s_recompute if self.ttft_s_recompute else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "captured_pct": self.captured_pct,
            "ttft_saved_pct": self.ttft_saved_pct,
        }


def evaluate(
    steps: Sequence[Step],
    tails: Sequence[Tail],
    *,
    ttl_s: float,
    threshold: int,
    cost: CostModel,
    block_size: int = 16,
    epoch_rule: bool = False,
) -> PlanRow:
    """One row of the plan (see the module docstring)."""
    router_ttl = ttl_s - router_margin(ttl_s)
    row = PlanRow(ttl_s, router_ttl, threshold, 0, 0, len(steps), 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)
    for st in steps:
        r, n = st.reusable_tokens, st.prompt_tokens
        row.reusable_tokens += r
        row.ttft_s_recompute += cost.ttft_s(n, 0)
        blocks = math.ceil(st.held_tokens / block_size)
        in_time = st.gap_s < router_ttl
        row.retained_block_s += blocks * (st.gap_s if in_time else ttl_s)
        if r <= 0:
            continue
        if not in_time:
            row.turns_expired += 1
            row.lost_to_ttl_tokens += r
        elif epoch_rule and st.kind != "append":
            row.lost_to_rewrites_tokens += r
        elif r < max(threshold, 1):
            row.lost_to_threshold_tokens += r
        else:
            row.turns_reused += 1
            row.captured_tokens += r
            row.prefill_s_saved += cost.prefill_s(n, 0) - cost.prefill_s(n - r, r)
            row.ttft_s_saved += cost.ttft_s(n, 0) - cost.ttft_s(n, r)
    for tail in tails:
        row.retained_block_s += math.ceil(tail.held_tokens / block_size) * ttl_s
    return row


@dataclass
class OffloadVerdict:
    """What a CPU tier would serve beyond D's TTL."""

    pays: bool
    horizon_s: float
    gbps: float
    turns: int
    tokens: int
    share_pct: float
    """Of all reusable tokens."""
    ttft_s_saved: float
    """Recompute minus CPU read, summed over those turns."""
    gib_hours: float
    """CPU memory × time the tier holds them (from D's TTL to the next turn)."""
    reason: str


def offload_verdict(
    steps: Sequence[Step],
    *,
    ttl_s: float,
    threshold: int,
    cost: CostModel,
    horizon_s: float = 3600.0,
    gbps: float = 25.0,
    block_size: int = 16,
    epoch_rule: bool = False,
) -> OffloadVerdict:
    router_ttl = ttl_s - router_margin(ttl_s)
    total = sum(s.reusable_tokens for s in steps)
    turns = tokens = 0
    saved = byte_s = 0.0
    per_token = cost.kv_bytes_per_token
    for st in steps:
        r = st.reusable_tokens
        if r < max(threshold, 1) or not router_ttl <= st.gap_s < horizon_s:
            continue
        if epoch_rule and st.kind != "append":
            continue
        turns += 1
        tokens += r
        read_s = r * per_token / (gbps * 1e9)
        saved += cost.prefill_s(st.prompt_tokens, 0) - cost.prefill_s(st.prompt_tokens - r, r)
        saved -= read_s
        blocks = math.ceil(st.held_tokens / block_size)
        byte_s += blocks * block_size * per_token * (st.gap_s - ttl_s)
    share = 100.0 * tokens / total if total else 0.0
    pays = share >= 1.0 and saved > 0
    if pays:
        reason = (
            f"{share:.1f} % of the reusable tokens come back between the TTL and "
            f"{horizon_s:g} s, and reading them at {gbps:g} GB/s beats recomputing"
        )
    elif share < 1.0:
        reason = f"only {share:.2f} % of the reusable tokens come back after the TTL"
    else:
        reason = "reading the KV from CPU is not faster than recomputing it"
    return OffloadVerdict(
        pays, horizon_s, gbps, turns, tokens, share, saved, byte_s / 2**30 / 3600, reason
    )


@dataclass
class TtlThresholdPlan:
    """What ``agentkv plan`` recommends from a trace: D's TTL, the router's TTL and
    ``kv_recompute_threshold``, with the grid of (TTL, threshold) rows it chose from and the
    CPU offload tier's verdict."""

    rows: list[PlanRow]
    ttl_s: float
    router_ttl_s: float
    threshold: int
    break_even_tokens: int | None
    target: float
    offload: OffloadVerdict
    stats: dict[str, Any] = field(default_factory=dict)

    def row(self, ttl_s: float, threshold: int) -> PlanRow:
        return next(r for r in self.rows if r.ttl_s == ttl_s and r.threshold == threshold)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recommendation": {
                "decoder_kv_blocks_ttl": self.ttl_s,
                "router_ttl_s": self.router_ttl_s,
                "ttl_margin_s": self.ttl_s - self.router_ttl_s,
                "kv_recompute_threshold": self.threshold,
                "break_even_tokens": self.break_even_tokens,
                "target": self.target,
                "offload": asdict(self.offload),
            },
            "stats": self.stats,
            "rows": [r.to_dict() for r in self.rows],
        }


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def make_plan(
    sessions: Iterable[Session],
    cost: CostModel,
    *,
    block_size: int = 16,
    ttls: Sequence[float] = DEFAULT_TTLS,
    thresholds: Sequence[int] | None = None,
    target: float = 0.95,
    epoch_rule: bool = False,
    offload_horizon_s: float = 3600.0,
    offload_gbps: float = 25.0,
) -> TtlThresholdPlan:
    """Evaluate every (TTL, threshold) and recommend one of each."""
    steps, tails = steps_of(sessions, block_size)
    if not steps:
        raise ValueError("the trace has no session with two turns or more")
    even = break_even_tokens(cost, block_size)
    threshold = even if even is not None else max(s.prompt_tokens for s in steps)
    grid = sorted(set(thresholds if thresholds is not None else DEFAULT_THRESHOLDS) | {threshold})
    rows = [
        evaluate(
            steps,
            tails,
            ttl_s=t,
            threshold=th,
            cost=cost,
            block_size=block_size,
            epoch_rule=epoch_rule,
        )
        for th in grid
        for t in sorted(ttls)
    ]
    at = [r for r in rows if r.threshold == threshold]
    best = max(r.captured_tokens for r in at)
    chosen = next(r for r in at if r.captured_tokens >= target * best)
    offload = offload_verdict(
        steps,
        ttl_s=chosen.ttl_s,
        threshold=threshold,
        cost=cost,
        horizon_s=offload_horizon_s,
        gbps=offload_gbps,
        block_size=block_size,
        epoch_rule=epoch_rule,
    )
    gaps = [s.gap_s for s in steps]
    stats = {
        "sessions": len(tails),
        "turns": len(steps) + len(tails),
        "transitions": len(steps),
        "append": sum(s.kind == "append" for s in steps),
        "strip": sum(s.kind == "strip" for s in steps),
        "rewrite": sum(s.kind == "rewrite" for s in steps),
        "gap_p50_s": _percentile(gaps, 0.5),
        "gap_p90_s": _percentile(gaps, 0.9),
        "prompt_p50_tokens": _percentile([s.prompt_tokens for s in steps], 0.5),
        "reusable_share_pct": 100.0
        * sum(s.reusable_tokens for s in steps)
        / max(1, sum(s.prompt_tokens for s in steps)),
    }
    return TtlThresholdPlan(
        rows,
        chosen.ttl_s,
        chosen.router_ttl_s,
        threshold,
        even,
        target,
        offload,
        stats,
    )
