"""The planner's arithmetic on a small trace checked by hand, and on the real trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CLAUDE_CODE, need

from agentkv.bench.plan import (
    break_even_tokens,
    evaluate,
    make_plan,
    offload_verdict,
    router_margin,
    steps_of,
)
from agentkv.bench.traces import Session, Turn, load_trace
from agentkv.sim.costmodel import PRESETS, CostModel

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
    short = evaluate(steps, tails, ttl_s=60, threshold=64, cost=COST)  # router TTL 54 s
    assert short.captured_tokens == 287 and short.turns_expired == 2
    assert short.retained_block_s == 18 * 10 + 24 * 60 + 30 * 60 + 18 * 60
    high = evaluate(steps, tails, ttl_s=480, threshold=300, cost=COST)
    assert high.captured_tokens == 383 and high.lost_to_threshold_tokens == 287
    long = evaluate(steps, tails, ttl_s=3600, threshold=64, cost=COST)
    assert long.captured_tokens == 670 and long.lost_to_rewrites_tokens == 128
    lenient = evaluate(steps, tails, ttl_s=3600, threshold=64, cost=COST, epoch_rule=False)
    assert lenient.captured_tokens == 798


def test_recommendation_by_hand():
    plan = make_plan([_session()], COST, block_size=16)
    # 15 s (router 9 s) catches nothing, 30-60 s the first reuse, 120 s both appends: 670 of
    # the best 670 (the rewrite is never read under the epoch rule)
    assert (plan.threshold, plan.ttl_s, plan.router_ttl_s) == (64, 120, 112.5)
    assert not plan.offload.pays and plan.offload.turns == 0
    lenient = make_plan([_session()], COST, block_size=16, epoch_rule=False)
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
