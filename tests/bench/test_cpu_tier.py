"""D's CPU tier as a retention path (agentkv.bench.cpu_tier): the run-length LRU against a block
by block one, the composed clock and the accounting on hand-built traces, and the CLI flags."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest

from agentkv.bench.cpu_tier import (
    CpuTierSpec,
    RunLru,
    best_with_cpu,
    cpu_coverage,
    cpu_tier_table,
    evaluate_with_cpu,
)
from agentkv.bench.plan import steps_of
from agentkv.bench.retention import (
    LeaseParams,
    RetentionRow,
    evaluate_holds,
    fixed_hold,
    lease_hold,
    retention_table,
)
from agentkv.bench.traces import Session, Turn
from agentkv.sim.costmodel import PRESETS
from tests._support.bench import CLAUDE_CODE, need

COST = PRESETS["qwen3-32b-p5en"]
PER_TOKEN = 5.2e-6


class BlockLru:
    """The same tier one block at a time, as vLLM's LRU manager keeps it: a save stores the
    sequence's missing blocks in order (evicting the least recent block not in the sequence, or
    not storing when none is left), then touches the whole sequence in reverse."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[tuple[int, int], None] = OrderedDict()

    def save(self, keys: list[tuple[int, int]]) -> None:
        protected = set(keys)
        for key in keys:
            if key in self.blocks:
                continue
            if len(self.blocks) >= self.capacity:
                victim = next((k for k in self.blocks if k not in protected), None)
                if victim is None:
                    continue
                del self.blocks[victim]
            self.blocks[key] = None
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def covered(self, keys: list[tuple[int, int]], limit: int) -> int:
        n = 0
        while n < min(limit, len(keys)) and keys[n] in self.blocks:
            n += 1
        return n


def _keys(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(gen, pos) for gen, lo, hi in pieces for pos in range(lo, hi)]


