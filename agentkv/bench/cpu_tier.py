"""D's CPU tier as a path of the retention plan (``agentkv plan --retention --cpu-tier-blocks``).

The offload profile (``qwen3-32b-1p1d-offload``) runs D with vLLM's ``OffloadingConnector``: every
full block of KV a request computes, its answer's included (``offload_prompt_only = false``), is
also stored in D's CPU memory. When D's GPU copy of a conversation lapses (its TTL or lease), a
turn sent to that D finds the prefix in the CPU tier and loads it instead of recomputing it
(docs/paths.md, the ``cpu`` path). This module says how much of the reusable KV that serves on a
trace, and at what cost:

* **The tier** (:class:`RunLru`): ``capacity`` blocks of ``block_size`` tokens, least recently used
  evicted first, over every conversation on the D. A turn's **save** (at its end) offers its whole
  sequence (prompt and answer but the last token, full blocks only): blocks already held are
  touched, new ones stored, each new block's store failing with ``failure_rate`` (vLLM skips a
  store it cannot make room for: offload is best effort; a failed block is retried by the next
  save). A save makes the sequence the most recently used, its first block the most recent (vLLM's
  ``touch`` walks the hashes in reverse), so eviction eats a conversation's KV from its tail and
  what is left is still a usable prefix. A **lookup** (a turn's arrival) finds the run of blocks
  the tier holds from the prompt's first block on; the run stops at the first block missing
  (evicted, or never stored).
* **Identity**: blocks are a conversation's chained prefix, as the engines hash them. A turn keeps
  the previous sequence's blocks up to where its prompt stops repeating it (all of them on an
  append, the previous prompt on a reasoning strip, the shared blocks on a rewrite); the rest are
  new blocks.
* **Time**: the trace has no absolute clock (Claude Code sessions start at 0), so sessions are laid
  on one as the replay does (``--concurrency``): ``concurrency`` sessions in flight on the D, a
  session starting (in trace order) when one ends; a turn arrives ``gap`` after the previous turn's
  end and ends ``api_time`` later.
* **The path** (:func:`evaluate_with_cpu`): a turn whose GPU copy lapsed under a policy
  (:mod:`agentkv.bench.retention`) reuses ``min(r, c)`` tokens from the tier (``r`` its reusable
  tokens, ``c`` the tier's run at its arrival) when the new tokens it then prefills on D,
  ``prompt − min(r, c)``, are within D's decode budget (``max_new_tokens``, the router's
  ``DecodeBudget``; 0: no limit); the rest of ``r`` is lost. Each such turn is one **load** of
  ``cpu_load_s_per_token`` × tokens (its TTFT cost), replacing that much prefill. The tier does not
  change D's GPU block-seconds; it costs CPU memory, its **occupancy** (blocks held × seconds on
  the composed clock).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentkv.bench.plan import Step, Tail, steps_of
from agentkv.bench.retention import (
    BASELINE,
    Hold,
    LeaseParams,
    RetentionRow,
    evaluate_holds,
    fixed_hold,
    policy_rules,
)
from agentkv.bench.traces import Session, ideal_reuse, transition
from agentkv.router.paths import Curves, DecodeBudget
from agentkv.sim.costmodel import CostModel
from agentkv.sim.cpu_tier import check_tier

__all__ = [
    "GOAL_LOST",
    "CpuCoverage",
    "CpuTierSpec",
    "RunLru",
    "best_with_cpu",
    "cpu_coverage",
    "cpu_tier_table",
    "evaluate_with_cpu",
    "load_s_per_token",
]

GOAL_LOST = 0.035
"""Issue 24's retention goal: at most 3.5 % of the reusable tokens lost, within fixed-450's GPU
block-seconds."""
CPU_FAMILIES = ("fixed", "lease", "lease-sweep")
"""The policy families given a CPU tier (an oracle knows when a turn comes: it needs none)."""

Piece = tuple[int, int, int]
"""``(gen, lo, hi)``: positions ``lo..hi-1`` of a conversation's sequence are blocks of ``gen``."""


@dataclass(frozen=True)
class CpuTierSpec:
    capacity_blocks: int
    failure_rate: float = 0.0
    concurrency: int = 8
    """Sessions in flight on the D at once."""
    seed: int = 0


