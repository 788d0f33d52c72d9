"""Shared pieces of the router benchmarks: processes on loopback and a lean HTTP load generator.

The load generator speaks HTTP/1.1 over raw asyncio streams (one keep-alive connection per
concurrent worker) instead of ``httpx``: on a 2-core machine every CPU cycle the client spends
is taken from the servers it measures, and a raw client costs several times less per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentkv.procs import Process, start_on_free_port
from agentkv.protocol.promtext import parse_metrics
from agentkv.serve.supervisor import start_router as serve_router
from agentkv.sim.launch import SimProcess, start_sims

ROOT = Path(__file__).resolve().parents[1]

# -- processes ---------------------------------------------------------------------------------


Proc = Process
"""A server process started by a benchmark (router, proxy, relay floor): ``url``, ``pid``,
``stop()``, its log at ``log_path``."""


def start_process(
    name: str,
    argv: Callable[[int], Sequence[str]],
    logdir: Path,
    *,
    health: str = "/health",
    python: str = sys.executable,
) -> Proc:
    """Start ``python *argv(port)`` on a free port (another one when the port was taken before
    the bind), stdout and stderr to ``logdir/NAME-PORT.log``; ready when ``health`` is 200."""
    return start_on_free_port(
        lambda port: [python, *argv(port)],
        name=name,
        health_path=health,
        log=lambda port: logdir / f"{name}-{port}.log",
        cwd=ROOT,
        timeout_s=60,
    )


def start_router(config: dict[str, Any], logdir: Path) -> Proc:
    """``agentkv router --config FILE`` in its own process (``router-PORT.json``/``.log`` in
    ``logdir``)."""
    http = {**config.get("http", {}), "host": "127.0.0.1"}
    return serve_router({**config, "http": http}, workdir=logdir)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit``, so that a benchmark's ``finally`` stops its processes."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def logdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="agentkv-bench-"))


@dataclass
class Engines:
    """One simulator P and one D, the servers a benchmark starts in front of them (``procs``),
    and the folder for their logs."""

    p: SimProcess
    d: SimProcess
    logs: Path
    procs: list[Proc] = field(default_factory=list)

    def router_config(self, **groups: dict[str, Any]) -> dict[str, Any]:
        """A router config for this P and D (``block_size`` 16), with ``groups``' keys
        (``retention={"ttl_margin_s": 10.0}``)."""
        prefill, decode = [{"url": self.p.url}], [{"url": self.d.url}]
        upstream = {"prefill": prefill, "decode": decode, "block_size": 16}
        return {**groups, "upstream": {**upstream, **groups.get("upstream", {})}}


@contextlib.contextmanager
def one_p_one_d(sim_args: Sequence[str], d_args: Sequence[str] | None = None) -> Iterator[Engines]:
    """Start a P and a D simulator (``sim_args`` each, or ``d_args`` for D) with SIGTERM turned
    into an exit; on the way out stop every server in ``procs``, then the simulators."""
    exit_on_sigterm()
    logs = logdir()
    d_args = sim_args if d_args is None else d_args
    p, d = start_sims([["--role", "prefill", *sim_args], ["--role", "decode", *d_args]])
    engines = Engines(p, d, logs)
    try:
        yield engines
    finally:
        for proc in engines.procs:
            proc.stop()
        for sim in (p, d):
            sim.stop()


def rss_kib(pid: int) -> int:
    """Resident set size of a process (``VmRSS``), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_cores_seconds() -> float:
    """CPU seconds all cores of the machine have spent busy so far (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CPUMeter:
    """CPU used by given processes, by this process, and by everything else on the machine."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)

    def __enter__(self) -> CPUMeter:
        self._t = time.perf_counter()
        self._busy = busy_cores_seconds()
        self._self = time.process_time()
        self._procs = [cpu_seconds(p) for p in self.pids]
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t
        self.procs_s = [cpu_seconds(p) - c for p, c in zip(self.pids, self._procs, strict=True)]
        self.self_s = time.process_time() - self._self
        self.other_s = max(0.0, busy_cores_seconds() - self._busy - sum(self.procs_s) - self.self_s)

    @property
    def other_cores(self) -> float:
        """Cores kept busy by processes outside the benchmark, on average."""
        return self.other_s / self.wall_s if self.wall_s else 0.0


