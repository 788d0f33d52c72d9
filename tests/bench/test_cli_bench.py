"""The `agentkv bench`, `plan` and `calibrate` commands: output, files, bad input."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from agentkv.cli import app
from tests._support.bench import CLAUDE_CODE, need

runner = CliRunner()


def test_help_lists_the_commands():
    r = runner.invoke(app, ["--help"], terminal_width=200)
    assert r.exit_code == 0
    for name in ("bench", "plan", "calibrate"):
        assert name in r.output
    r = runner.invoke(app, ["bench", "--help"], terminal_width=200)
    assert "replay" in r.output and "curves" in r.output
    r = runner.invoke(app, ["bench", "replay", "--help"], terminal_width=200)
    for flag in ("--endpoint", "--local", "--compare", "--sessions", "--concurrency"):
        assert flag in r.output
    assert "--time-scale" in r.output and "--out" in r.output


def test_plan_prints_and_writes(small_trace: Path, tmp_path: Path):
    out = tmp_path / "plan"
    r = runner.invoke(
        app,
        ["plan", str(small_trace), "--preset", "laptop", "--out", str(out)],
        terminal_width=200,
    )
    assert r.exit_code == 0, r.output
    assert "recommend: decoder_kv_blocks_ttl =" in r.output
    assert "kv_recompute_threshold = 48" in r.output  # the laptop preset's break-even read
    assert "CPU offload tier beyond the TTL" in r.output
    data = json.loads((out / "plan.json").read_text())
    assert data["recommendation"]["kv_recompute_threshold"] == 48
    assert data["costs"]["source"] == "preset laptop"
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_on_the_real_trace_with_a_cost_file(tmp_path: Path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"prefill_s_per_token": 2e-5, "transfer_s_base": 0.01}))
    r = runner.invoke(
        app,
        ["plan", str(need(CLAUDE_CODE)), "--costs", str(costs), "--sessions", "3"],
        terminal_width=200,
    )
    assert r.exit_code == 0, r.output
    assert "3 sessions" in r.output and f"cost file {costs}" in r.output


def test_plan_bad_input(small_trace: Path, tmp_path: Path):
    r = runner.invoke(app, ["plan", str(small_trace), "--preset", "nope"])
    assert r.exit_code == 2 and "unknown preset" in r.output
    r = runner.invoke(app, ["plan", str(small_trace), "--costs", "x.json", "--preset", "zero"])
    assert r.exit_code == 2 and "not both" in r.output
    r = runner.invoke(app, ["plan", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "missing.jsonl" in r.output
    r = runner.invoke(app, ["plan", str(small_trace), "--ttl", "a,b"])
    assert r.exit_code == 2 and "--ttl" in r.output


def test_replay_bad_input(small_trace: Path):
    r = runner.invoke(
        app, ["bench", "replay", str(small_trace), "--endpoint", "http://x/v1", "--local", "local"]
    )
    assert r.exit_code == 2 and "not both" in r.output
    r = runner.invoke(app, ["bench", "replay", str(small_trace), "--max-context", "10"])
    assert r.exit_code == 2 and "no session" in r.output
    r = runner.invoke(
        app, ["bench", "replay", str(small_trace), "--endpoint", "http://x/v1", "--compare"]
    )
    assert r.exit_code == 2 and "--unverified-endpoint" in r.output
    r = runner.invoke(app, ["bench", "replay", str(small_trace), "--time-scale", "0"])
    assert r.exit_code == 2 and "positive" in r.output
    r = runner.invoke(app, ["bench", "replay", str(small_trace), "--paths", "fastest"])
    assert r.exit_code == 2 and "unknown --paths" in r.output
    r = runner.invoke(
        app, ["bench", "replay", str(small_trace), "--endpoint", "http://x/v1", "--paths", "pull"]
    )
    assert r.exit_code == 2 and "--paths needs --local" in r.output
