"""KV retention policies on a trace: how much reusable KV each loses, and what it holds.

Every transition of a session (:class:`~agentkv.bench.plan.Step`) is a wait: D holds the
previous turn's blocks (``⌈held / block⌉``) from the end of that turn until it frees them or
the next turn comes, ``gap_s`` later. A policy gives each wait a **hold**: the next turn reuses
its reusable tokens (the common prefix, :func:`~agentkv.bench.traces.ideal_reuse`; every
transition counts, rewrites included, as a router verifying token ids would read them) when it
comes while the KV is held, else they are **lost**. The cost is **block-seconds**: blocks ×
``min(gap, hold)``; a session's last turn holds its blocks for the whole hold.

Policies:

* ``fixed-T``: D's fixed TTL (``decoder_kv_blocks_ttl``): every wait is held ``T`` s.
* ``oracle-T``: knows whether and when the next turn comes: holds exactly the gap when it is
  within ``T``, frees at once otherwise and after a session's last turn (the bound any policy
  capped at ``T`` can reach). ``oracle-budget`` is the floor at fixed-450's block-seconds: it
  keeps the waits with the most reusable tokens per block-second until the budget is spent.
* ``lease``: a liveness lease. While the agent is alive the SDK renews the lease (every
  ``lease_s / 3``), so D holds the KV; once it is dead the lease lapses and the router frees
  it. When the agent is alive, from what the trace says:

  - a **tool wait** (the previous response ended in a tool call, Claude Code's
    ``stop == "tool_use"``: the agent runs the tool and sends its result): alive throughout;
  - a **user wait** (after a final answer, or any wait of a trace without tool calls such as
    Mooncake's chats): alive until the UI's idle timeout ``ui_idle_s``, then dead;
  - after a session's **last turn**: dead at once (the user left the agent; ``lease-idle-tail``
    is the same lease when the agent instead sits at its prompt until the UI idle timeout);
  - a lease lapses between ``2/3`` and all of ``lease_s`` after the last renewal before death
    (renewals come every ``lease_s / 3``): the KV counts as lost from the earliest lapse and
    is paid for until the latest;
  - no hold lasts longer than D's TTL, ``max_hold_s`` (profiles run D with a long TTL and the
    router releases by lease).

For a CPU offload tier behind D, each row also says how many reusable tokens the policy loses
on turns that come back within ``horizon_s`` of the previous one (what the tier could still
serve) and the block-seconds it would hold them for (from D's free to the next turn).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from typing_extensions import Unpack

from agentkv.bench.plan import Step, Tail, steps_of
from agentkv.bench.traces import Session

__all__ = [
    "ASSUMPTIONS",
    "BASELINE",
    "DEFAULT_FIXED_TTLS",
    "POLICY_FAMILIES",
    "SWEEP_LEASE_S",
    "SWEEP_MAX_HOLD_S",
    "SWEEP_UI_IDLE_S",
    "Hold",
    "LeaseParams",
    "RetentionRow",
    "best_lease",
    "evaluate_holds",
    "fixed_hold",
    "lease_hold",
    "lease_hold_for",
    "lease_name",
    "oracle_budget",
    "oracle_hold",
    "policy_rules",
    "retention_report",
    "retention_table",
    "sweep_grid",
    "wait_stats",
]

DEFAULT_FIXED_TTLS: tuple[float, ...] = (60, 450, 900, 1800)
BASELINE = 450.0
"""Block-seconds are also given relative to ``fixed-450`` (the router's TTL today)."""
POLICY_FAMILIES = ("fixed", "oracle", "lease", "lease-sweep")
SWEEP_UI_IDLE_S: tuple[float, ...] = (60, 120, 180, 300, 450, 600, 900)
SWEEP_LEASE_S: tuple[float, ...] = (10, 30, 60)
SWEEP_MAX_HOLD_S: tuple[float, ...] = (900, 1800, 3600)


@dataclass(frozen=True)
class Hold:
    """How long D keeps one wait's KV."""

    reuse_until_s: float
    """The next turn reuses the KV when its gap is at most this long."""
    paid_s: float
    """Block-seconds are paid for ``min(gap, paid_s)``."""


@dataclass(frozen=True)
class LeaseParams:
    ui_idle_s: float = 300.0
    lease_s: float = 30.0
    max_hold_s: float = 1800.0


@dataclass
class RetentionRow:
    """One policy's outcome on the trace."""

    policy: str
    lost_fraction: float
    """Reusable tokens lost, of all reusable tokens."""
    block_seconds: float
    block_seconds_vs_fixed_450: float
    lost_tokens: int
    reusable_tokens: int
    cpu_tier_fraction: float = 0.0
    """Reusable tokens lost on turns that come back within the CPU tier's horizon."""
    cpu_tier_block_seconds: float = 0.0
    params: dict[str, float] = field(default_factory=dict)
    cpu_tier_blocks: int = 0
    """With D's CPU tier behind the policy (:mod:`agentkv.bench.cpu_tier`): its capacity in
    blocks; 0: no tier (the fields below stay 0)."""
    cpu_loads: int = 0
    """Turns whose GPU copy lapsed and that loaded their prefix from the tier."""
    cpu_loaded_tokens: int = 0
    cpu_over_budget_tokens: int = 0
    """Lost tokens the tier held, of turns with more new tokens than D prefills (sent to P)."""
    cpu_load_s: float = 0.0
    """The loads' time (their TTFT cost), summed."""
    cpu_prefill_s_saved: float = 0.0
    """The prefill those loads replace, summed."""
    cpu_occupancy_block_seconds: float = 0.0
    """CPU memory: blocks the tier holds x seconds, on the composed clock."""
    cpu_occupancy_vs_fixed_450: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


HoldRule = Callable[[Step], Hold]

ASSUMPTIONS: dict[str, str] = {
    "reusable": "the common prefix of consecutive turns (every transition, rewrites included)",
    "cost": "blocks D holds x seconds held; a session's last turn pays its whole hold",
    "lost": "reusable tokens of turns that come back after the KV was freed",
    "tool_wait": "the previous response ended in a tool call (stop == tool_use): alive",
    "user_wait": "after a final answer (or any wait of a trace without tool calls): alive "
    "until ui_idle_s, then dead",
    "last_turn": "dead after a session's last turn (lease-idle-tail: a user wait instead)",
    "lapse": "renewed every lease_s/3, a lease lapses 2/3 to all of lease_s after death: "
    "lost from the earliest lapse, paid until the latest",
    "cap": "no hold outlives D's TTL, max_hold_s",
}


def fixed_hold(ttl_s: float) -> HoldRule:
    """D's fixed TTL: every wait is held ``ttl_s``."""
    hold = Hold(ttl_s, ttl_s)
    return lambda _step: hold


def oracle_hold(cap_s: float) -> HoldRule:
    """Holds exactly the gap when the next turn comes within ``cap_s``, else nothing."""
    return lambda st: Hold(math.inf, st.gap_s) if st.gap_s <= cap_s else Hold(-1.0, 0.0)


def lease_hold_for(tool_wait: bool, p: LeaseParams) -> Hold:
    """The liveness lease's hold of one wait (see the module docstring): tool waits alive up to
    D's TTL, user waits alive for ``ui_idle_s``, then lapsing within ``lease_s``."""
    if tool_wait:
        return Hold(p.max_hold_s, p.max_hold_s)
    return Hold(
        min(p.max_hold_s, p.ui_idle_s + 2 * p.lease_s / 3),
        min(p.max_hold_s, p.ui_idle_s + p.lease_s),
    )


def lease_hold(p: LeaseParams) -> HoldRule:
    """:func:`lease_hold_for` as a rule over a trace's steps."""
    tool, user = lease_hold_for(True, p), lease_hold_for(False, p)
    return lambda st: tool if st.tool_wait else user


def _blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def evaluate_holds(
    steps: Sequence[Step],
    tails: Sequence[Tail],
    rule: HoldRule,
    *,
    tail_hold_s: float,
    block_size: int = 16,
    horizon_s: float = 3600.0,
) -> RetentionRow:
    """Lost tokens and block-seconds of one policy (``block_seconds_vs_fixed_450`` is left
    at 0 for :func:`retention_table` to fill)."""
    reusable = lost = cpu_lost = 0
    block_s = cpu_block_s = 0.0
    for st in steps:
        hold = rule(st)
        blocks = _blocks(st.held_tokens, block_size)
        reusable += st.reusable_tokens
        block_s += blocks * min(st.gap_s, hold.paid_s)
        if st.gap_s <= hold.reuse_until_s:
            continue
        lost += st.reusable_tokens
        if st.gap_s <= horizon_s:
            cpu_lost += st.reusable_tokens
            cpu_block_s += blocks * max(0.0, st.gap_s - hold.paid_s)
    block_s += sum(_blocks(t.held_tokens, block_size) for t in tails) * tail_hold_s
    share = 1.0 / reusable if reusable else 0.0
    return RetentionRow(
        "", lost * share, block_s, 0.0, lost, reusable, cpu_lost * share, cpu_block_s
    )


def oracle_budget(
    steps: Sequence[Step], budget_block_s: float, *, block_size: int = 16
) -> RetentionRow:
    """The least any policy can lose within ``budget_block_s``: hold exactly the gaps of the
    waits with the most reusable tokens per block-second until the budget is spent (a greedy
    knapsack; frees at once after a session's last turn)."""

    def price(st: Step) -> float:
        return _blocks(st.held_tokens, block_size) * st.gap_s

    ranked = sorted(
        (st for st in steps if st.reusable_tokens > 0),
        key=lambda st: price(st) / st.reusable_tokens,
    )
    reusable = sum(st.reusable_tokens for st in steps)
    spent = 0.0
    kept = 0
    for st in ranked:
        if spent + price(st) > budget_block_s:
            continue
        spent += price(st)
        kept += st.reusable_tokens
    lost = reusable - kept
    return RetentionRow("", lost / reusable if reusable else 0.0, spent, 0.0, lost, reusable)


def lease_name(p: LeaseParams) -> str:
    return f"lease-ui{p.ui_idle_s:g}-l{p.lease_s:g}-h{p.max_hold_s:g}"


def policy_rules(
    families: Sequence[str],
    fixed_ttls: Sequence[float],
    lease: LeaseParams,
) -> list[tuple[str, HoldRule, float, dict[str, float]]]:
    """(name, hold rule, a last turn's hold, parameters) of every requested policy."""
    out: list[tuple[str, HoldRule, float, dict[str, float]]] = []
    if "fixed" in families:
        out += [(f"fixed-{t:g}", fixed_hold(t), t, {"ttl_s": t}) for t in fixed_ttls]
    if "oracle" in families:
        caps = sorted({BASELINE, lease.max_hold_s})
        out += [(f"oracle-{c:g}", oracle_hold(c), 0.0, {"cap_s": c}) for c in caps]
    if "lease" in families:
        out.append(("lease", lease_hold(lease), lease.lease_s, asdict(lease)))
        idle = min(lease.max_hold_s, lease.ui_idle_s + lease.lease_s)
        out.append(("lease-idle-tail", lease_hold(lease), idle, asdict(lease)))
    if "lease-sweep" in families:
        for h in SWEEP_MAX_HOLD_S:
            for lease_s in SWEEP_LEASE_S:
                for ui in SWEEP_UI_IDLE_S:
                    p = LeaseParams(ui, lease_s, h)
                    out.append((lease_name(p), lease_hold(p), lease_s, asdict(p)))
    return out


def retention_table(
    steps: Sequence[Step],
    tails: Sequence[Tail],
    families: Sequence[str],
    *,
    fixed_ttls: Sequence[float] = DEFAULT_FIXED_TTLS,
    lease: LeaseParams | None = None,
    block_size: int = 16,
    horizon_s: float = 3600.0,
) -> list[RetentionRow]:
    """Every requested policy family (:data:`POLICY_FAMILIES`) on the trace, in that order;
    ``oracle`` adds ``oracle-budget`` (the floor at fixed-450's block-seconds)."""
    unknown = sorted(set(families) - set(POLICY_FAMILIES))
    if unknown:
        raise ValueError(
            f"unknown retention policy {', '.join(unknown)} (known: fixed, oracle, "
            "lease, lease-sweep)"
        )
    params = lease or LeaseParams()
    baseline = evaluate_holds(
        steps, tails, fixed_hold(BASELINE), tail_hold_s=BASELINE, block_size=block_size
    ).block_seconds
    rows: list[RetentionRow] = []
    for name, rule, tail_s, extra in policy_rules(families, fixed_ttls, params):
        row = evaluate_holds(
            steps, tails, rule, tail_hold_s=tail_s, block_size=block_size, horizon_s=horizon_s
        )
        row.policy, row.params = name, extra
        rows.append(row)
    if "oracle" in families:
        floor = oracle_budget(steps, baseline, block_size=block_size)
        floor.policy, floor.params = "oracle-budget", {"budget_block_s": baseline}
        rows.append(floor)
    for row in rows:
        row.block_seconds_vs_fixed_450 = row.block_seconds / baseline if baseline else 0.0
    return rows


class RetentionOptions(TypedDict, total=False):
    """:func:`retention_table`'s options that :func:`retention_report` passes on."""

    fixed_ttls: Sequence[float]
    lease: LeaseParams | None
    horizon_s: float


def retention_report(
    sessions: Sequence[Session],
    families: Sequence[str],
    *,
    block_size: int = 16,
    **options: Unpack[RetentionOptions],
) -> list[RetentionRow]:
    """:func:`retention_table` over a trace's sessions."""
    steps, tails = steps_of(sessions, block_size)
    if not steps:
        raise ValueError("the trace has no session with two turns or more")
    return retention_table(steps, tails, families, block_size=block_size, **options)


def best_lease(rows: Sequence[RetentionRow], max_vs_fixed_450: float = 1.0) -> RetentionRow | None:
    """The lease row that loses least within ``max_vs_fixed_450`` of fixed-450's block-seconds
    (without a CPU tier)."""
    fits = [
        r
        for r in rows
        if r.policy.startswith("lease")
        and not r.cpu_tier_blocks
        and r.block_seconds_vs_fixed_450 <= max_vs_fixed_450
    ]
    return min(fits, key=lambda r: (r.lost_fraction, r.block_seconds), default=None)


def sweep_grid(rows: Sequence[RetentionRow]) -> list[list[str]]:
    """The lease sweep as a grid: one line per (D's TTL, lease), one column per UI idle
    timeout, each cell ``lost % / block-seconds vs fixed-450``; empty without a sweep."""
    sweep = [r for r in rows if r.policy.startswith("lease-ui") and not r.cpu_tier_blocks]
    if not sweep:
        return []
    uis = sorted({r.params["ui_idle_s"] for r in sweep})
    lines = sorted({(r.params["max_hold_s"], r.params["lease_s"]) for r in sweep})
    cell = {
        (r.params["max_hold_s"], r.params["lease_s"], r.params["ui_idle_s"]): (
            f"{100 * r.lost_fraction:.2f}% / {r.block_seconds_vs_fixed_450:.2f}"
        )
        for r in sweep
    }
    grid = [["max hold s", "lease s", *(f"ui {u:g} s" for u in uis)]]
    for h, lease_s in lines:
        grid.append([f"{h:g}", f"{lease_s:g}", *(cell.get((h, lease_s, u), "") for u in uis)])
    return grid


def wait_stats(sessions: Sequence[Session], block_size: int = 16) -> dict[str, float]:
    """How the trace's waits split between tool and user waits (counts, reusable shares)."""
    steps, tails = steps_of(sessions, block_size)
    tool = [st for st in steps if st.tool_wait]
    total = sum(st.reusable_tokens for st in steps)
    return {
        "transitions": len(steps),
        "tool_waits": len(tool),
        "user_waits": len(steps) - len(tool),
        "last_turns": len(tails),
        "tool_wait_reusable_share": sum(st.reusable_tokens for st in tool) / total
        if total
        else 0.0,
    }
