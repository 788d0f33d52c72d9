from __future__ import annotations

import pytest

from tests._support.otel import OTel


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def otel() -> OTel:
    """OpenTelemetry SDK tracer and meter providers, set once per test process (the global
    providers cannot be replaced), with an in-memory span exporter and metric reader."""
    return OTel()