@pytest.mark.parametrize("seed", range(6))
def test_runs_match_a_block_by_block_lru(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([7, 20, 45])
    fast, ref = RunLru(capacity), BlockLru(capacity)
    chains: list[list[tuple[int, int, int]]] = [[] for _ in range(4)]
    gens = 0
    for _ in range(300):
        i = rng.randrange(len(chains))
        chain = chains[i]
        limit = rng.randrange(0, 40)
        assert fast.covered(chain, limit) == ref.covered(_keys(chain), limit)
        top = chain[-1][2] if chain else 0
        if chain and rng.random() < 0.3:  # a rewrite: keep a prefix, then new blocks
            kept = rng.randrange(0, top)
            chain = [(g, lo, min(hi, kept)) for g, lo, hi in chain if lo < kept]
            top = kept
        grow = rng.randrange(0, 12)
        if grow:
            gens += 1
            chain = [*chain, (gens, top, top + grow)]
        chains[i] = chain
        fast.save(chain)
        ref.save(_keys(chain))
        assert fast.size == len(ref.blocks) <= capacity


def test_failed_stores_leave_holes_that_the_next_save_retries() -> None:
    tier = RunLru(1000, failure_rate=0.5, seed=3)
    chain = [(1, 0, 200)]
    tier.save(chain)
    assert tier.stored + tier.failed == 200 and 50 < tier.failed < 150
    first_failed = tier.covered(chain, 200)
    assert first_failed < 200 and tier.size == tier.stored
    failed = tier.failed
    tier.save(chain)  # only the failed blocks are offered again
    assert tier.stored + tier.failed == 200 + failed
    assert tier.covered(chain, 200) >= first_failed
    nothing = RunLru(10, failure_rate=1.0)
    nothing.save(chain)
    assert (nothing.size, nothing.failed, nothing.covered(chain, 200)) == (0, 200, 0)


def _two_sessions() -> list[Session]:
    """A: 80 tokens held (5 blocks), a turn 100 s later appends (80 reusable); B: 8 blocks."""
    a = (
        Turn(0, 0, 64, 17, (1,), kind="first", api_s=1.0),
        Turn(101, 100, 128, 1, (1, 2), api_s=1.0),
    )
    b = (Turn(0, 0, 128, 1, (11, 12), kind="first", api_s=1.0),)
    return [
        Session("a", a, "claude-code", block_size=64, namespace="a"),
        Session("b", b, "claude-code", block_size=64, namespace="b"),
    ]


def test_lru_evicts_a_conversations_tail_first() -> None:
    sessions = _two_sessions()
    # both in flight: B's 8 blocks (t = 1 s) evict A's last 3 of 5; A's prefix of 2 is left
    both = cpu_coverage(sessions, CpuTierSpec(10, concurrency=2))
    assert both.tokens == [32] and both.evicted == 3 + 6  # and 6 of B's at A's second save
    # one at a time: B starts after A's last turn, A's turn finds all 5 blocks
    alone = cpu_coverage(sessions, CpuTierSpec(10, concurrency=1))
    assert alone.tokens == [80] and alone.duration_s == 1 + 100 + 1 + 1
    assert cpu_coverage(sessions, CpuTierSpec(13, concurrency=2)).tokens == [80]
    # occupancy: full (10 blocks) from 1 s to the end, 102 s (A's second save evicts 6 of B's)
    assert both.occupancy_block_s == pytest.approx(10 * 101)


def test_accounting_a_load_once_and_failed_saves_lost() -> None:
    sessions = _two_sessions()
    steps, tails = steps_of(sessions)
    (step,) = steps
    assert (step.reusable_tokens, step.prompt_tokens) == (80, 128)

    def row(spec: CpuTierSpec, rule_ttl: float = 60, max_new: int = 2048) -> RetentionRow:
        coverage = cpu_coverage(sessions, spec)
        return evaluate_with_cpu(
            steps,
            tails,
            fixed_hold(rule_ttl),
            coverage,
            tail_hold_s=rule_ttl,
            cost=COST,
            load_s_per_token=PER_TOKEN,
            max_new_tokens=max_new,
        )

    partial = row(CpuTierSpec(10, concurrency=2))  # the GPU copy lapsed at 60 s; 32 in the tier
    assert (partial.lost_tokens, partial.cpu_loads, partial.cpu_loaded_tokens) == (48, 1, 32)
    assert partial.cpu_load_s == pytest.approx(32 * PER_TOKEN)
    assert partial.cpu_prefill_s_saved == pytest.approx(
        COST.prefill_s(128, 0) - COST.prefill_s(96, 32)
    )
    assert partial.cpu_tier_blocks == 10
    whole = row(CpuTierSpec(10, concurrency=1))
    assert (whole.lost_tokens, whole.cpu_loads, whole.lost_fraction) == (0, 1, 0.0)
    failed = row(CpuTierSpec(10, failure_rate=1.0, concurrency=1))
    assert (failed.lost_tokens, failed.cpu_loads, failed.cpu_load_s) == (80, 0, 0.0)
    # within the GPU hold nothing is loaded; too many new tokens for D: P recomputes
    assert row(CpuTierSpec(10, concurrency=1), rule_ttl=450).cpu_loads == 0
    over = row(CpuTierSpec(10, concurrency=1), max_new=47)
    assert (over.lost_tokens, over.cpu_loads, over.cpu_over_budget_tokens) == (80, 0, 80)
    assert partial.cpu_over_budget_tokens == 0
    assert row(CpuTierSpec(10, concurrency=1), max_new=48).cpu_loads == 1
    # GPU block-seconds are the policy's: 5 blocks x 60 s, and the last turn's 8 and B's 8
    assert partial.block_seconds == 5 * 60 + (8 + 8) * 60


def test_an_empty_tier_changes_nothing() -> None:
    sessions = _two_sessions()
    steps, tails = steps_of(sessions)
    empty = cpu_coverage(sessions, CpuTierSpec(1, failure_rate=1.0))
    for rule, tail in ((fixed_hold(60), 60.0), (lease_hold(LeaseParams(30, 10, 900)), 10.0)):
        base = evaluate_holds(steps, tails, rule, tail_hold_s=tail)
        cpu = evaluate_with_cpu(
            steps, tails, rule, empty, tail_hold_s=tail, cost=COST, load_s_per_token=PER_TOKEN
        )
        assert (cpu.lost_tokens, cpu.block_seconds) == (base.lost_tokens, base.block_seconds)
        assert cpu.cpu_tier_fraction == base.cpu_tier_fraction


def test_table_and_best_on_the_real_trace() -> None:
    from agentkv.bench.traces import load_trace

    sessions = load_trace(need(CLAUDE_CODE), limit=3)
    steps, tails = steps_of(sessions)
    plain = {r.policy: r for r in retention_table(steps, tails, ["fixed", "lease"])}
    rows, runs = cpu_tier_table(
        sessions,
        ["fixed", "lease", "oracle"],
        [CpuTierSpec(4096), CpuTierSpec(65536)],
        cost=COST,
        fixed_ttls=(450,),
        lease=LeaseParams(),
    )
    assert [r.policy for r in rows] == [
        f"{p}+cpu{c}" for c in (4096, 65536) for p in ("fixed-450", "lease", "lease-idle-tail")
    ]
    assert [run.spec.capacity_blocks for run in runs] == [4096, 65536]
    for r in rows:
        base = plain[r.policy.split("+")[0]]
        assert r.block_seconds == base.block_seconds  # the tier holds no GPU memory
        assert r.lost_tokens <= base.lost_tokens
    small, large = rows[0], rows[3]
    assert large.lost_tokens <= small.lost_tokens and large.cpu_loads >= 1
    assert rows[0].block_seconds_vs_fixed_450 == 1.0
    assert best_with_cpu(rows, 65536) is not None
    assert best_with_cpu(rows, 65536, max_vs_fixed_450=0.0) is None


def test_plan_cpu_tier_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agentkv.cli import app

    out = tmp_path / "plan.json"
    args = ["plan", str(need(CLAUDE_CODE)), "--sessions", "3", "--retention", "fixed,lease"]
    cpu = ["--cpu-tier-blocks", "4096,65536", "--cpu-save-failure-rate", "0.01"]
    r = CliRunner().invoke(
        app, [*args, *cpu, "--concurrency", "2", "--json", str(out)], terminal_width=200
    )
    assert r.exit_code == 0, r.output
    assert "retention with D's CPU tier" in r.output
    assert "retention goal (≤ 3.5% lost within fixed-450's GPU block-seconds)" in r.output
    data = json.loads(out.read_text())
    tiers = data["retention_cpu_tiers"]
    assert [t["cpu_tier_blocks"] for t in tiers] == [4096, 65536]
    assert tiers[1]["cpu_tier_gib"] == 256 and tiers[0]["concurrency"] == 2
    rows = {row["policy"]: row for row in data["retention"]}
    lease = rows["lease+cpu65536"]
    assert lease["params"]["cpu_save_failure_rate"] == 0.01
    assert lease["lost_tokens"] <= rows["lease"]["lost_tokens"]
    assert lease["block_seconds"] == rows["lease"]["block_seconds"]
    bad = CliRunner().invoke(app, [*args[:4], *cpu])
    assert bad.exit_code == 2 and "needs --retention" in bad.output
