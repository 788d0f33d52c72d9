"""Start simulator instances as real processes on loopback (demo, e2e tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

__all__ = ["SimProcess", "free_port", "start_sim"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class SimProcess:
    """One ``agentkv sim`` process."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def _wait_healthy(sim: SimProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False) as client:
        while time.monotonic() < deadline:
            if sim.process.poll() is not None:
                raise RuntimeError(
                    f"agentkv sim on port {sim.port} exited with {sim.process.returncode}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{sim.url}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
    sim.stop()
    raise TimeoutError(f"agentkv sim on port {sim.port} not healthy after {timeout_s:.0f}s")


@contextlib.contextmanager
def start_sim(
    *args: str, port: int | None = None, timeout_s: float = 60.0, quiet: bool = True
) -> Iterator[SimProcess]:
    """Run ``agentkv sim --port PORT *args`` until the block exits."""
    sims = start_sims(
        [list(args)], ports=[port] if port else None, timeout_s=timeout_s, quiet=quiet
    )
    try:
        yield sims[0]
    finally:
        sims[0].stop()


def start_sims(
    argvs: Sequence[Sequence[str]],
    *,
    ports: Sequence[int] | None = None,
    timeout_s: float = 60.0,
    quiet: bool = True,
) -> list[SimProcess]:
    """Start several simulators at once and wait until all are healthy."""
    sims: list[SimProcess] = []
    out = subprocess.DEVNULL if quiet else None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for i, argv in enumerate(argvs):
            port = ports[i] if ports else free_port()
            cmd = [sys.executable, "-m", "agentkv", "sim", "--port", str(port), *argv]
            proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env)
            sims.append(SimProcess(proc, port))
        for sim in sims:
            _wait_healthy(sim, timeout_s)
    except BaseException:
        for sim in sims:
            sim.stop()
        raise
    return sims
