"""The benchmarks still run: each one's ``--quick --no-write`` smoke run, end to end on real
processes (they start their own simulators and routers on free ports). Their figures are not
checked here (benchmarks measure; docs/benchmarks.md has the figures), only that they finish
and that their own checks pass. ``router_overhead.py`` runs vLLM's example proxy from a second
virtualenv with its dependencies (``VLLM_PROXY_PYTHON``, or ``.venv-vllm-proxy``, which the
benchmark makes when it is missing: pip, from the package index)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _run(script: str, *args: str, timeout: float = 240, quick: bool = True) -> str:
    flags = ["--quick", "--no-write"] if quick else []
    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *flags, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
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


def test_router_overhead_runs() -> None:
    """Every target (vLLM's proxy and the ASGI floor included), prompt lengths 1k and 8k, c=1
    and 2, the memory figure; no turn fails."""
    targets = ["vllm", "floor", "asgi", "router", "exact", "messages", "responses", "pd"]
    out = _run("router_overhead.py", "--targets", ",".join(targets), timeout=900)
    assert "| prompt | c | router exact ids | router chat | vLLM proxy |" in out
    assert "| 8k | 2 |" in out
    assert "| prompt | c | router chat | Messages | Responses |" in out
    assert "| prompt | c | relay floor | ASGI floor |" in out  # the stack's table
    assert "| agentkv router (exact ids) |" in out  # the memory table


def test_decode_paths_runs() -> None:
    """Every path at a 4k history, 128 and 2k new tokens; the cost model's picks and crossover."""
    out = _run("decode_paths.py", timeout=600)
    assert "| new tokens | path | TTFT (model) |" in out
    for path in ("decode", "local", "pull", "recompute", "cpu"):
        assert f"| 128 | {path} |" in out
    assert "| 128 | D's GPU holds it | decode " in out
    assert "Crossover:" in out


@pytest.mark.parametrize("base", ["HEAD", "e3bb44d"], ids=["nested", "flat"])
def test_router_ab_runs(base: str) -> None:
    """Two routers side by side, non-streamed, c=2: this tree's against a commit's (HEAD, and
    e3bb44d, from before the configuration's groups: its configuration goes flat)."""
    known = subprocess.run(["git", "cat-file", "-e", f"{base}^{{commit}}"], cwd=ROOT)
    if known.returncode != 0:
        pytest.skip(f"{base} is not in this clone's history")
    args = ["--base", base, "--lengths", "short", "--kinds", "exact,chat", "--rounds", "1"]
    args += ["--conversations", "8", "--turns", "2", "--plain", "--concurrency", "2"]
    out = _run("router_ab.py", *args, quick=False)
    assert "| prompt | kind | base | this | this ÷ base |" in out
    assert "| 0k | chat |" in out
