"""The processes of ``router_overhead.py`` and its phases outside the main loop: the simulators'
flags, the targets (vLLM's proxy, the relay floor, the router and its variants), the memory
phase (RSS per live conversation of fresh processes) and the py-spy profile of the router."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from agentkv.procs import ProcessError, start_on_free_port
from benchmarks._loadgen import ROOT, Engines, Proc, one_p_one_d, rss_kib, start_process
from benchmarks._overhead_report import Memory, label
from benchmarks._turns import STREAMED, Material, Target, drive

D_TTL_S = 60.0
LEASE_S = 240.0
VLLM_PROXY = ROOT.parent / "shared" / "peers" / "vllm-0.33.0" / "disagg_proxy_multiturn.py"
PROXY_PYTHON = ROOT / ".venv-vllm-proxy" / "bin" / "python"
"""The default python of vLLM's proxy: a virtualenv of its own, made on first use."""
PROXY_REQUIREMENTS = ("fastapi", "uvicorn", "httpx", "sniffio")
"""What ``disagg_proxy_multiturn.py`` imports."""
LENGTHS = {"short": 0, "1k": 1_000, "8k": 8_000, "32k": 32_000, "128k": 128_000}
CONVERSATIONS = {0: 32, 1_000: 16, 8_000: 4, 32_000: 2, 128_000: 1}
"""Conversations per cell and round at c=1 (at c>1: at least c), by first prompt length."""
RSS_CONVERSATIONS = 48
RSS_WARM = 8
RSS_SETTLE_S = 2.0
"""Seconds at rest before each RSS reading (past the router's heap trim, every second)."""


def sim_args(blocks: int = 262_144, ttl_s: float = D_TTL_S) -> list[str]:
    """The simulators' flags. P keeps its blocks for D's read ``LEASE_S``: the simulator's 30 s
    default passes under load at 128k tokens (each simulator tokenizes on its event loop, and
    vLLM's proxy sends both the messages); vLLM's own default is 480 s. ``max_model_len``
    262144: the default 131072 holds a 128k-token first prompt and 8 turns of answers and
    questions (129,368 tokens), not many more."""
    return [
        *("--preset", "zero", "--time-scale", "0", "--served-model-name", "sim"),
        *("--num-blocks", str(blocks), "--decoder-kv-blocks-ttl", str(ttl_s)),
        *("--kv-lease-duration", str(LEASE_S), "--max-model-len", "262144"),
    ]


def d_blocks(longest: int) -> int:
    """D keeps each conversation's last blocks for ``D_TTL_S``: room for a minute of 128k-token
    conversations from every target, below the router's KV-pressure watermark (0.9)."""
    return 786_432 if longest > 32_000 else 262_144


ROUTER_DEADLINES = {"decode_first_byte_timeout_s": 300.0, "prefill_deadline_s": 300.0}  # upstream
PULL = {"mode": "pull"}
"""``[paths]`` of every router here: P then D on every turn, like vLLM's proxy."""