class RunLru:
    """An LRU of blocks keyed ``(gen, position)``, held as runs of positions (a conversation of
    100k tokens is 6,000 blocks a save: one run, not 6,000 entries)."""

    def __init__(self, capacity: int, *, failure_rate: float = 0.0, seed: int = 0) -> None:
        check_tier(capacity, failure_rate)
        self.capacity = capacity
        self.failure_rate = failure_rate
        self._rng = random.Random(seed)
        self._runs: dict[int, list[list[int]]] = {}
        """gen -> its present positions as ``[lo, hi, stamp]``, sorted, disjoint."""
        self._bands: deque[int] = deque()
        """Stamps, least recent first: a stamp is one save's touch of one piece."""
        self._band_gen: dict[int, int] = {}
        self._band_live: dict[int, int] = {}
        self._stamp = 0
        self.size = 0
        self.stored = self.failed = self.evicted = self.unstored = 0
        """Blocks: stored, whose store failed, evicted, not stored for want of room."""

    def covered(self, pieces: Sequence[Piece], limit: int) -> int:
        """Blocks held from position 0 of a sequence on, without a gap, at most ``limit``."""
        pos = 0
        for gen, lo, hi in pieces:
            if pos != lo or pos >= limit:
                break
            for a, b, _s in self._runs.get(gen, ()):
                if a > pos:
                    break
                if pos < b:
                    pos = min(b, hi)
                if pos >= hi:
                    break
            if pos < hi:
                break
        return min(pos, limit)

    def save(self, pieces: Sequence[Piece]) -> None:
        """Touch the sequence's held blocks and store the others (see the module docstring)."""
        first = self._stamp + 1
        stamps: dict[int, int] = {}
        absent: list[tuple[int, int, int]] = []
        for gen, lo, hi in reversed(pieces):  # the first piece ends up the most recent
            stamp = self._new_band(gen)
            stamps[gen] = stamp
            absent += [(gen, a, b) for a, b in self._restamp(gen, lo, hi, stamp)]
        for gen, a, b in sorted(absent, key=lambda x: x[1]):
            for x, y in self._survivors(a, b):
                room = self._make_room(y - x, first)
                if room < y - x:
                    self.unstored += y - x - room
                if room:
                    self._insert(gen, x, x + room, stamps[gen])

    # -- internals ---------------------------------------------------------------------------
    def _new_band(self, gen: int) -> int:
        self._stamp += 1
        self._bands.append(self._stamp)
        self._band_gen[self._stamp] = gen
        self._band_live[self._stamp] = 0
        return self._stamp

    def _restamp(self, gen: int, lo: int, hi: int, stamp: int) -> list[tuple[int, int]]:
        """Move ``gen``'s held positions within ``[lo, hi)`` to ``stamp``; the gaps left."""
        runs = self._runs.setdefault(gen, [])
        out: list[list[int]] = []
        gaps: list[tuple[int, int]] = []
        pos = lo
        for a, b, s in runs:
            if b <= lo or a >= hi:
                out.append([a, b, s])
                continue
            if a < lo:
                out.append([a, lo, s])
            if b > hi:
                out.append([hi, b, s])
            x, y = max(a, lo), min(b, hi)
            if x > pos:
                gaps.append((pos, x))
            pos = y
            self._band_live[s] -= y - x
            self._band_live[stamp] += y - x
            out.append([x, y, stamp])
        if pos < hi:
            gaps.append((pos, hi))
        self._runs[gen] = _merged(out)
        return gaps

    def _survivors(self, a: int, b: int) -> list[tuple[int, int]]:
        """The runs of ``[a, b)`` whose stores do not fail (each block fails independently)."""
        p = self.failure_rate
        if p <= 0.0:
            return [(a, b)]
        if p >= 1.0:
            self.failed += b - a
            return []
        out = []
        pos = a
        while pos < b:
            u = 1.0 - self._rng.random()  # in (0, 1]
            ok = int(math.log(u) / math.log1p(-p))  # stores before the next failure
            end = min(b, pos + ok)
            if end > pos:
                out.append((pos, end))
            if end < b:
                self.failed += 1
            pos = end + 1
        return out

    def _make_room(self, want: int, protect_from: int) -> int:
        """Evict least recently used blocks (never those of the save in progress, stamps from
        ``protect_from`` on) until ``want`` fit; how many fit."""
        need = self.size + want - self.capacity
        while need > 0 and self._bands and self._bands[0] < protect_from:
            stamp = self._bands.popleft()
            live = self._band_live[stamp]
            if live:
                took = self._evict_band(stamp, need)
                if not took:
                    raise AssertionError(f"band {stamp} counts {live} blocks it does not hold")
                need -= took
                if took < live:
                    self._bands.appendleft(stamp)
                    continue
            del self._band_live[stamp], self._band_gen[stamp]
        return min(want, self.capacity - self.size)

    def _evict_band(self, stamp: int, need: int) -> int:
        """Evict up to ``need`` blocks of one band, its last positions first."""
        runs = self._runs[self._band_gen[stamp]]
        took = 0
        for run in reversed(runs):
            if took >= need:
                break
            if run[2] != stamp:
                continue
            k = min(need - took, run[1] - run[0])
            run[1] -= k
            took += k
        runs[:] = [r for r in runs if r[1] > r[0]]
        self._band_live[stamp] -= took
        self.size -= took
        self.evicted += took
        return took

    def _insert(self, gen: int, a: int, b: int, stamp: int) -> None:
        runs = self._runs.setdefault(gen, [])
        runs.append([a, b, stamp])
        runs.sort()
        self._runs[gen] = _merged(runs)
        self._band_live[stamp] += b - a
        self.size += b - a
        self.stored += b - a


