"""`agentkv bench replay --local local --paths decode` on real processes: D's inter-token latency
and block-seconds in the report are what D's own ``/metrics`` counted during the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.sim.costmodel import PRESETS

pytestmark = pytest.mark.e2e


def test_d_itl_and_block_seconds_come_from_ds_metrics(small_trace: Path, tmp_path: Path):
    out = tmp_path / "out"
    args = [
        *("bench", "replay", str(small_trace), "--local", "local"),
        *("--preset", "qwen3-32b-p5en", "--paths", "decode", "--time-scale", "0.005"),
        *("--token-scale", "0.125", "--sessions", "1", "--out", str(out)),
        *("--no-plots", "--no-progress"),
    ]
    result = CliRunner().invoke(app, args, terminal_width=250)
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "turns.json").read_text())
    assert rows and all(r["error"] is None for r in rows)
    assert any(r["decision"] == "decode" for r in rows)
    measured = json.loads((out / "summary.json").read_text())["policies"]["agentkv"]["measured"]
    # every step D ran after a request's first token, and nothing else: D's histogram's count
    assert measured["d_itl_steps"] == sum(r["output_tokens"] - 1 for r in rows)
    # a step is the preset's decode step (15 ms and a little per context token), or longer
    # when a prefill shares it
    step = PRESETS["qwen3-32b-p5en"].decode_s_per_token * 1000
    p50, p90, p99 = (measured[f"d_itl_p{q}_ms"] for q in (50, 90, 99))
    assert step <= p50 <= p90 <= p99 < 1000
    assert p50 < step * 1.1
    assert measured["d_itl_mean_ms"] >= step
    assert 0 <= measured["slowed_steps_decode"] <= measured["d_itl_steps"]
    assert measured["retained_block_s_decode"] > 0
    report = (out / "report.md").read_text()
    assert f"{p50:,.2f} / {p90:,.2f} / {p99:,.2f}" in report