"""The router's deadlines, raised: at 128k tokens, c=8, on a loaded machine, D's first byte can
take longer than the 30 s default, and the retry is a second P pass (vLLM's proxy waits
without a limit)."""


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its children (granian serves from a worker process)."""
    from benchmarks._loadgen import cpu_seconds

    total = cpu_seconds(pid)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                total += cpu_seconds(int(entry.name))
    return total


def loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- processes ------------------------------------------------------------------------------------


def start_router(
    cfg: dict[str, Any], logs: Path, server: str = "cli", name: str = "router"
) -> Proc:
    def argv(port: int) -> list[str]:
        path = logs / f"{name}-{port}.json"
        http = {**cfg.get("http", {}), "host": "127.0.0.1", "port": port}
        path.write_text(json.dumps({**cfg, "http": http}))
        if server == "cli":
            cmd = ["-m", "agentkv", "router", "--config", str(path), "--port", str(port)]
            return [*cmd, "--log-level", "warning"]
        return ["-m", "benchmarks._serve_router", server, str(path)]

    return start_process(name, argv, logs)


def proxy_python(python: str) -> str:
    """``python`` for vLLM's proxy, ready: the default virtualenv (``.venv-vllm-proxy``) is made
    and given :data:`PROXY_REQUIREMENTS` when it is missing; another missing python is an
    error that says how to make one."""
    path = Path(python)
    if path.exists():
        return python
    if path != PROXY_PYTHON:
        raise SystemExit(
            f"{python} does not exist: make a virtualenv with {' '.join(PROXY_REQUIREMENTS)} "
            "for vLLM's proxy, or leave --vllm-proxy-python (and VLLM_PROXY_PYTHON) unset to "
            f"have {PROXY_PYTHON.parents[1].name} made here"
        )
    venv = PROXY_PYTHON.parents[1]
    print(f"making {venv.name} for vLLM's proxy: {' '.join(PROXY_REQUIREMENTS)} …", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(PROXY_PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *PROXY_REQUIREMENTS], check=True)
    return python


def start_vllm_proxy(python: str, p: str, d: str, logs: Path) -> Proc:
    pp, dp = p.rsplit(":", 1)[1], d.rsplit(":", 1)[1]
    argv = lambda port: [  # noqa: E731
        str(VLLM_PROXY),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prefiller-host", "127.0.0.1", "--prefiller-port", pp),
        *("--decoder-host", "127.0.0.1", "--decoder-port", dp),
    ]
    return start_process("vllm-proxy", argv, logs, python=python)


def _floor_argv(module: str, prefill: str, decode: str, port: int) -> list[str]:
    return ["-m", module, str(port), prefill, decode]


def start_targets(
    engines: Engines,
    cfg: dict[str, Any],
    keep: set[str] | None,
    vllm_proxy_python: str,
    compare: bool,
) -> list[Target]:
    """Start the targets in front of ``engines``' P and D (the ``--targets`` subset ``keep``,
    else all; with ``compare`` the router's server variants too); their processes go to
    ``engines.procs``."""
    p, d, logs, procs = engines.p, engines.d, engines.logs, engines.procs

    def wanted(key: str) -> bool:
        return keep is None or key in keep

    targets: list[Target] = []
    if wanted("vllm"):
        vllm = start_vllm_proxy(vllm_proxy_python, p.url, d.url, logs)
        procs.append(vllm)
        targets.append(Target("vllm", "vLLM proxy", vllm.url, "chat", vllm.pid))
    floors = [("floor", "relay floor", "benchmarks._relay_floor")]
    if keep is not None and "asgi" in keep:  # only when named
        floors.append(("asgi", "ASGI floor", "benchmarks._asgi_floor"))
    for key, name, module in floors:
        if not wanted(key):
            continue
        argv = functools.partial(_floor_argv, module, p.url, d.url)
        proc = start_process(key, argv, logs)
        procs.append(proc)
        targets.append(Target(key, name, proc.url, "chat", proc.pid))
    router = start_router(cfg, logs)
    procs.append(router)
    for key, name, kind in (
        ("router", "agentkv router (chat)", "chat"),
        ("exact", "agentkv router (exact ids)", "exact"),
        ("messages", "agentkv router (Messages)", "messages"),
        ("responses", "agentkv router (Responses)", "responses"),
    ):
        if wanted(key):
            targets.append(Target(key, name, router.url, kind, router.pid))
    if wanted("pd"):
        targets.append(Target("pd", "P then D (client)", d.url, "pd", None))
    if compare:
        variants: list[tuple[str, str, dict[str, Any], str]] = [
            ("h11", "router, uvicorn h11/asyncio (exact)", {}, "uvicorn-h11"),
            ("fast", "router, uvicorn httptools/uvloop (exact)", {}, "uvicorn"),
            ("granian", "router, granian (exact)", {}, "granian"),
        ]
        for key, name, over, server in variants:
            proc = start_router({**cfg, **over}, logs, server, key)
            procs.append(proc)
            targets.append(Target(key, name, proc.url, "exact", proc.pid))
    return targets


# -- memory ---------------------------------------------------------------------------------------


def memory(starters: list[tuple[str, str, Any]], mat: Material, conversations: int) -> list[Memory]:
    """RSS per live conversation of fresh processes: (name, kind, start()) each. Conversations
    of one turn, one at a time, after ``RSS_WARM`` of them; every one's handle stays live."""
    rows: list[Memory] = []
    for name, kind, start in starters:
        proc = start()
        try:
            t = Target("rss", name, proc.url, kind, proc.pid)
            cell = f"rss-{kind}-{os.getpid()}-{len(rows)}"
            asyncio.run(drive(t, STREAMED, 1, RSS_WARM, f"{cell}-warm", mat, 1))
            time.sleep(RSS_SETTLE_S)
            before = rss_kib(proc.pid)
            st, _ = asyncio.run(drive(t, STREAMED, 1, conversations, cell, mat, 1))
            if st.failures:
                raise RuntimeError(f"{name}: {st.failures[0]}")
            time.sleep(RSS_SETTLE_S)
            after = rss_kib(proc.pid)
            handles = None
            if "router" in name:
                health = httpx.get(f"{proc.url}/health", timeout=10, trust_env=False).json()
                handles = health.get("handles")
            rows.append(Memory(name, mat.length, conversations, before, after, handles))
            print(
                f"memory {name}: {before} → {after} KiB, "
                f"{rows[-1].per_conversation_kib:,.0f} KiB per conversation, handles {handles}",
                flush=True,
            )
        finally:
            proc.stop()
    return rows