def _merged(runs: list[list[int]]) -> list[list[int]]:
    runs.sort()
    out: list[list[int]] = []
    for run in runs:
        if out and out[-1][1] == run[0] and out[-1][2] == run[2]:
            out[-1][1] = run[1]
        else:
            out.append(run)
    return out


@dataclass
class CpuCoverage:
    """What the tier holds at each transition's arrival, in :func:`~agentkv.bench.plan.steps_of`
    order, and what it cost."""

    spec: CpuTierSpec
    tokens: list[int]
    """Per transition: tokens of the new prompt the tier holds (a prefix, whole blocks)."""
    occupancy_block_s: float
    duration_s: float
    """The composed clock's length: from the first session's start to the last turn's end."""
    stored: int
    failed: int
    evicted: int
    unstored: int


def _chains(session: Session, block_size: int) -> list[tuple[int, int]]:
    """Per turn: ``(kept, blocks)``: the previous sequence's blocks it keeps, its own blocks."""
    out = []
    for k, cur in enumerate(session.turns):
        blocks = (cur.input_tokens + cur.output_tokens - 1) // block_size
        kept = 0
        if k:
            prev = session.turns[k - 1]
            step = transition(prev, cur, session.block_size)
            held = prev.input_tokens + prev.output_tokens - 1
            reusable = ideal_reuse(prev, step, cur.input_tokens, block_size)
            matched = held if step.kind == "append" else reusable
            kept = min(matched // block_size, blocks, held // block_size)
        out.append((kept, blocks))
    return out


def cpu_coverage(
    sessions: Sequence[Session], spec: CpuTierSpec, *, block_size: int = 16
) -> CpuCoverage:
    """Run the tier over the trace on the composed clock (see the module docstring)."""
    if spec.concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    tier = RunLru(spec.capacity_blocks, failure_rate=spec.failure_rate, seed=spec.seed)
    slots = [0.0] * spec.concurrency
    events: list[tuple[float, int, int, int]] = []  # (time, session, turn, 0 lookup / 1 save)
    shapes: list[list[tuple[int, int]]] = []
    step_index: dict[tuple[int, int], int] = {}
    for i, s in enumerate(sessions):
        t = heapq.heappop(slots)
        for k, turn in enumerate(s.turns):
            if k:
                t += turn.gap_s
                events.append((t, i, k, 0))
                step_index[(i, k)] = len(step_index)
            t += turn.api_s or 0.0
            events.append((t, i, k, 1))
        heapq.heappush(slots, t)
        shapes.append(_chains(s, block_size))
    events.sort()
    tokens = [0] * len(step_index)
    chains: dict[int, list[Piece]] = {}
    gen_top: dict[int, int] = {}  # gen -> the highest position it ever had
    gens = 0
    occupancy = 0.0
    last = 0.0
    for time, i, k, kind in events:
        occupancy += tier.size * (time - last)
        last = time
        kept, blocks = shapes[i][k]
        chain = chains.get(i, [])
        if kind == 0:
            tokens[step_index[(i, k)]] = tier.covered(chain, kept) * block_size
            continue
        new: list[Piece] = []
        for gen, lo, hi in chain:  # keep the first ``kept`` positions
            if lo < kept:
                new.append((gen, lo, min(hi, kept)))
        top = new[-1][2] if new else 0
        if blocks > top:
            if new and new[-1][2] == gen_top[new[-1][0]]:  # extend the last gen
                gen, lo, _hi = new.pop()
            else:
                gens += 1
                gen, lo = gens, top
            new.append((gen, lo, blocks))
            gen_top[gen] = blocks
        chains[i] = new
        tier.save(new)
    return CpuCoverage(
        spec, tokens, occupancy, last, tier.stored, tier.failed, tier.evicted, tier.unstored
    )


def evaluate_with_cpu(
    steps: Sequence[Step],
    tails: Sequence[Tail],
    rule: Callable[[Step], Hold],
    coverage: CpuCoverage,
    *,
    tail_hold_s: float,
    cost: CostModel,
    load_s_per_token: float,
    max_new_tokens: int = 2048,
    block_size: int = 16,
    horizon_s: float = 3600.0,
) -> RetentionRow:
    """One policy with D's CPU tier behind it (``block_seconds_vs_fixed_450`` and the CPU
    occupancy's ratio are left at 0 for the caller)."""
    if len(coverage.tokens) != len(steps):
        raise ValueError("the coverage is not of these steps")
    reusable = lost = cpu_lost = loads = loaded = over = 0
    block_s = load_s = saved_s = 0.0
    for st, held in zip(steps, coverage.tokens, strict=True):
        hold = rule(st)
        blocks = math.ceil(st.held_tokens / block_size)
        r = st.reusable_tokens
        reusable += r
        block_s += blocks * min(st.gap_s, hold.paid_s)
        if st.gap_s <= hold.reuse_until_s or r <= 0:
            continue
        served = min(r, held)
        if served and max_new_tokens and st.prompt_tokens - served > max_new_tokens:
            over += served
            served = 0  # too many new tokens to prefill on D: the turn goes to P
        if served:
            loads += 1
            loaded += served
            load_s += load_s_per_token * served
            n = st.prompt_tokens
            saved_s += cost.prefill_s(n, 0) - cost.prefill_s(n - served, served)
        lost += r - served
        if st.gap_s <= horizon_s:
            cpu_lost += r - served
    block_s += sum(math.ceil(t.held_tokens / block_size) for t in tails) * tail_hold_s
    share = 1.0 / reusable if reusable else 0.0
    return RetentionRow(
        "",
        lost * share,
        block_s,
        0.0,
        lost,
        reusable,
        cpu_lost * share,
        cpu_tier_blocks=coverage.spec.capacity_blocks,
        cpu_loads=loads,
        cpu_loaded_tokens=loaded,
        cpu_over_budget_tokens=over,
        cpu_load_s=load_s,
        cpu_prefill_s_saved=saved_s,
        cpu_occupancy_block_seconds=coverage.occupancy_block_s,
    )


def load_s_per_token(cost: CostModel) -> float:
    """The cost model's CPU load time per token, else the path model's default (``Curves``:
    262,144 bytes a token at 50 GB/s), as a cost file from ``agentkv calibrate`` leaves it 0."""
    return cost.cpu_load_s_per_token or (Curves().cpu_load_s_per_token or 0.0)


def cpu_tier_table(
    sessions: Sequence[Session],
    families: Sequence[str],
    specs: Sequence[CpuTierSpec],
    *,
    cost: CostModel,
    fixed_ttls: Sequence[float],
    lease: LeaseParams,
    block_size: int = 16,
    horizon_s: float = 3600.0,
    max_new_tokens: int = DecodeBudget().max_new_tokens,
) -> tuple[list[RetentionRow], list[CpuCoverage]]:
    """Every requested fixed and lease policy with each CPU tier behind it, named
    ``<policy>+cpu<blocks>``; and each tier's run."""
    steps, tails = steps_of(sessions, block_size)
    if not steps:
        raise ValueError("the trace has no session with two turns or more")
    baseline = evaluate_holds(
        steps, tails, fixed_hold(BASELINE), tail_hold_s=BASELINE, block_size=block_size
    ).block_seconds
    rules = policy_rules([f for f in families if f in CPU_FAMILIES], fixed_ttls, lease)
    per_token = load_s_per_token(cost)
    rows: list[RetentionRow] = []
    runs: list[CpuCoverage] = []
    for spec in specs:
        coverage = cpu_coverage(sessions, spec, block_size=block_size)
        runs.append(coverage)
        for name, rule, tail_s, params in rules:
            row = evaluate_with_cpu(
                steps,
                tails,
                rule,
                coverage,
                tail_hold_s=tail_s,
                cost=cost,
                load_s_per_token=per_token,
                max_new_tokens=max_new_tokens,
                block_size=block_size,
                horizon_s=horizon_s,
            )
            row.policy = f"{name}+cpu{spec.capacity_blocks}"
            row.params = {
                **params,
                "cpu_tier_blocks": spec.capacity_blocks,
                "cpu_save_failure_rate": spec.failure_rate,
                "concurrency": spec.concurrency,
                "cpu_max_new_tokens": max_new_tokens,
            }
            if baseline:
                row.block_seconds_vs_fixed_450 = row.block_seconds / baseline
                row.cpu_occupancy_vs_fixed_450 = coverage.occupancy_block_s / baseline
            rows.append(row)
    return rows, runs


def best_with_cpu(
    rows: Sequence[RetentionRow], capacity: int, max_vs_fixed_450: float = 1.0
) -> RetentionRow | None:
    """The row with a CPU tier of ``capacity`` blocks that loses least within
    ``max_vs_fixed_450`` of fixed-450's GPU block-seconds."""
    fits = [
        r
        for r in rows
        if r.cpu_tier_blocks == capacity and r.block_seconds_vs_fixed_450 <= max_vs_fixed_450
    ]
    return min(fits, key=lambda r: (r.lost_fraction, r.block_seconds), default=None)
