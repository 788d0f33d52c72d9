"""Router data plane: agentkv's router against vLLM's own P/D proxy and a raw relay floor.

One simulator prefill instance (P) and one decode instance (D) with no simulated delays
(``--preset zero --time-scale 0``), so every millisecond measured is HTTP, JSON and Python: the
cost of the path, not of a model. In front of the same two engines, in their own processes:

* **vLLM proxy**: vLLM 0.33's example proxy (``disagg_proxy_multiturn.py`` from
  ``../shared/peers/vllm-0.33.0``), run unmodified in its own virtualenv (``fastapi uvicorn
  httpx sniffio``; ``--vllm-proxy-python``): FastAPI + httpx, P then D, D's handle kept per
  ``conversation_id`` and attached to the next turn's P request without verification;
* **relay floor** (``benchmarks/_relay_floor.py``): the same P/D steps in raw asyncio with
  pooled keep-alive connections, D's bytes passed through: the floor for a Python proxy;
* **agentkv router (chat)**: ``agentkv router`` given the chat messages, so it also asks P's
  ``/tokenize`` for the prompt ids and verifies the stored handle against them;
* **agentkv router (exact ids)**: given ``kv_transfer_params.prompt_token_ids`` as agentkv's SDK
  sends them (no ``/tokenize``);
* **P then D (client)**: the client itself does the exact-ids P then D steps, keeping D's
  handle: the baseline for the router's *added* latency (streamed, c=1).

Workloads, each a conversation of 8 turns whose next prompt is the history, the answer and a new
question (so turns 2–8 can pull the last turn's KV from D): **streamed**, 128 tokens per answer
(``stream_options.include_usage`` as the SDK sends it); **non-streamed**, 8 tokens. Closed loop
with c workers; the targets alternate in each round. CPU per turn of each proxy's process from
``/proc``.

Run: ``python benchmarks/router_overhead.py`` (``--quick`` for a smoke run; writes its section of
docs/benchmarks.md unless ``--no-write``; ``--compare`` adds router variants: httpx upstream,
uvicorn without uvloop/httptools, granian; ``--profile`` adds a py-spy profile of the router at
c=64, streamed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentkv.procs import ProcessError, start_on_free_port
from benchmarks._loadgen import (
    ROOT,
    Connection,
    CPUMeter,
    Proc,
    one_p_one_d,
    start_process,
    wait_quiet,
)
from benchmarks._relay_floor import PREFILL as PREFILL_PARAMS
from benchmarks._report import machine, write_section

MODEL = "sim"
TURNS = 8
D_TTL_S = 60.0
SIM_ARGS = [
    *("--preset", "zero", "--time-scale", "0", "--served-model-name", MODEL),
    *("--num-blocks", "262144", "--decoder-kv-blocks-ttl", str(D_TTL_S)),
]
VLLM_PROXY = ROOT.parent / "shared" / "peers" / "vllm-0.33.0" / "disagg_proxy_multiturn.py"
CHAT = "/v1/chat/completions"
_IDS = re.compile(rb'"token_ids":\[([^\]]*)\]')


@dataclass(frozen=True)
class Workload:
    key: str
    name: str
    stream: bool
    max_tokens: int


STREAMED = Workload("stream", "streamed, 128 tokens", True, 128)
PLAIN = Workload("plain", "non-streamed, 8 tokens", False, 8)


@dataclass
class Target:
    key: str
    name: str
    url: str
    kind: str
    """``chat`` (messages), ``exact`` (messages + exact ids), ``pd`` (the client does P, D)."""
    pid: int | None = None


# -- conversations -------------------------------------------------------------------------------


def system_prompt(cell: str, i: int) -> str:
    return (
        f"You are coding agent {i} of run {cell}. You work in a repository with a router, a "
        "store and a simulator. Answer briefly and name the files you touch."
    )


def question(turn: int) -> str:
    return f"Step {turn}: which file should change next, and why?"


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    decisions: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)


class Tokens:
    """Exact prompt ids without a tokenizer in the client: the first prompt of conversation
    ``i`` is a shared rendered prefix plus ids unique to (cell, i); each next one is the last
    prompt + the answer's ids + a rendered question (the engines take the ids as given)."""

    def __init__(self, p_url: str, d_url: str) -> None:
        self.p_url, self.d_url = p_url, d_url

        def tok(body: dict[str, Any]) -> list[int]:
            r = httpx.post(f"{p_url}/tokenize", json=body, timeout=30, trust_env=False)
            return [int(t) for t in r.json()["tokens"]]

        self.base = tok({"model": MODEL, "messages": [{"role": "system", "content": "x" * 200}]})
        self.suffix = [
            tok(
                {
                    "model": MODEL,
                    "prompt": f"<|im_end|>\n<|im_start|>user\n{question(t)}<|im_end|>\n"
                    "<|im_start|>assistant\n",
                    "add_special_tokens": False,
                }
            )
            for t in range(TURNS)
        ]

    def first(self, cell: str, i: int) -> list[int]:
        seed = hash((cell, i)) & 0xFFFFFFFF
        return [*self.base, *(1000 + (seed >> (4 * k)) % 60000 for k in range(8)), *self.suffix[0]]