def memory_phase(
    vllm_proxy_python: str, length: int, conversations: int, keep: set[str] | None
) -> list[Memory]:
    """RSS per live conversation of the router (exact ids, chat) and of vLLM's proxy, each a
    fresh process in front of a fresh P and D that keep every handle for 600 s (and a router
    told so: no handle expires or is released for KV pressure while memory is measured)."""
    ttl = 600.0
    with one_p_one_d(sim_args(ttl_s=ttl), sim_args(524_288, ttl)) as engines:
        p, d, logs = engines.p, engines.d, engines.logs
        cfg = engines.router_config(
            retention={"decoder_kv_blocks_ttl_s": ttl, "ttl_margin_s": 10.0},
            upstream=ROUTER_DEADLINES,
            paths=PULL,
        )
        mat = Material(p.url, d.url, length)
        starters: list[tuple[str, str, Any]] = []
        if keep is None or "exact" in keep:
            starters.append(
                ("agentkv router (exact ids)", "exact", lambda: start_router(cfg, logs))
            )
        if keep is None or "router" in keep:
            starters.append(("agentkv router (chat)", "chat", lambda: start_router(cfg, logs)))
        if keep is None or "vllm" in keep:
            starters.append(
                (
                    "vLLM proxy",
                    "chat",
                    lambda: start_vllm_proxy(vllm_proxy_python, p.url, d.url, logs),
                )
            )
        return memory(starters, mat, conversations)


# -- profile -------------------------------------------------------------------------------------

LIBS = [
    ("aiohttp", "aiohttp"),
    ("httpx", "httpx"),
    ("httpcore", "httpcore"),
    ("anyio", "anyio"),
    ("h11", "h11"),
    ("uvicorn", "uvicorn"),
    ("starlette", "starlette"),
    ("prometheus_client", "prometheus"),
    ("opentelemetry", "opentelemetry"),
    ("pydantic", "pydantic"),
    ("agentkv/router/sse", "agentkv relay (sse.py)"),
    ("agentkv/router/verify", "agentkv verify"),
    ("agentkv/router/store", "agentkv store"),
    ("agentkv/router/request", "agentkv parse"),
    ("agentkv", "agentkv (other)"),
    ("asyncio", "asyncio"),
    ("logging", "logging"),
]


def summarize_profile(path: Path) -> list[str]:
    """Self time by library of the innermost frame, from py-spy's raw (collapsed) output."""
    self_by: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        leaf = stack.split(";")[-1]
        lib = next((name for key, name in LIBS if key in leaf), "other (stdlib, C)")
        self_by[lib] += count
    if not total:
        return ["(no samples)"]
    return [f"{lib} {n / total:.0%}" for lib, n in self_by.most_common(12)]


def profile(cfg: dict[str, Any], logs: Path, mat: Material) -> list[str]:
    """py-spy (``record --format raw``) on a fresh router process, c=64, streamed."""
    out = logs / "router.pyspy.txt"
    spy = str(Path(sys.executable).with_name("py-spy"))

    def argv(port: int) -> list[str]:
        path = logs / f"profiled-{port}.json"
        http = {**cfg.get("http", {}), "host": "127.0.0.1", "port": port}
        path.write_text(json.dumps({**cfg, "http": http}))
        cmd = [spy, "record", "--format", "raw", "--rate", "200", "-o", str(out), "--"]
        cmd += [sys.executable, "-m", "agentkv", "router", "--config", str(path)]
        return [*cmd, "--port", str(port), "--log-level", "warning"]

    try:
        proc = start_on_free_port(
            argv, name="py-spy", log=lambda port: logs / f"profiled-{port}.log", cwd=ROOT
        )
    except ProcessError as exc:
        return ["", f"py-spy did not run the router ({exc.reason}; ptrace not permitted?)."]
    url = proc.url
    try:
        for kind, name in (("exact", "exact ids"), ("chat", "chat")):
            t = Target("prof", name, url, kind, None)
            asyncio.run(drive(t, STREAMED, 64, 128, f"prof-{kind}-{os.getpid()}", mat))
    finally:
        proc.process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.process.wait(30)
        proc.stop()
    if not out.exists():
        return ["", "py-spy wrote no profile (ptrace not permitted?)."]
    return [
        "",
        "Where the router's CPU goes (py-spy, `record --format raw` at 200 Hz on a fresh",
        f"router process, c=64, streamed, {label(mat.length)} prompts, 128 conversations in",
        "exact-ids then chat mode; self time of the innermost Python frame, by library): "
        + ", ".join(summarize_profile(out))
        + ".",
    ]
