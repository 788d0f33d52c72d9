"""The benchmarks still run: each one's ``--quick --no-write`` smoke run, end to end on real
processes (they start their own simulators and routers on free ports). Their figures are not
checked here (benchmarks measure; docs/benchmarks.md has the figures), only that they finish
and that their own checks pass. ``router_overhead.py`` needs a second virtualenv with vLLM's
proxy dependencies and is left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str) -> str:
    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--no-write"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_sdk_overhead_runs() -> None:
    out = _run("sdk_overhead.py")
    assert "| history tokens | openai wall ms | agentkv wall ms |" in out


def test_router_load_runs_and_its_checks_pass() -> None:
    out = _run("router_load.py")
    checks = [line for line in out.splitlines() if line.startswith("Checks:")]
    assert checks and "FAILED" not in checks[0], out[-2000:]
