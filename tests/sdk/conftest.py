from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from agentkv.sim.launch import SimProcess, start_sims


@pytest.fixture(scope="session")
def sim() -> Iterator[SimProcess]:
    """One plain simulator process (real HTTP), shared by the SDK tests."""
    (proc,) = start_sims([["--time-scale", "0", "--served-model-name", "sim"]])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def faults(sim: SimProcess) -> Iterator[httpx.Client]:
    """Set fault knobs on the shared simulator; they are cleared afterwards."""
    with httpx.Client(base_url=sim.url, trust_env=False) as client:
        yield client
        client.post("/_sim/faults", json={"fail_next": 0, "cut_stream_after": None, "delay_s": 0})
