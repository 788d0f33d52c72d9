"""Real processes on loopback: simulator P and D instances and agentkv routers in front."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.protocol.promtext import parse_metrics
from agentkv.sim.launch import SimProcess, free_port, start_sims


@dataclass
class RouterProcess:
    process: subprocess.Popen[bytes]
    port: int
    log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not None:
            self.log.close()


def start_router(config: dict[str, Any], tmp: Path, *, timeout_s: float = 30) -> RouterProcess:
    port = free_port()
    path = tmp / f"router-{port}.json"
    path.write_text(json.dumps({**config, "port": port, "health_interval_s": 0.5}))
    log = open(tmp / f"router-{port}.log", "wb")  # noqa: SIM115 - kept open for the process
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentkv",
            "router",
            "--config",
            str(path),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=log,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    router = RouterProcess(proc, port, log)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError((tmp / f"router-{port}.log").read_text())
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{router.url}/health", timeout=1).status_code == 200:
                    return router
            time.sleep(0.1)
    router.stop()
    raise TimeoutError("router not healthy")


@dataclass
class Stack:
    prefill: list[SimProcess]
    decode: list[SimProcess]
    routers: list[RouterProcess] = field(default_factory=list)

    @property
    def router(self) -> RouterProcess:
        return self.routers[0]

    def metrics(self, sim: SimProcess) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{sim.url}/metrics", timeout=10).text)

    def wrong_kv(self) -> float:
        return sum(
            self.metrics(s).get("agentkv_sim_wrong_kv_tokens_total", 0.0)
            for s in [*self.prefill, *self.decode]
        )

    def retained(self, sim: SimProcess) -> int:
        return len(httpx.get(f"{sim.url}/_sim/state", timeout=10).json()["retained"])

    def stop(self) -> None:
        for r in self.routers:
            r.stop()
        for s in [*self.prefill, *self.decode]:
            s.stop()


@contextlib.contextmanager
def stack(
    tmp: Path,
    *,
    p_args: Sequence[Sequence[str]] = ((),),
    d_args: Sequence[Sequence[str]] = ((),),
    router: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    routers: int = 1,
    common: Sequence[str] = ("--time-scale", "0", "--block-size", "16"),
) -> Iterator[Stack]:
    argvs = [["--role", "prefill", *common, *a] for a in p_args] + [
        ["--role", "decode", *common, *a] for a in d_args
    ]
    sims = start_sims(argvs)
    s = Stack(sims[: len(p_args)], sims[len(p_args) :])
    try:
        cfg = {
            "prefill": [{"url": p.url, **(backend or {})} for p in s.prefill],
            "decode": [{"url": d.url, **(backend or {})} for d in s.decode],
            "block_size": 16,
            **(router or {}),
        }
        for _ in range(routers):
            s.routers.append(start_router(cfg, tmp))
        yield s
    finally:
        s.stop()