def _content(data: bytes, stream: bool) -> str:
    if not stream:
        choice = orjson.loads(data)["choices"][0]
        return str(choice["message"].get("content") or "")
    parts = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _out_ids(data: bytes) -> list[int]:
    out: list[int] = []
    for m in _IDS.finditer(data):
        if m.group(1):
            out.extend(int(x) for x in m.group(1).split(b","))
    return out


def _d_handle(data: bytes, stream: bool) -> dict[str, Any] | None:
    if not stream:
        return orjson.loads(data).get("kv_transfer_params")  # type: ignore[no-any-return]
    for line in data.split(b"\n"):
        if b'"kv_transfer_params":{' in line:
            return orjson.loads(line[6:])["kv_transfer_params"]  # type: ignore[no-any-return]
    return None


async def conversation(
    conns: list[Connection], i: int, t: Target, wl: Workload, cell: str, tokens: Tokens, st: Stats
) -> None:
    loop = asyncio.get_running_loop()
    cid = f"{cell}-{i}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(cell, i)},
        {"role": "user", "content": question(0)},
    ]
    ids = tokens.first(cell, i)
    handle: dict[str, Any] | None = None
    for turn in range(TURNS):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": wl.max_tokens,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        if wl.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        headers = {"X-Conversation-Id": cid}
        t0 = loop.time()
        if t.kind == "pd":
            params = (
                dict(handle, do_remote_decode=True, do_remote_prefill=False) if handle else None
            )
            p_body = {
                "model": MODEL,
                "prompt": ids,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": params or PREFILL_PARAMS,
            }
            status, _, data = await conns[1].post("/v1/completions", orjson.dumps(p_body))
            if status != 200:
                raise RuntimeError(f"P answered {status}: {data[:200]!r}")
            p_params = orjson.loads(data)["kv_transfer_params"]
            body["kv_transfer_params"] = dict(p_params, prompt_token_ids=ids)
            body["return_token_ids"] = True
            status, hdrs, data = await conns[2].post(CHAT, orjson.dumps(body))
            conn = conns[2]
        else:
            body["conversation_id"] = cid
            if t.kind == "exact":
                body["kv_transfer_params"] = {"prompt_token_ids": ids}
                body["return_token_ids"] = True
            status, hdrs, data = await conns[0].post(CHAT, orjson.dumps(body), headers)
            conn = conns[0]
        elapsed = loop.time() - t0
        if status != 200:
            raise RuntimeError(f"{t.name} answered {status}: {data[:200]!r}")
        st.latencies.append(elapsed)
        st.ttfb.append(conn.first_byte_at - t0)
        st.decisions[hdrs.get("x-agentkv-decision", "—")] += 1
        content = _content(data, wl.stream)
        if t.kind in ("exact", "pd"):
            out = _out_ids(data)
            if not out:
                raise RuntimeError(f"{t.name}: no token ids in the answer")
            ids = [*ids, *out, *tokens.suffix[(turn + 1) % TURNS]]
        if t.kind == "pd":
            handle = _d_handle(data, wl.stream)
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": question(turn + 1)},
        ]


