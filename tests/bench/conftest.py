"""Fixtures of the benchmark tests: a small hand-made trace, and one simulated deployment (P,
D, the verified router and an unverified one) for the whole session. The constants and helpers
are in ``tests._support.bench``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv.bench.deploy import Stack, local_stack
from tests._support.bench import SMALL_SESSIONS, TIME_SCALE


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in SMALL_SESSIONS))
    return path


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The `local` profile (simulated P and D, laptop costs) with both routers, each with
    ``paths.mode = "pull"``: these tests check the replay's account of what P read back from D
    (and the unverified router is vLLM's proxy, P then D); the default, ``choose``, would
    decode the trace's short turns on D in place (tests/bench/test_replay_paths_e2e.py)."""
    pull = {"paths": {"mode": "pull"}}
    with local_stack(
        "local", time_scale=TIME_SCALE, preset="laptop", unverified=True, router_options=pull
    ) as s:
        yield s
