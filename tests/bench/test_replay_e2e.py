"""`agentkv bench replay --compare` on real processes: the `local` profile's simulated P and D,
agentkv's router and a second router with the unverified policy, through the SDK.

The small trace has an append, a reasoning strip, a compaction, a gap beyond the router's TTL
and plain appends; time runs 200 times faster (the router's 450 s TTL is 2.25 s)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.bench.deploy import Stack
from agentkv.cli import app
from tests._support.bench import TIME_SCALE

pytestmark = pytest.mark.e2e


def _replay(stack: Stack, trace: Path, out: Path) -> dict[str, list[dict]]:
    assert stack.unverified_url is not None
    args = [
        "bench",
        "replay",
        str(trace),
        "--endpoint",
        stack.base_url,
        "--compare",
        "--unverified-endpoint",
        stack.unverified_url,
        "--router-ttl",
        str(stack.router_ttl_s * TIME_SCALE),
        "--decoder-ttl",
        str(stack.decoder_ttl_real_s),
        "--time-scale",
        str(TIME_SCALE),
        "--token-scale",
        "0.125",
        "--concurrency",
        "2",
        "--out",
        str(out),
        "--no-progress",
    ]
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "agentkv bench replay" in result.output and "report.md" in result.output
    rows = json.loads((out / "turns.json").read_text())
    by: dict[str, list[dict]] = {}
    for r in rows:
        assert r["error"] is None, r
        by.setdefault(r["policy"], []).append(r)
    for policy in by:
        by[policy].sort(key=lambda r: (r["session"], r["turn"]))
    return by


def test_compare_on_the_small_trace(stack: Stack, small_trace: Path, tmp_path: Path):
    by = _replay(stack, small_trace, tmp_path / "out")
    assert set(by) == {"none", "unverified", "agentkv"}
    kinds = [(r["session"], r["kind"]) for r in by["agentkv"]]
    assert kinds == [
        ("trace_a", "first"),
        ("trace_a", "append"),
        ("trace_a", "strip"),
        ("trace_a", "rewrite"),
        ("trace_a", "append"),
        ("trace_a", "append"),
        ("trace_b", "first"),
        ("trace_b", "append"),
        ("trace_b", "append"),
        ("trace_b", "append"),
    ]
    # the same prompts on the wire under every policy
    for policy in ("none", "unverified"):
        assert [r["prompt_tokens"] for r in by[policy]] == [
            r["prompt_tokens"] for r in by["agentkv"]
        ]

    agentkv = by["agentkv"]
    assert all(r["wrong_kv_tokens"] == 0 for r in agentkv)
    assert all(r["model_ttft_ms"] and r["model_ttft_ms"] > 0 for r in agentkv)
    decisions = [r["decision"] for r in agentkv]
    # planner v2: the strip and the compaction read their verified prefix back
    assert decisions == [
        "miss", "pull", "pull", "pull", "expired", "pull",
        "miss", "pull", "pull", "pull",
    ]  # fmt: skip
    for r in agentkv:
        if r["kind"] == "append" and r["within_ttl"]:
            # every token D held that the prompt repeats is read back (the ideal)
            assert r["ideal_tokens"] > 0
            assert r["reused_tokens"] == r["ideal_tokens"] == r["held_tokens"]
    expired = agentkv[4]
    assert not expired["within_ttl"] and expired["expired"] and expired["ideal_tokens"] == 0
    strip, rewrite = agentkv[2], agentkv[3]
    # what survives: the previous prompt (strip), the system prompt (compaction)
    assert strip["ideal_tokens"] == agentkv[1]["prompt_tokens"] // 16 * 16
    assert 1024 // 8 <= rewrite["ideal_tokens"] <= 1024 // 8 + 16
    for turn in (strip, rewrite):  # all of it, and no more
        assert turn["reused_tokens"] == turn["ideal_tokens"] > 0

    unverified = by["unverified"]
    assert unverified[2]["wrong_kv_tokens"] > 0 and unverified[3]["wrong_kv_tokens"] > 0
    assert all(r["wrong_kv_tokens"] == 0 for r in unverified[:2] + unverified[6:])

    none = by["none"]
    assert all(r["reused_tokens"] == 0 and r["decision"] == "miss" for r in none)
    assert all(r["retained_block_s"] == 0 for r in none)

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["policies"]
    assert summary["agentkv"]["by_kind"]["append"]["captured_pct"] == 100.0
    assert summary["agentkv"]["wrong_kv_tokens"] == 0
    assert summary["unverified"]["wrong_kv_tokens"] > 0
    assert summary["none"]["compute_saved_pct"] == 0.0
    assert summary["agentkv"]["latency_saved_ms"] is not None
    with (tmp_path / "out" / "turns.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 30
    for name in ("ttft_by_context.png", "reuse_fraction.png", "retained_block_seconds.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## By turn kind" in report and "![reuse_fraction.png](reuse_fraction.png)" in report


def test_vllm_multi_turn_json_replays_its_text(stack: Stack, tmp_path: Path):
    """vLLM's multi-turn benchmark format: the recorded text is sent and scripted as answers."""
    messages = []
    for i in range(3):
        messages.append({"role": "user", "content": f"Question {i}: " + "explain the cache " * 20})
        messages.append({"role": "assistant", "content": f"Answer {i}: " + "it keeps state " * 15})
    trace = tmp_path / "conversations.json"
    trace.write_text(json.dumps([{"id": "c1", "messages": messages}]))
    args = ["bench", "replay", str(trace), "--endpoint", stack.base_url, "--no-progress"]
    args += ["--router-ttl", str(stack.router_ttl_s * TIME_SCALE), "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "o" / "turns.json").read_text())
    assert [r["decision"] for r in rows] == ["miss", "pull", "pull"]
    assert all(r["reused_tokens"] == r["ideal_tokens"] == r["held_tokens"] for r in rows[1:])
