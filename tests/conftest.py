from __future__ import annotations

import pytest

from tests._support import router_config
from tests._support.otel import OTel


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``paths_pull`` test's routers (its fixtures' too: they are set up after this) get
    ``paths.mode = "pull"`` (:mod:`tests._support.router_config`)."""
    marked = item.get_closest_marker("paths_pull") is not None
    router_config.pinned[:] = [router_config.PULL] if marked else []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def otel() -> OTel:
    """OpenTelemetry SDK tracer and meter providers, set once per test process (the global
    providers cannot be replaced), with an in-memory span exporter and metric reader."""
    return OTel()
