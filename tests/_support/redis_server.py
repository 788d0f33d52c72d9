"""A real redis-server for the tests: :func:`start_redis` and :func:`_start`.

A plain module, not a conftest (every conftest is imported as ``conftest``, so which one a
``from conftest import`` finds depends on collection order)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest

from agentkv import procs

_INSTALL = "apt-get install -y redis-server (or see .ci/run)"


def _unavailable(reason: str) -> None:
    """In CI a missing Redis is a failure, never a silent skip; on a laptop it is a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the Redis store tests", pytrace=False)
    pytest.skip(reason)


def _ping(port: int | None) -> bool:
    if port is None:
        return False
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        s.settimeout(0.5)
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


def _redis_argv(binary: str, workdir: Path, port: int) -> list[str]:
    # fmt: off
    return [
        binary,
        "--bind", "127.0.0.1", "--port", str(port), "--dir", str(workdir),
        "--save", "", "--appendonly", "no", "--daemonize", "no",
        "--protected-mode", "yes", "--loglevel", "warning",
    ]
    # fmt: on


def start_redis(
    binary: str, workdir: Path, *, port: int | None = None, timeout_s: float = 10
) -> procs.Process:
    """A redis-server on 127.0.0.1, no persistence, its files and ``redis.log`` in ``workdir``:
    on ``port``, or on a free port (another one when the port is taken before the bind); ready
    (answers PING) when this returns. Raises :class:`agentkv.procs.ProcessError`."""
    ready = lambda p: _ping(p.port)  # noqa: E731
    if port is None:
        return procs.start_on_free_port(
            lambda port: _redis_argv(binary, workdir, port),
            name="redis-server",
            health_path=None,
            ready=ready,
            timeout_s=timeout_s,
            log=lambda _: workdir / "redis.log",
        )
    return procs.start(
        _redis_argv(binary, workdir, port),
        name="redis-server",
        port=port,
        ready=ready,
        timeout_s=timeout_s,
        log=workdir / "redis.log",
    )


def _start(binary: str, workdir: Path) -> procs.Process:
    """A redis-server on a free port (see :func:`start_redis`); a test failure if it will not."""
    try:
        return start_redis(binary, workdir)
    except procs.ProcessError as exc:
        pytest.fail(f"redis-server would not start: {exc}", pytrace=False)
