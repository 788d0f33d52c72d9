"""The planner's arithmetic on a small trace checked by hand, and on the real trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv.bench.plan import (
    Step,
    Tail,
    break_even_tokens,
    evaluate,
    make_plan,
    offload_verdict,
    router_margin,
    steps_of,
)
from agentkv.bench.retention import (
    SWEEP_LEASE_S,
    SWEEP_MAX_HOLD_S,
    SWEEP_UI_IDLE_S,
    LeaseParams,
    RetentionRow,
    best_lease,
    lease_name,
    retention_report,
    retention_table,
    sweep_grid,
)
from agentkv.bench.traces import Session, Turn, load_trace
from agentkv.sim.costmodel import PRESETS, CostModel
from tests._support.bench import CLAUDE_CODE, need

# 1 ms per prefilled token; a read costs 50 ms + 1 ms per 16-token block; nothing else
COST = CostModel(
    prefill_s_per_token=1e-3, transfer_s_base=0.05, transfer_s_per_block=1e-3, block_size=16
)


def _session() -> Session:
    turns = (
        Turn(0, 0, 256, 32, (1, 2, 3, 4), kind="first"),
        Turn(20, 10, 352, 32, (1, 2, 3, 4, 5, 6)),  # appends 32 + 64: D holds 287, all resent
        Turn(150, 100, 448, 32, (1, 2, 3, 4, 5, 7, 8)),  # appends: D holds 383
        Turn(1200, 1000, 256, 32, (1, 2, 20, 21)),  # rewrite after 2 blocks: 128 reusable
    )
    return Session("s", turns, "claude-code", block_size=64, namespace="s")


def test_steps_by_hand():
    steps, tails = steps_of([_session()], 16)
    assert [(s.kind, s.gap_s, s.reusable_tokens, s.held_tokens) for s in steps] == [
        ("append", 10, 287, 287),
        ("append", 100, 383, 383),
        ("rewrite", 1000, 128, 479),
    ]
    assert [t.held_tokens for t in tails] == [287]


def test_break_even_and_margin():
    # 50 ms + N/16 ms against N ms: reads pay from 54 tokens, i.e. 4 blocks
    assert break_even_tokens(COST, 16) == 64
    assert break_even_tokens(CostModel(transfer_s_base=1.0), 16) is None  # prefill is free
    assert router_margin(480) == 30 and router_margin(60) == 6 and router_margin(160) == 10


def test_one_row_by_hand():
    steps, tails = steps_of([_session()], 16)
    row = evaluate(steps, tails, ttl_s=480, threshold=64, cost=COST)
    assert row.router_ttl_s == 450
    assert row.reusable_tokens == 287 + 383 + 128
    assert row.captured_tokens == 287 + 383
    assert (row.turns_reused, row.turns_expired, row.lost_to_ttl_tokens) == (2, 1, 128)
    # blocks x seconds: 18 x 10 + 24 x 100 + 30 x 480 (expired) + the tail's 18 x 480
    assert row.retained_block_s == 18 * 10 + 24 * 100 + 30 * 480 + 18 * 480
    assert row.prefill_s_saved == pytest.approx(0.287 + 0.383)
    # a read costs 50 ms + 1 ms per block: 287 - 68 and 383 - 74 ms saved
    assert row.ttft_s_saved == pytest.approx(0.219 + 0.309)
    # recomputing: prefill + the P->D transfer of each prompt
    assert row.ttft_s_recompute == pytest.approx(0.424 + 0.526 + 0.322)
    assert row.captured_pct == pytest.approx(100 * 670 / 798)


def test_ttl_threshold_and_epoch_rule_by_hand():
    steps, tails = steps_of([_session()], 16)
    old_rule = {"epoch_rule": True}  # the router before planner v2: rewrites read nothing
    short = evaluate(steps, tails, ttl_s=60, threshold=64, cost=COST, **old_rule)  # router 54 s
    assert short.captured_tokens == 287 and short.turns_expired == 2
    assert short.retained_block_s == 18 * 10 + 24 * 60 + 30 * 60 + 18 * 60
    high = evaluate(steps, tails, ttl_s=480, threshold=300, cost=COST, **old_rule)
    assert high.captured_tokens == 383 and high.lost_to_threshold_tokens == 287
    long = evaluate(steps, tails, ttl_s=3600, threshold=64, cost=COST, **old_rule)
    assert long.captured_tokens == 670 and long.lost_to_rewrites_tokens == 128
    verified = evaluate(steps, tails, ttl_s=3600, threshold=64, cost=COST)  # today's router
    assert verified.captured_tokens == 798


def test_recommendation_by_hand():
    plan = make_plan([_session()], COST, block_size=16, epoch_rule=True)
    # 15 s (router 9 s) catches nothing, 30-60 s the first reuse, 120 s both appends: 670 of
    # the best 670 (the rewrite is never read under the epoch rule)
    assert (plan.threshold, plan.ttl_s, plan.router_ttl_s) == (64, 120, 112.5)
    assert not plan.offload.pays and plan.offload.turns == 0
    lenient = make_plan([_session()], COST, block_size=16)
    assert lenient.ttl_s == 1800  # the rewrite's 128 tokens come back 1000 s later


def test_offload_verdict_by_hand():
    steps, _ = steps_of([_session()], 16)
    cost = COST.model_copy(update={"kv_bytes_per_token": 1000})
    v = offload_verdict(steps, ttl_s=120, threshold=64, cost=cost, gbps=1.0, epoch_rule=False)
    assert (v.turns, v.tokens) == (1, 128) and v.pays
    assert v.share_pct == pytest.approx(100 * 128 / 798)
    assert v.ttft_s_saved == pytest.approx(0.128 - 128 * 1000 / 1e9)
    assert v.gib_hours == pytest.approx(30 * 16 * 1000 * (1000 - 120) / 2**30 / 3600)


def test_plan_on_the_real_trace():
    sessions = load_trace(need(CLAUDE_CODE), limit=4)
    plan = make_plan(sessions, PRESETS["qwen3-32b-p5en"])
    rows = [r for r in plan.rows if r.threshold == plan.threshold]
    captured = [r.captured_pct for r in rows]
    assert captured == sorted(captured)  # a longer TTL never captures less
    held = [r.retained_block_s for r in rows]
    assert held == sorted(held)  # and never holds less
    assert plan.break_even_tokens is not None and plan.threshold % 16 == 0
    assert plan.stats["reusable_share_pct"] > 90
    assert plan.to_dict()["recommendation"]["decoder_kv_blocks_ttl"] == plan.ttl_s


def test_plan_needs_two_turns(tmp_path: Path):
    with pytest.raises(ValueError, match="two turns"):
        make_plan([Session("x", (Turn(0, 0, 10, 1),), "claude-code")], COST)


# -- retention policies (agentkv.bench.retention) ----------------------------------------------
def _waits() -> tuple[list[Step], list[Tail]]:
    """Two tool waits and two user waits, 1,000 reusable tokens; a 2-block last turn."""
    steps = [
        Step("s", 1, "append", 10, 200, 160, 100, tool_wait=True),  # 10 blocks
        Step("s", 2, "append", 1000, 400, 320, 200, tool_wait=True),  # 20 blocks
        Step("s", 3, "append", 100, 200, 160, 300),  # a user wait, 10 blocks
        Step("s", 4, "append", 500, 200, 160, 400),
    ]
    return steps, [Tail("s", 32)]


def _by_name(rows: list[RetentionRow]) -> dict[str, RetentionRow]:
    return {r.policy: r for r in rows}


def test_fixed_ttls_by_hand():
    steps, tails = _waits()
    rows = _by_name(retention_table(steps, tails, ["fixed"], fixed_ttls=(60, 450)))
    assert list(rows) == ["fixed-60", "fixed-450"]
    # 450 s: the 1,000 s tool wait and the 500 s user wait come back too late
    f450 = rows["fixed-450"]
    assert (f450.lost_tokens, f450.reusable_tokens, f450.lost_fraction) == (600, 1000, 0.6)
    assert f450.block_seconds == 10 * 10 + 20 * 450 + 10 * 100 + 10 * 450 + 2 * 450
    assert f450.block_seconds_vs_fixed_450 == 1.0
    f60 = rows["fixed-60"]
    assert f60.lost_fraction == 0.9
    assert f60.block_seconds == 10 * 10 + 20 * 60 + 10 * 60 + 10 * 60 + 2 * 60
    assert f60.block_seconds_vs_fixed_450 == pytest.approx(2620 / 15500)
    # a CPU tier keeping what D freed for an hour serves both late turns
    assert f450.cpu_tier_fraction == 0.6
    assert f450.cpu_tier_block_seconds == 20 * (1000 - 450) + 10 * (500 - 450)
    short = _by_name(retention_table(steps, tails, ["fixed"], fixed_ttls=(450,), horizon_s=800))
    assert short["fixed-450"].cpu_tier_fraction == 0.4  # the 1,000 s gap is past the horizon


def test_a_turn_at_the_ttl_still_reuses():
    steps = [Step("s", 1, "append", 450, 20, 16, 10)]
    (row,) = retention_table(steps, [], ["fixed"], fixed_ttls=(450,))
    assert row.lost_tokens == 0 and row.block_seconds == 450


def test_oracles_by_hand():
    steps, tails = _waits()
    rows = _by_name(retention_table(steps, tails, ["oracle"]))
    assert list(rows) == ["oracle-450", "oracle-1800", "oracle-budget"]
    # holds exactly the gaps within its cap, nothing else, nothing after the last turn
    assert rows["oracle-450"].lost_fraction == 0.6
    assert rows["oracle-450"].block_seconds == 10 * 10 + 10 * 100
    assert rows["oracle-1800"].lost_fraction == 0.0
    assert rows["oracle-1800"].block_seconds == 10 * 10 + 20 * 1000 + 10 * 100 + 10 * 500
    # within fixed-450's 15,500 block-s: the waits cheapest per reusable token (100, 1,000 and
    # 5,000 block-s); the 20,000 block-s tool wait does not fit
    floor = rows["oracle-budget"]
    assert (floor.lost_tokens, floor.block_seconds) == (200, 6100)
    assert floor.params == {"budget_block_s": 15500}


def test_lease_by_hand():
    steps, tails = _waits()
    rows = _by_name(retention_table(steps, tails, ["lease"], lease=LeaseParams(300, 30, 1800)))
    lease = rows["lease"]
    # tool waits alive (both reused); the 500 s user wait is past 300 s + the lapse: lost
    assert lease.lost_tokens == 400
    # the user wait is paid until 300 + 30 s; the dead last turn for 30 s
    assert lease.block_seconds == 10 * 10 + 20 * 1000 + 10 * 100 + 10 * 330 + 2 * 30
    assert lease.block_seconds_vs_fixed_450 == pytest.approx(24460 / 15500)
    assert lease.params == {"ui_idle_s": 300, "lease_s": 30, "max_hold_s": 1800}
    # the same lease when the agent sits at its prompt after the last turn
    assert rows["lease-idle-tail"].block_seconds == lease.block_seconds - 2 * 30 + 2 * 330
    assert rows["lease-idle-tail"].lost_tokens == 400


def test_lease_lapse_and_cap_by_hand():
    steps, tails = _waits()

    def lease(*params: float) -> RetentionRow:
        return _by_name(retention_table(steps, tails, ["lease"], lease=LeaseParams(*params)))[
            "lease"
        ]

    # renewed every 10 s, the lease lapses 20-30 s after death: after a 480 s idle timeout a
    # turn 500 s later still finds the KV; after 479 s it may not (counted lost), though D may
    # still hold it then (paid until the turn, within 479 + 30 s)
    assert lease(480, 30, 1800).lost_tokens == 0
    assert lease(479, 30, 1800).lost_tokens == 400
    assert lease(479, 30, 1800).block_seconds == 24460 - 10 * 330 + 10 * 500
    # D's TTL caps every hold: the 1,000 s tool wait is lost at 900 s
    capped = lease(300, 30, 900)
    assert capped.lost_tokens == 600
    assert capped.block_seconds == 24460 - 20 * 1000 + 20 * 900


def test_lease_sweep_grid_and_best():
    steps, tails = _waits()
    rows = retention_table(steps, tails, ["fixed", "lease-sweep"], fixed_ttls=(450,))
    sweep = [r for r in rows if r.policy.startswith("lease-ui")]
    assert len(sweep) == len(SWEEP_UI_IDLE_S) * len(SWEEP_LEASE_S) * len(SWEEP_MAX_HOLD_S)
    assert lease_name(LeaseParams(300, 30, 1800)) in {r.policy for r in sweep}
    grid = sweep_grid(rows)
    assert grid[0][:3] == ["max hold s", "lease s", "ui 60 s"]
    assert len(grid) == 1 + len(SWEEP_LEASE_S) * len(SWEEP_MAX_HOLD_S)
    assert grid[1][:2] == ["900", "10"]
    # every lease here holds the 1,000 s tool wait, more than fixed-450 in all
    assert best_lease(rows) is None
    best = best_lease(rows, max_vs_fixed_450=1.5)
    assert best is not None and best.block_seconds_vs_fixed_450 <= 1.5
    fits = [r for r in sweep if r.block_seconds_vs_fixed_450 <= 1.5]
    assert best.lost_fraction == min(r.lost_fraction for r in fits)
    assert best_lease(rows, max_vs_fixed_450=0.0) is None


def test_unknown_retention_policy():
    steps, tails = _waits()
    with pytest.raises(ValueError, match="unknown retention policy ttl"):
        retention_table(steps, tails, ["fixed", "ttl"])


def test_tool_waits_from_the_stop_reason(tmp_path: Path):
    def request(t: float, stop: str, outputs: list[str], inputs: list[str]) -> dict[str, object]:
        ids = list(range(1, 2 + int(t)))
        return {
            "t": t,
            "in": 64 * len(ids),
            "out": 10,
            "hash_ids": ids,
            "stop": stop,
            "output_types": outputs,
            "input_types": inputs,
            "think_time": 1.0,
        }

    session = {
        "id": "x",
        "block_size": 64,
        "requests": [
            request(0, "tool_use", ["text", "tool_use"], ["text"]),
            request(1, "end_turn", ["text"], ["tool_result"]),
            request(2, "", ["tool_use"], ["text"]),  # no stop reason: the outputs decide
            request(3, "", [], ["tool_result"]),
            request(4, "end_turn", ["text"], ["text"]),
        ],
    }
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(session) + "\n")
    (s,) = load_trace(path)
    assert [t.tool_call for t in s.turns] == [True, False, True, False, False]
    steps, _ = steps_of([s])
    assert [st.tool_wait for st in steps] == [True, False, True, False]


def test_retention_on_the_real_trace():
    sessions = load_trace(need(CLAUDE_CODE), limit=4)
    rows = _by_name(retention_report(sessions, ["fixed", "oracle", "lease"]))
    fixed = [rows[f"fixed-{t}"] for t in (60, 450, 900, 1800)]
    assert [r.lost_fraction for r in fixed] == sorted(
        (r.lost_fraction for r in fixed), reverse=True
    )
    assert [r.block_seconds for r in fixed] == sorted(r.block_seconds for r in fixed)
    # the oracle never loses more than the timer of its cap, at no more cost
    for cap in (450, 1800):
        assert rows[f"oracle-{cap}"].lost_fraction <= rows[f"fixed-{cap}"].lost_fraction
        assert rows[f"oracle-{cap}"].block_seconds <= rows[f"fixed-{cap}"].block_seconds
    assert rows["oracle-budget"].lost_fraction <= rows["fixed-450"].lost_fraction
    assert rows["oracle-budget"].block_seconds <= rows["fixed-450"].block_seconds
    # a UI that never times out keeps every wait up to D's TTL: it loses what that TTL loses
    forever = _by_name(
        retention_report(sessions, ["lease"], fixed_ttls=(), lease=LeaseParams(10**6, 30, 900))
    )["lease"]
    assert forever.lost_tokens == rows["fixed-900"].lost_tokens
    assert forever.block_seconds < rows["fixed-900"].block_seconds  # dead sessions freed early
    assert any(s.tool_wait for s in steps_of(sessions)[0])


def test_plan_retention_cli_on_the_real_trace(tmp_path: Path):
    from typer.testing import CliRunner

    from agentkv.cli import app

    out = tmp_path / "plan.json"
    args = ["plan", str(need(CLAUDE_CODE)), "--sessions", "3", "--retention", "fixed,lease"]
    r = CliRunner().invoke(
        app, [*args, "--ui-idle-s", "120", "--json", str(out)], terminal_width=200
    )
    assert r.exit_code == 0, r.output
    assert "retention: reusable tokens lost against D's block-seconds" in r.output
    data = json.loads(out.read_text())
    rows = {row["policy"]: row for row in data["retention"]}
    assert list(rows) == [
        "fixed-60",
        "fixed-450",
        "fixed-900",
        "fixed-1800",
        "lease",
        "lease-idle-tail",
    ]
    for row in rows.values():
        assert 0 <= row["lost_fraction"] <= 1 and row["block_seconds"] > 0
    assert rows["fixed-450"]["block_seconds_vs_fixed_450"] == 1.0
    assert rows["lease"]["params"] == {"ui_idle_s": 120, "lease_s": 30, "max_hold_s": 1800}
    assert "tool_wait" in data["retention_assumptions"]
    waits = data["retention_waits"]
    assert waits["tool_waits"] + waits["user_waits"] == waits["transitions"] > 0
    assert waits["last_turns"] == 3 and 0 < waits["tool_wait_reusable_share"] < 1
    assert data["recommendation"]["decoder_kv_blocks_ttl"] > 0  # the plan is still there
    # the same figures as the library's
    sessions = load_trace(CLAUDE_CODE, limit=3)
    lib = retention_report(sessions, ["lease"], lease=LeaseParams(120, 30, 1800))[0]
    assert rows["lease"]["lost_fraction"] == lib.lost_fraction
    assert rows["lease"]["block_seconds"] == lib.block_seconds
    bad = CliRunner().invoke(app, [*args[:4], "--retention", "fixd"])
    assert bad.exit_code == 2 and "unknown retention policy fixd" in bad.output
