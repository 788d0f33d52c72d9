"""The ``lease`` policy of `agentkv bench replay` end to end on real processes: each agent is an
``AsyncClient(lease_s=…)`` against a router in front of a D with a long TTL (1,800 trace
seconds), beside agentkv's fixed-TTL policy on the shared deployment (450 s).

Time runs 200 times faster: the lease is 200 trace seconds (1 s real), the UI idle timeout
200 s, the tool wait 1,000 s (5 s real: longer than the lease and than the fixed TTL)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv.bench import runner
from agentkv.bench.deploy import Stack, local_stack
from agentkv.bench.replay_records import TurnRecord
from agentkv.bench.retention import LeaseParams
from tests._support.bench import SMALL_SESSIONS, TIME_SCALE, _session

pytestmark = pytest.mark.e2e

LEASE = LeaseParams(ui_idle_s=200.0, lease_s=200.0, max_hold_s=1800.0)


@pytest.fixture(scope="module")
def lease_stack() -> Iterator[Stack]:
    with local_stack(
        "local",
        time_scale=TIME_SCALE,
        preset="laptop",
        unverified=False,
        decoder_ttl_s=int(LEASE.max_hold_s),
        # a revived handle is read back through P: the leases' receipts are pulls
        router_options={
            **runner.lease_router_options(LEASE, TIME_SCALE),
            "paths": {"mode": "pull"},
        },
    ) as s:
        yield s


def _trace(tmp_path: Path) -> Path:
    a = _session(
        "agent_a",
        512,
        [
            ("first", 1024, 64, 0, False, 0),
            ("append", 1300, 64, 1000, False, 0),  # a tool wait longer than lease and TTL
            ("append", 1600, 64, 1000, False, 0),  # a user wait past the UI idle timeout
            ("append", 1900, 64, 3, False, 0),  # a short tool wait
        ],
    )
    a["requests"][1]["stop"] = "end_turn"  # the answer before the user wait is final
    b = _session(
        "agent_b",
        0,
        [
            ("first", 700, 50, 0, False, 0),
            ("append", 900, 50, 100, False, 0),  # a user wait within the UI idle timeout
        ],
    )
    b["requests"][0]["stop"] = "end_turn"
    path = tmp_path / "lease.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in (a, b)))
    return path


def test_leases_keep_live_agents_and_free_dead_ones(
    stack: Stack, lease_stack: Stack, tmp_path: Path
):
    assert SMALL_SESSIONS  # the shared deployment's module fixtures are the conftest's
    sessions = runner.select_sessions(
        runner.load_sessions(_trace(tmp_path), None), count=None, token_scale=0.125,
        max_turns=None, max_context=None,
    )  # fmt: skip
    fixed = runner.stack_settings(stack, concurrency=2)
    leased = runner.stack_settings(lease_stack, concurrency=2, lease=LEASE)
    run = runner.ReplayRun(
        {"agentkv": stack.base_url},
        fixed,
        decode_urls=stack.decode_urls,
        engine_urls=stack.engine_urls,
        drain_timeout_s=stack.decoder_ttl_real_s + 5,
        own={"lease": runner.stack_target(lease_stack, leased)},
    )
    out = runner.run(sessions, run, token_scale=0.125, out_dir=tmp_path / "o", plots=False,
                     progress=False)  # fmt: skip
    by: dict[str, dict[tuple[str, int], TurnRecord]] = {}
    for r in out.records:
        assert r.error is None, r
        assert not r.wrong_kv_tokens
        by.setdefault(r.policy, {})[(r.session, r.turn)] = r
    lease, timer = by["lease"], by["agentkv"]

    # a live agent keeps its KV through a tool wait longer than its lease (and the fixed TTL)
    tool = lease[("agent_a", 1)]
    assert tool.decision == "pull" and tool.within_ttl
    assert tool.reused_tokens == tool.ideal_tokens == tool.held_tokens > 0
    assert timer[("agent_a", 1)].decision in ("expired", "miss")
    assert timer[("agent_a", 1)].reused_tokens == 0
    # a dead agent's KV is gone when it comes back: its lease lapsed and the router released
    back = lease[("agent_a", 2)]
    assert back.decision == "miss" and back.reused_tokens == 0 and not back.within_ttl
    assert back.reusable_tokens > 0
    # a short tool wait after the revival, and a user wait within the UI idle timeout, pull
    for key in (("agent_a", 3), ("agent_b", 1)):
        assert lease[key].decision == "pull"
        assert lease[key].reused_tokens == lease[key].ideal_tokens > 0

    s = out.summaries
    assert s["lease"].reusable_tokens == s["agentkv"].reusable_tokens > 0  # the same prompts
    assert s["lease"].useful_reused_tokens > s["agentkv"].useful_reused_tokens
    lease_lost, timer_lost = s["lease"].lost_pct, s["agentkv"].lost_pct
    assert lease_lost is not None and timer_lost is not None and lease_lost < timer_lost
    # modelled: a finished session's blocks are held for the lease, not for D's TTL
    tail = lease[("agent_b", 1)]
    assert tail.held_to_ttl and tail.retained_block_s == tail.retained_blocks * LEASE.lease_s
    assert timer[("agent_b", 1)].retained_block_s == tail.retained_blocks * fixed.decoder_ttl_s

    # measured: D freed the last agent's blocks within its lease and a few seconds
    measured = s["lease"].measured
    assert measured["drained"] == 1.0
    assert measured["freed_after_last_death_s"] <= LEASE.lease_s * TIME_SCALE + 3.0
    assert measured["retained_block_s_decode"] > 0
    assert "freed_after_last_death_s" not in s["agentkv"].measured
    report = (tmp_path / "o" / "report.md").read_text()
    assert "agentkv + retention leases" in report and "freed after the last agent died" in report


def test_cli_runs_the_lease_policy_on_a_running_deployment(
    stack: Stack, lease_stack: Stack, tmp_path: Path
):
    """`--endpoint … --leases --lease-endpoint …`: the lease policy through the CLI."""
    from typer.testing import CliRunner

    from agentkv.cli import app

    args = ["bench", "replay", str(_trace(tmp_path)), "--endpoint", stack.base_url, "--leases"]
    args += ["--lease-endpoint", lease_stack.base_url, "--lease-s", str(LEASE.lease_s)]
    args += ["--ui-idle-s", str(LEASE.ui_idle_s), "--max-hold-s", str(LEASE.max_hold_s)]
    args += ["--router-ttl", str(stack.router_ttl_s * TIME_SCALE)]
    args += ["--decoder-ttl", str(stack.decoder_ttl_real_s), "--time-scale", str(TIME_SCALE)]
    args += ["--token-scale", "0.125", "--skip", "1", "--sessions", "1", "--no-progress"]
    args += ["--out", str(tmp_path / "o"), "--no-plots"]
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert set(summary["policies"]) == {"agentkv", "lease"}
    rows = json.loads((tmp_path / "o" / "turns.json").read_text())
    lease = [r for r in rows if r["policy"] == "lease"]
    assert [r["session"] for r in lease] == ["agent_b", "agent_b"]
    assert [r["decision"] for r in lease] == ["miss", "pull"]
    assert lease[1]["reused_tokens"] == lease[1]["ideal_tokens"] > 0


def test_cli_leases_with_an_endpoint_need_a_lease_endpoint(stack: Stack, tmp_path: Path):
    from typer.testing import CliRunner

    from agentkv.cli import app

    args = ["bench", "replay", str(_trace(tmp_path)), "--endpoint", stack.base_url, "--leases"]
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 2
    assert "needs --lease-endpoint" in result.output and "Traceback" not in result.output