async def drive(
    t: Target, wl: Workload, concurrency: int, conversations: int, cell: str, tokens: Tokens
) -> tuple[Stats, float]:
    st = Stats()
    counter = iter(range(conversations))
    p_url, d_url = tokens.p_url, tokens.d_url

    async def worker() -> None:
        conns = [Connection(t.url), Connection(p_url), Connection(d_url)]
        try:
            for i in counter:
                try:
                    await conversation(conns, i, t, wl, cell, tokens, st)
                except Exception as exc:
                    st.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                    for c in conns:
                        await c.close()
        finally:
            for c in conns:
                await c.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return st, time.perf_counter() - started


# -- cells -------------------------------------------------------------------------------------


@dataclass
class Cell:
    target: Target
    workload: Workload
    concurrency: int
    rounds: list[tuple[Stats, float, float, float]] = field(default_factory=list)
    """(stats, wall s, proxy CPU s, other cores) per round."""

    def _all(self, name: str) -> list[float]:
        return [x for r in self.rounds for x in getattr(r[0], name)]

    @property
    def turns(self) -> int:
        return sum(len(r[0].latencies) for r in self.rounds)

    @property
    def failures(self) -> list[str]:
        return [f for r in self.rounds for f in r[0].failures]

    @property
    def cpu_ms_rounds(self) -> list[float]:
        return [r[2] / len(r[0].latencies) * 1000 for r in self.rounds if r[0].latencies]

    @property
    def cpu_ms(self) -> float:
        """Median over rounds of the proxy's CPU ms per turn."""
        xs = self.cpu_ms_rounds
        return statistics.median(xs) if xs else float("nan")

    @property
    def rps(self) -> float:
        wall = sum(r[1] for r in self.rounds)
        return self.turns / wall if wall else 0.0

    def pct(self, name: str, q: float) -> float:
        xs = sorted(self._all(name))
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))] * 1000

    @property
    def other(self) -> float:
        wall = sum(r[1] for r in self.rounds)
        return sum(r[1] * r[3] for r in self.rounds) / wall if wall else 0.0

    @property
    def decisions(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for r in self.rounds:
            out.update(r[0].decisions)
        return out


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


def measure(
    t: Target, wl: Workload, c: int, n_conv: int, rnd: int, tokens: Tokens, pids: list[int]
) -> tuple[Stats, float, float, float]:
    cell = f"{t.key}-{wl.key}-c{c}-r{rnd}-{os.getpid()}"
    asyncio.run(drive(t, wl, c, max(c, 8), f"{cell}-warm", tokens))
    with CPUMeter(pids) as meter:
        before = tree_cpu(t.pid) if t.pid else 0.0
        st, wall = asyncio.run(drive(t, wl, c, n_conv, cell, tokens))
        proxy = (tree_cpu(t.pid) - before) if t.pid else 0.0
    return st, wall, proxy, meter.other_cores


# -- report ------------------------------------------------------------------------------------

ORDER = ["vllm", "floor", "router", "exact", "pd"]


def report(
    cells: list[Cell], args: argparse.Namespace, wall_s: float, quiet: float, extra: list[str]
) -> str:
    by = {(c.target.key, c.workload.key, c.concurrency): c for c in cells}
    lines = [
        "## Router data plane (and overhead)",
        "",
        f"`python benchmarks/router_overhead.py` — {machine()}.",
        "",
        "One simulator P and one simulator D with no simulated delays (`--preset zero",
        "--time-scale 0`): every millisecond is HTTP, JSON and Python. Conversations of 8",
        "turns (the next prompt is the history, the answer and a new question, so turns 2–8",
        "can pull the last turn's KV from D), streamed with 128 tokens per answer",
        "(`stream_options.include_usage`, as the SDK sends it) or not streamed with 8. Targets,",
        "each its own process in front of the same P and D:",
        "",
        "- **vLLM proxy**: vLLM 0.33's `disagg_proxy_multiturn.py`, unmodified, in its own",
        "  virtualenv (`fastapi uvicorn httpx sniffio`); it logs each request at INFO, as",
        "  shipped;",
        "- **relay floor**: `benchmarks/_relay_floor.py`, the same P/D steps in raw asyncio,",
        "  pooled keep-alive connections, D's bytes passed through (no verification, nothing",
        "  stripped): the floor for a Python proxy;",
        "- **agentkv router (chat)**: given the messages: it asks P's `/tokenize`, verifies the",
        "  handle against the ids, strips internal fields;",
        "- **agentkv router (exact ids)**: given `kv_transfer_params.prompt_token_ids` and",
        "  `return_token_ids`, as the SDK sends them;",
        "- **P then D (client)**: the client does the exact-ids P then D steps itself (the",
        "  baseline for the router's added latency).",
        "",
        f"{args.rounds} rounds, the targets in alternating order in each; a warm-up before",
        "each cell. *CPU ms/turn* is the proxy process's CPU time (`/proc`, user + system) per",
        "turn, the median of the rounds (min–max in brackets); *× vLLM* divides it by vLLM's",
        "proxy's in the same cell. Latency is per turn on the client (a raw asyncio HTTP/1.1",
        "client, one keep-alive connection per worker, in the benchmark's process), TTFB to",
        "the first body byte. *other*: cores used by processes outside the benchmark during",
        "the cell (noise).",
        "",
        "| workload | c | target | CPU ms/turn | × vLLM | turns/s | p50 ms | p99 ms | TTFB p50 "
        "| decisions | other |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for wl in (STREAMED, PLAIN):
        for c in sorted({x.concurrency for x in cells if x.workload == wl}):
            base = by.get(("vllm", wl.key, c))
            keys = ORDER + sorted({x.target.key for x in cells} - set(ORDER))
            for key in keys:
                cell = by.get((key, wl.key, c))
                if cell is None:
                    continue
                rs = cell.cpu_ms_rounds
                cpu = (
                    f"{cell.cpu_ms:.2f} ({min(rs):.2f}–{max(rs):.2f})"
                    if cell.target.pid and rs
                    else "—"
                )
                ratio = (
                    f"{cell.cpu_ms / base.cpu_ms:.2f}"
                    if base and cell.target.pid and base.cpu_ms
                    else "—"
                )
                dec = ", ".join(f"{k} {v}" for k, v in cell.decisions.most_common() if k != "—")
                fails = f" ({len(cell.failures)} failed)" if cell.failures else ""
                lines.append(
                    f"| {wl.name} | {c} | {cell.target.name}{fails} | {cpu} | {ratio} "
                    f"| {cell.rps:,.0f} | {cell.pct('latencies', 50):.2f} "
                    f"| {cell.pct('latencies', 99):.2f} | {cell.pct('ttfb', 50):.2f} "
                    f"| {dec or '—'} | {cell.other:.2f} |"
                )
    lines += ["", *verdict(by, cells), *extra]
    failed = [c for c in cells if c.failures]
    if failed:
        lines += ["", "Failed turns (first message of each cell):", ""]
        lines += [
            f"- {c.target.name}, {c.workload.name}, c={c.concurrency}: {len(c.failures)}, "
            f"`{c.failures[0]}`"
            for c in failed
        ]
    lines += [
        "",
        f"Whole run: {wall_s:.0f} s; load outside the benchmark at start: {quiet:.2f} cores.",
    ]
    return "\n".join(lines)


def verdict(by: dict[tuple[str, str, int], Cell], cells: list[Cell]) -> list[str]:
    out = []
    for key in ("router", "exact"):
        c64, v64 = by.get((key, "stream", 64)), by.get(("vllm", "stream", 64))
        if c64 and v64:
            ratio = c64.cpu_ms / v64.cpu_ms
            out.append(
                f"- {c64.target.name}, streamed, c=64: {c64.cpu_ms:.2f} ms CPU/turn, "
                f"{ratio:.2f} × vLLM's proxy ({v64.cpu_ms:.2f} ms): goal ≤ 0.33, "
                f"**{'met' if ratio <= 1 / 3 else 'not met'}**."
            )
        xs = [
            by[(key, "stream", c)].cpu_ms
            for c in sorted({x.concurrency for x in cells})
            if (key, "stream", c) in by
        ]
        if len(xs) > 1:
            mid = statistics.median(xs)
            spread = max(abs(x - mid) / mid for x in xs)
            out.append(
                f"- {by[(key, 'stream', 64)].target.name if (key, 'stream', 64) in by else key}"
                f", streamed, CPU/turn across c: {', '.join(f'{x:.2f}' for x in xs)} ms, "
                f"±{spread:.0%} around the median (goal ±20 %)."
            )
        p1, d1 = by.get((key, "plain", 64)), by.get(("vllm", "plain", 64))
        if p1 and d1:
            out.append(
                f"- {p1.target.name}, non-streamed, c=64: {p1.cpu_ms:.2f} ms, "
                f"{p1.cpu_ms / d1.cpu_ms:.2f} × vLLM's proxy."
            )
    e1, b1 = by.get(("exact", "stream", 1)), by.get(("pd", "stream", 1))
    if e1 and b1:
        added = e1.pct("latencies", 50) - b1.pct("latencies", 50)
        out.append(
            f"- Added p50 latency at c=1 over the client doing P then D itself (exact ids, "
            f"streamed): {added:+.2f} ms (goal ≤ 1 ms)."
        )
    return out


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


# -- processes -----------------------------------------------------------------------------------


def start_router(
    cfg: dict[str, Any], logs: Path, server: str = "cli", name: str = "router"
) -> Proc:
    def argv(port: int) -> list[str]:
        path = logs / f"{name}-{port}.json"
        path.write_text(json.dumps({**cfg, "host": "127.0.0.1", "port": port}))
        if server == "cli":
            cmd = ["-m", "agentkv", "router", "--config", str(path), "--port", str(port)]
            return [*cmd, "--log-level", "warning"]
        return ["-m", "benchmarks._serve_router", server, str(path)]

    return start_process(name, argv, logs)


def start_vllm_proxy(python: str, p: str, d: str, logs: Path) -> Proc:
    pp, dp = p.rsplit(":", 1)[1], d.rsplit(":", 1)[1]
    argv = lambda port: [  # noqa: E731
        str(VLLM_PROXY),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prefiller-host", "127.0.0.1", "--prefiller-port", pp),
        *("--decoder-host", "127.0.0.1", "--decoder-port", dp),
    ]
    return start_process("vllm-proxy", argv, logs, python=python)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few turns per cell")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, help="conversations per cell and round")
    parser.add_argument("--wait-quiet", type=float, default=30.0, metavar="S")
    parser.add_argument("--concurrency", type=int, action="append", help="default 1 16 64 256")
    parser.add_argument("--plain-concurrency", type=int, action="append", help="default 64")
    parser.add_argument("--targets", help="comma-separated subset of vllm,floor,router,exact,pd")
    parser.add_argument("--compare", action="store_true", help="router variants (client, server)")
    parser.add_argument("--profile", action="store_true", help="py-spy the router at c=64")
    parser.add_argument(
        "--vllm-proxy-python",
        default=os.environ.get("VLLM_PROXY_PYTHON", str(ROOT / ".venv-vllm-proxy/bin/python")),
        help="python of a virtualenv with fastapi uvicorn httpx sniffio",
    )
    args = parser.parse_args()
    concs = args.concurrency or [1, 16, 64, 256]
    plain_concs = args.plain_concurrency or [64]

    def n_conv(c: int) -> int:
        if args.conversations:
            return max(c, args.conversations)
        return max(c, 8 if args.quick else 32) if c < 256 else c

    started = time.perf_counter()
    extra: list[str] = []
    with one_p_one_d(SIM_ARGS) as engines:
        p, d, logs, procs = engines.p, engines.d, engines.logs, engines.procs
        cfg = engines.router_config(decoder_kv_blocks_ttl_s=D_TTL_S, ttl_margin_s=10.0)
        router = start_router(cfg, logs)
        vllm = start_vllm_proxy(args.vllm_proxy_python, p.url, d.url, logs)
        floor = start_process(
            "floor", lambda port: ["-m", "benchmarks._relay_floor", str(port), p.url, d.url], logs
        )
        procs += [router, vllm, floor]
        targets = [
            Target("vllm", "vLLM proxy", vllm.url, "chat", vllm.pid),
            Target("floor", "relay floor", floor.url, "chat", floor.pid),
            Target("router", "agentkv router (chat)", router.url, "chat", router.pid),
            Target("exact", "agentkv router (exact ids)", router.url, "exact", router.pid),
            Target("pd", "P then D (client)", d.url, "pd", None),
        ]
        if args.compare:
            variants = [
                ("httpx", "router, httpx upstream (exact)", {"upstream_client": "httpx"}, "cli"),
                ("h11", "router, uvicorn h11/asyncio (exact)", {}, "uvicorn-h11"),
                ("fast", "router, uvicorn httptools/uvloop (exact)", {}, "uvicorn"),
                ("granian", "router, granian (exact)", {}, "granian"),
            ]
            for key, name, over, server in variants:
                proc = start_router({**cfg, **over}, logs, server, key)
                procs.append(proc)
                targets.append(Target(key, name, proc.url, "exact", proc.pid))
        if args.targets:
            keep = set(args.targets.split(","))
            targets = [t for t in targets if t.key in keep]
        tokens = Tokens(p.url, d.url)
        sim_pids = [p.process.pid, d.process.pid]
        quiet = wait_quiet([*sim_pids, *(x.pid for x in procs)], max_wait_s=args.wait_quiet)
        print(f"load outside the benchmark: {quiet:.2f} cores", flush=True)
        cells: list[Cell] = []
        plan = [(STREAMED, c) for c in concs] + [(PLAIN, c) for c in plain_concs]
        for wl, c in plan:
            # the client's own P then D is the latency baseline at c=1 only
            here = [t for t in targets if t.kind != "pd" or (c == 1 and wl == STREAMED)]
            done = {t.key: Cell(t, wl, c) for t in here}
            for rnd in range(args.rounds):
                order = here if rnd % 2 == 0 else here[::-1]
                for t in order:
                    res = measure(t, wl, c, n_conv(c), rnd, tokens, sim_pids)
                    done[t.key].rounds.append(res)
                    st, wall, cpu, other = res
                    print(
                        f"{wl.key} c={c} r{rnd} {t.name}: {len(st.latencies) / wall:,.0f} "
                        f"turns/s, p50 {statistics.median(st.latencies) * 1000:.2f} ms, CPU "
                        f"{cpu / max(1, len(st.latencies)) * 1000:.2f} ms/turn, other "
                        f"{other:.2f}, {dict(st.decisions)}, {len(st.failures)} failed"
                        f"{': ' + st.failures[0] if st.failures else ''}",
                        flush=True,
                    )
            cells += done.values()
        if args.profile:
            extra += profile(cfg, logs, tokens)
    body = report(cells, args, time.perf_counter() - started, quiet, extra)
    print(body)
    if not args.no_write:
        write_section("router_overhead", body)
    if any(c.failures for c in cells):
        sys.exit(1)


def profile(cfg: dict[str, Any], logs: Path, tokens: Tokens) -> list[str]:
    """py-spy (``record --format raw``) on a fresh router process, c=64, streamed."""
    out = logs / "router.pyspy.txt"
    spy = str(Path(sys.executable).with_name("py-spy"))

    def argv(port: int) -> list[str]:
        path = logs / f"profiled-{port}.json"
        path.write_text(json.dumps({**cfg, "host": "127.0.0.1", "port": port}))
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
        results = []
        for kind, name in (("exact", "exact ids"), ("chat", "chat")):
            t = Target("prof", name, url, kind, None)
            asyncio.run(drive(t, STREAMED, 64, 128, f"prof-{kind}-{os.getpid()}", tokens))
            results.append(name)
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
        "router process, c=64, streamed, 128 conversations in exact-ids then chat mode; self",
        "time of the innermost Python frame, by library): "
        + ", ".join(summarize_profile(out))
        + ".",
    ]


if __name__ == "__main__":
    main()
