from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_INSTALL = "apt-get install -y redis-server (or see .ci/run)"


def _unavailable(reason: str) -> None:
    """In CI a missing Redis is a failure, never a silent skip; on a laptop it is a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the Redis store tests", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        s.settimeout(0.5)
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _start(binary: str, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server on 127.0.0.1 on a free port, no persistence, its files in ``workdir``."""
    log = workdir / "redis.log"
    for _ in range(3):  # the free port can be taken between _free_port() and the bind
        port = _free_port()
        # fmt: off
        argv = [
            binary,
            "--bind", "127.0.0.1", "--port", str(port), "--dir", str(workdir),
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--protected-mode", "yes", "--loglevel", "warning", "--logfile", str(log),
        ]
        # fmt: on
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process.poll() is None:
            if _ping(port):
                return process, port
            time.sleep(0.02)
        _stop(process)
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    pytest.fail(f"redis-server would not start; its log:\n{text}", pytrace=False)


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
    process, port = _start(binary, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(process)