def wait_quiet(
    pids: Sequence[int] = (), *, max_wait_s: float = 60.0, threshold: float = 0.3
) -> float:
    """Wait (at most ``max_wait_s``) until processes outside the benchmark use less than
    ``threshold`` cores over one second; returns the load last seen (cores)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with CPUMeter(pids) as m:
            time.sleep(1.0)
        if m.other_cores < threshold or time.monotonic() >= deadline:
            return m.other_cores


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text)


# -- HTTP/1.1 client ---------------------------------------------------------------------------


IDLE_S = 4.0
"""A connection idle longer than this is replaced before use (servers close idle keep-alive
connections after 5 s)."""


class HTTPError(Exception):
    pass


class Connection:
    """One keep-alive HTTP/1.1 connection (``Content-Length`` and chunked bodies)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_used = 0.0
        self.reconnects = 0
        self.first_byte_at = 0.0
        """Loop time at which the last response's first body byte arrived (TTFB)."""

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        return await self.request("POST", path, body, headers)

    async def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        return await self.request("GET", path, b"", None)

    async def request(
        self, method: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        now = time.monotonic()
        if self.writer is not None and now - self.last_used > IDLE_S:
            # the server may be closing it (uvicorn's keep-alive timeout is 5 s): a real client
            # would race that close; open a fresh connection instead
            await self.close()
            self.reconnects += 1
        if self.writer is None:
            await self._open()
        assert self.reader is not None and self.writer is not None
        head = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            *(["Content-Type: application/json"] if body else []),
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await self.close()
            raise HTTPError(f"connection lost: {exc!r}") from None
        self.first_byte_at = asyncio.get_running_loop().time()
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        hdrs: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                hdrs[k.strip().lower()] = v.strip()
        try:
            if "content-length" in hdrs:
                data = await self.reader.readexactly(int(hdrs["content-length"]))
            elif hdrs.get("transfer-encoding", "").lower() == "chunked":
                parts: list[bytes] = []
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if not parts:
                        self.first_byte_at = asyncio.get_running_loop().time()
                    chunk = await self.reader.readexactly(size + 2)
                    if size == 0:
                        break
                    parts.append(chunk[:-2])
                data = b"".join(parts)
            else:
                data = await self.reader.read()
                hdrs["connection"] = "close"
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await self.close()
            raise HTTPError(f"connection lost: {exc!r}") from None
        if hdrs.get("connection", "").lower() == "close":
            await self.close()
        self.last_used = time.monotonic()
        return status, hdrs, data


# -- load --------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one load cell measured."""

    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.latencies) + len(self.failures)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall_s if self.wall_s else 0.0

    def pct(self, q: float) -> float:
        """The ``q``-th percentile latency in ms (nearest rank)."""
        xs = sorted(self.latencies)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))] * 1000

    @property
    def p50(self) -> float:
        return self.pct(50)

    @property
    def p99(self) -> float:
        return self.pct(99)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.latencies) * 1000 if self.latencies else float("nan")


Job = Callable[[list[Connection], int], Awaitable[list[float]]]
"""Request ``i`` on a worker's connections: the latencies it measured; raises on failure."""


async def drive(
    jobs: int, concurrency: int, make_conns: Callable[[], list[Connection]], job: Job
) -> Run:
    """Run ``jobs`` calls of ``job(conns, i)`` with ``concurrency`` workers, each with its own
    connections; ``job`` returns the latencies (seconds) it measured."""
    run = Run()
    counter = iter(range(jobs))

    async def worker() -> None:
        conns = make_conns()
        try:
            for i in counter:
                try:
                    run.latencies.extend(await job(conns, i))
                except Exception as exc:
                    run.failures.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            for c in conns:
                await c.close()

    cpu, t = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall_s = time.perf_counter() - t
    run.client_cpu_s = time.process_time() - cpu
    return run
