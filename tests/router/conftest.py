"""Fixtures of the router tests: a real redis-server for the session (``redis_url``); the helpers
that start one are in ``tests._support.redis_server``. Every router these tests start (in
process or as a child) keeps a generated tenant salt secret in a temporary state directory,
never in the user's own."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests._support.redis_server import _INSTALL, _start, _unavailable


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server this fixture starts (and always stops) for the session."""
    binary = shutil.which("redis-server")
    if binary is None:
        _unavailable(f"redis-server is not installed: {_INSTALL}")
    try:
        import redis  # noqa: F401
    except ImportError:
        _unavailable('the redis client library is not installed: pip install -e ".[dev]"')
    assert binary is not None
    with _start(binary, tmp_path_factory.mktemp("redis")) as server:
        yield f"redis://127.0.0.1:{server.port}/0"


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``XDG_STATE_HOME`` (platformdirs' user state directory on Linux) in a temporary directory
    for the session, inherited by the routers the tests start."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = before
