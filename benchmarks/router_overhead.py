"""Router overhead: agentkv's router against calling the engines directly and a naive P→D proxy.

One simulator prefill instance (P) and one decode instance (D) with no simulated delays
(``--preset zero --time-scale 0``), so every millisecond measured is HTTP, JSON and Python: the
cost of the path, not of a model. The same chat requests (a short multi-turn history,
``max_tokens`` 8, a fresh ``X-Conversation-Id`` each) go to:

* **D direct**: one request to D, no disaggregation (the floor);
* **P then D (client)**: the client itself sends P ``max_tokens: 1`` with ``do_remote_decode``,
  then D with P's ``kv_transfer_params`` (D pulls the KV from P). This is the work every P/D
  proxy must cause, so it is the fair baseline for what a proxy *adds*;
* **naive proxy**: vLLM's example-proxy logic (round robin, P then D, no verification, no
  store), written below on the router's own stack (Starlette, uvicorn, httpx) in its own process;
* **agentkv router** (its own process, ``agentkv router``), sent chat messages, so it also asks
  P's ``/tokenize`` for the prompt ids;
* **agentkv router, exact ids**: the same with ``kv_transfer_params.prompt_token_ids``, as
  agentkv's SDK sends them (no ``/tokenize`` call).

Run: ``python benchmarks/router_overhead.py`` (``--quick`` for a smoke run; writes its section
of docs/benchmarks.md unless ``--no-write``). ``--serve-naive PORT`` runs the naive proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentkv.sim.launch import free_port, start_sims
from benchmarks._loadgen import (
    Connection,
    CPUMeter,
    Proc,
    Run,
    drive,
    exit_on_sigterm,
    logdir,
    start_process,
    start_router,
    wait_quiet,
)
from benchmarks._report import machine, write_section

MODEL = "sim"
MAX_TOKENS = 8
ROUNDS = 2
"""Each cell runs in this many parts, the targets in alternating order."""
CHATS = 256
"""Distinct chat histories the requests cycle through."""
D_TTL_S = 60.0
"""D keeps each finished turn's blocks this long (every P→D path makes D retain them); short so
the pool does not fill during the run."""
SIM_ARGS = [
    *("--preset", "zero", "--time-scale", "0", "--served-model-name", MODEL),
    *("--num-blocks", "131072", "--decoder-kv-blocks-ttl", str(D_TTL_S)),
]
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# -- the naive proxy -----------------------------------------------------------------------------


def naive_proxy_app(prefill: list[str], decode: list[str]) -> Any:
    """vLLM's example P→D proxy, reduced to its logic: round robin over P and over D, P gets
    ``max_tokens: 1`` and ``do_remote_decode``, D gets P's params; D's body goes back as is."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    # unbounded, as vLLM's proxy; idle connections dropped after 2 s, before the engines' own
    # 5 s keep-alive timeout closes them under a request (httpx does not retry that race)
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0
    )
    clients: dict[str, httpx.AsyncClient] = {}
    p_cycle, d_cycle = itertools.cycle(prefill), itertools.cycle(decode)

    def client(url: str) -> httpx.AsyncClient:
        if url not in clients:
            clients[url] = httpx.AsyncClient(
                base_url=url, timeout=None, limits=limits, trust_env=False
            )
        return clients[url]

    async def generate(request: Request) -> Response:
        path = request.url.path
        body = orjson.loads(await request.body())
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS)
        for key in ("min_tokens", "min_completion_tokens", "max_completion_tokens"):
            p_body.pop(key, None)
        p = await client(next(p_cycle)).post(path, content=orjson.dumps(p_body))
        if p.status_code != 200:
            return Response(p.content, status_code=p.status_code, media_type="application/json")
        d_body = dict(body, kv_transfer_params=p.json().get("kv_transfer_params"))
        d = await client(next(d_cycle)).post(path, content=orjson.dumps(d_body))
        return Response(d.content, status_code=d.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        yield
        for c in clients.values():
            await c.aclose()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def serve_naive(port: int, prefill: list[str], decode: list[str]) -> None:
    import uvicorn

    uvicorn.run(
        naive_proxy_app(prefill, decode),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
    )


# -- requests ------------------------------------------------------------------------------------


def chat(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a terse assistant for a multi-turn agent."},
        {"role": "user", "content": f"Task {i}: list the files changed in step {i % 17}."},
        {"role": "assistant", "content": f"Step {i % 17} changed router.py and store.py."},
        {"role": "user", "content": "Which of them holds the handle store?"},
    ]


@dataclass
class Target:
    name: str
    key: str
    url: str
    kind: str
    """``single`` (one request), ``p_then_d`` (the client does both), ``router``, ``exact``."""


class Requests:
    """Pre-encoded bodies, so the client spends no time building JSON during a run."""

    def __init__(self, prompt_ids: list[list[int]]) -> None:
        self.plain = [
            orjson.dumps({"model": MODEL, "messages": chat(i), "max_tokens": MAX_TOKENS})
            for i in range(CHATS)
        ]
        self.exact = [
            orjson.dumps(
                {
                    "model": MODEL,
                    "messages": chat(i),
                    "max_tokens": MAX_TOKENS,
                    "kv_transfer_params": {"prompt_token_ids": prompt_ids[i]},
                }
            )
            for i in range(CHATS)
        ]
        self.prefill = [
            orjson.dumps(
                {
                    "model": MODEL,
                    "messages": chat(i),
                    "max_tokens": 1,
                    "stream": False,
                    "kv_transfer_params": PREFILL_PARAMS,
                }
            )
            for i in range(CHATS)
        ]


PATH = "/v1/chat/completions"


def job_for(target: Target, reqs: Requests, cell: str, p_url: str) -> Any:
    async def job(conns: list[Connection], i: int) -> list[float]:
        loop = asyncio.get_running_loop()
        k = i % CHATS
        t = loop.time()
        if target.kind == "p_then_d":
            status, _, data = await conns[1].post(PATH, reqs.prefill[k])
            if status != 200:
                raise RuntimeError(f"P answered {status}: {data[:200]!r}")
            params = orjson.loads(data)["kv_transfer_params"]
            body = orjson.loads(reqs.plain[k])
            body["kv_transfer_params"] = params
            status, _, data = await conns[0].post(PATH, orjson.dumps(body))
        else:
            body = reqs.exact[k] if target.kind == "exact" else reqs.plain[k]
            headers = {"X-Conversation-Id": f"{cell}-{i}"} if target.kind != "single" else None
            status, _, data = await conns[0].post(PATH, body, headers)
        elapsed = loop.time() - t
        if status != 200:
            raise RuntimeError(f"{target.name} answered {status}: {data[:200]!r}")
        if b'"choices"' not in data:
            raise RuntimeError(f"{target.name}: no choices in {data[:200]!r}")
        return [elapsed]

    def conns() -> list[Connection]:
        return [Connection(target.url), Connection(p_url)]

    return job, conns


@dataclass
class Cell:
    target: Target
    concurrency: int
    run: Run
    sims_cpu_s: float
    proxy_cpu_s: float
    other_cores: float

    @property
    def server_ms(self) -> float:
        return (self.sims_cpu_s + self.proxy_cpu_s) / self.run.requests * 1000

    @property
    def proxy_ms(self) -> float:
        return self.proxy_cpu_s / self.run.requests * 1000


def measure(
    target: Target,
    concurrency: int,
    n: int,
    reqs: Requests,
    p_url: str,
    sim_pids: list[int],
    proxy_pid: int | None,
    rnd: int,
) -> Cell:
    cell = f"{target.key}-c{concurrency}-r{rnd}"
    warm = max(50, min(n // 5, 4 * concurrency))
    job, conns = job_for(target, reqs, f"{cell}-warmup", p_url)
    asyncio.run(drive(warm, concurrency, conns, job))
    job, conns = job_for(target, reqs, cell, p_url)
    pids = [*sim_pids, *([proxy_pid] if proxy_pid else [])]
    with CPUMeter(pids) as meter:
        run = asyncio.run(drive(n, concurrency, conns, job))
    sims = sum(meter.procs_s[: len(sim_pids)])
    proxy = sum(meter.procs_s[len(sim_pids) :])
    return Cell(target, concurrency, run, sims, proxy, meter.other_cores)


def merge(a: Cell, b: Cell) -> Cell:
    """One cell from two rounds of it."""
    run = Run(
        latencies=a.run.latencies + b.run.latencies,
        failures=a.run.failures + b.run.failures,
        wall_s=a.run.wall_s + b.run.wall_s,
        client_cpu_s=a.run.client_cpu_s + b.run.client_cpu_s,
    )
    other = (a.other_cores * a.run.wall_s + b.other_cores * b.run.wall_s) / run.wall_s
    return Cell(
        a.target,
        a.concurrency,
        run,
        a.sims_cpu_s + b.sims_cpu_s,
        a.proxy_cpu_s + b.proxy_cpu_s,
        other,
    )


PROFILE = [
    "Where the router's CPU goes (py-spy on the router process, exact ids, c=64, on this",
    "machine when this benchmark was written): about a third in httpcore's connection-pool",
    "bookkeeping (`AsyncConnectionPool._assign_requests_to_connections`, which walks every",
    "pooled connection, polling idle sockets through anyio, on each request and each",
    "release), most of the rest in the HTTP stack (h11 in uvicorn and in httpcore, anyio,",
    "socket writes), and a few percent in agentkv's own steps (parsing, verification, store,",
    "metrics). It is the main reason why the router's and the naive proxy's CPU per request",
    "grow with concurrency.",
]


# -- report ------------------------------------------------------------------------------------


def _added(cell: Cell, base: Cell | None) -> str:
    if base is None or base is cell:
        return "— | —"
    return f"{cell.run.p50 - base.run.p50:+.2f} | {cell.run.p99 - base.run.p99:+.2f}"


def report(cells: list[Cell], n_by_c: dict[int, int], wall_s: float, quiet: float) -> str:
    by = {(c.target.key, c.concurrency): c for c in cells}
    concs = sorted({c.concurrency for c in cells})
    lines = [
        "## Router overhead",
        "",
        f"`python benchmarks/router_overhead.py` — {machine()}.",
        "",
        "One simulator P and one simulator D with no simulated delays (`--preset zero",
        "--time-scale 0`): every millisecond below is HTTP, JSON and Python, not a model. Each",
        f"request is a 4-message chat (65 prompt tokens, `max_tokens` {MAX_TOKENS}, not",
        "streamed) with a fresh `X-Conversation-Id`, so the router's decision is `miss` (nothing",
        "to reuse yet) and it stores D's handle after the turn; reuse on later turns is measured",
        "by `router_load.py`. Targets:",
        "",
        "- **D direct**: one request to D, no disaggregation;",
        "- **P then D**: the client itself sends P `max_tokens: 1` with `do_remote_decode`, then",
        "  D with P's handle (D pulls the KV from P). This is the work any P/D proxy causes, so",
        "  it is the baseline for what a proxy *adds*;",
        "- **naive proxy**: vLLM's example-proxy logic (round robin, P then D, no verification,",
        "  no store), written in the benchmark on the router's own stack (Starlette, uvicorn,",
        "  httpx with an unbounded pool whose idle connections expire after 2 s) in its own",
        "  process;",
        "- **agentkv router** given chat messages: it first asks P's `/tokenize` for the prompt",
        "  ids, so it makes three upstream calls per turn;",
        "- **agentkv router, exact ids**: given `kv_transfer_params.prompt_token_ids` as",
        "  agentkv's SDK sends them (two upstream calls).",
        "",
        "Fixed request counts per cell",
        f"({', '.join(f'{n_by_c[c]:,} at c={c}' for c in concs)}), run in {ROUNDS} rounds with the",
        "targets in alternating order (so that load from outside the benchmark, which comes",
        "and goes, spreads over all of them), each after a warm-up, in a closed loop (each of",
        "the c workers sends its next request when its last one is answered).",
        "Latency is a request's time on the client, from writing it to reading the whole body;",
        "the client is a raw asyncio HTTP/1.1 client (one keep-alive connection per worker) in",
        "the benchmark's process. *Added* columns subtract the baseline's p50 (p99) at the same",
        "concurrency. *Server CPU* is the CPU time of P, D and the proxy per request, *proxy",
        "CPU* the proxy's (router's) share, both from `/proc`; *client* is the load generator's",
        "share of one core; *other* is what processes outside the benchmark kept busy during",
        "the cell, in cores.",
        "",
        "**This machine has 2 cores, shared by everything in the run**: the client, P, D and",
        "the proxy are separate processes competing for them. At c=1 the figures are the",
        "path's own cost; at c=64 and c=256 the machine is saturated, latency is mostly",
        "queueing for a CPU (≈ c ÷ req/s), and a proxy's added latency is, to first order, c ×",
        "its CPU per request ÷ 2 cores. Run-to-run noise at c≥64 is large when *other* is not",
        "near 0.",
        "",
        "| target | c | req/s | p50 ms | p99 ms | added p50 vs D direct | added p99 vs D direct "
        "| added p50 vs P then D | added p99 vs P then D | server CPU ms/req "
        "| proxy CPU ms/req | client | other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in concs:
        for key in ("direct", "pd", "naive", "router", "exact"):
            cell = by.get((key, c))
            if cell is None:
                continue
            r = cell.run
            fails = f" ({len(r.failures)} failed)" if r.failures else ""
            pd = by.get(("pd", c)) if key in ("naive", "router", "exact") else None
            proxy = f"{cell.proxy_ms:.2f}" if cell.proxy_cpu_s else "—"
            lines.append(
                f"| {cell.target.name}{fails} | {c} | {r.rps:,.0f} | {r.p50:.2f} | {r.p99:.2f} "
                f"| {_added(cell, by.get(('direct', c)))} | {_added(cell, pd)} "
                f"| {cell.server_ms:.2f} | {proxy} | {r.client_cpu_s / r.wall_s:.0%} "
                f"| {cell.other_cores:.2f} |"
            )
    lines += ["", *_verdict(by, concs), "", *PROFILE]
    failed = [c for c in cells if c.run.failures]
    if failed:
        lines += ["", "Failed requests (first message of each cell):", ""]
        lines += [
            f"- {c.target.name}, c={c.concurrency}: {len(c.run.failures)}, `{c.run.failures[0]}`"
            for c in failed
        ]
    lines += [
        "",
        f"Whole run: {wall_s:.0f} s; load outside the benchmark at start: {quiet:.2f} cores.",
    ]
    return "\n".join(lines)


def _verdict(by: dict[tuple[str, int], Cell], concs: list[int]) -> list[str]:
    out = []
    for c in concs:
        base = by.get(("pd", c))
        if base is None:
            continue
        parts = [
            f"{by[(k, c)].target.name} {by[(k, c)].run.p50 - base.run.p50:+.2f} ms "
            f"({by[(k, c)].proxy_ms:.2f} ms CPU/req)"
            for k in ("naive", "router", "exact")
            if (k, c) in by
        ]
        out.append(f"- c={c}, added p50 over P then D: " + "; ".join(parts) + ".")
    c64 = [by[(k, 64)] for k in ("router", "exact") if (k, 64) in by and ("pd", 64) in by]
    if c64:
        best = min(c.run.p50 - by[("pd", 64)].run.p50 for c in c64)
        met = "met" if best <= 2.0 else "not met"
        out.append(
            f"- Target (added p50 ≤ 2 ms at c=64): **{met}** on this machine (best "
            f"{best:+.1f} ms). With zero-cost engines every process is CPU-bound, so at c=64 "
            "a proxy's added latency is its CPU per request times the queue, not its "
            "per-request path; the c=1 row and the CPU columns are the router's own cost."
        )
    return out


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few requests per cell")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="S",
        help="wait up to S seconds for other processes to leave the CPUs (default 60)",
    )
    parser.add_argument("--serve-naive", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--prefill", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--decode", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument(
        "--concurrency", type=int, action="append", help="concurrency levels (default 1, 64, 256)"
    )
    args = parser.parse_args()
    if args.serve_naive:
        serve_naive(args.serve_naive, args.prefill, args.decode)
        return
    concs = args.concurrency or [1, 64, 256]
    n_by_c = {
        c: (100 if c == 1 else 400) if args.quick else (300 if c == 1 else 2000) for c in concs
    }

    import time

    started = time.perf_counter()
    exit_on_sigterm()
    logs = logdir()
    sims = start_sims([["--role", "prefill", *SIM_ARGS], ["--role", "decode", *SIM_ARGS]])
    procs: list[Proc] = []
    try:
        p, d = sims
        cfg = {
            "prefill": [{"url": p.url}],
            "decode": [{"url": d.url}],
            "block_size": 16,
            "decoder_kv_blocks_ttl_s": D_TTL_S,
            "ttl_margin_s": 10.0,
        }
        router = start_router(cfg, logs)
        procs.append(router)
        port = free_port()
        argv = ["-m", "benchmarks.router_overhead", "--serve-naive", str(port)]
        naive = start_process("naive", [*argv, "--prefill", p.url, "--decode", d.url], port, logs)
        procs.append(naive)
        ids = [
            httpx.post(
                f"{p.url}/tokenize",
                json={"model": MODEL, "messages": chat(i)},
                timeout=30,
                trust_env=False,
            ).json()["tokens"]
            for i in range(CHATS)
        ]
        reqs = Requests(ids)
        targets = [
            Target("D direct", "direct", d.url, "single"),
            Target("P then D (client)", "pd", d.url, "p_then_d"),
            Target("naive proxy", "naive", naive.url, "router"),
            Target("agentkv router", "router", router.url, "router"),
            Target("agentkv router, exact ids", "exact", router.url, "exact"),
        ]
        sim_pids = [p.process.pid, d.process.pid]
        proxy_pid = {"naive": naive.pid, "router": router.pid, "exact": router.pid}
        all_pids = [*sim_pids, naive.pid, router.pid]
        quiet = wait_quiet(all_pids, max_wait_s=args.wait_quiet)
        print(f"load outside the benchmark: {quiet:.2f} cores", flush=True)
        cells = []
        for c in concs:
            # in ROUNDS rounds, the targets in alternating order, so that load from outside
            # the benchmark that comes and goes spreads over all of them
            done: dict[str, Cell] = {}
            for rnd in range(ROUNDS):
                for t in targets if rnd % 2 == 0 else targets[::-1]:
                    n = n_by_c[c] // ROUNDS
                    print(f"{t.name}, concurrency {c}, round {rnd + 1}, {n} requests", flush=True)
                    cell = measure(t, c, n, reqs, p.url, sim_pids, proxy_pid.get(t.key), rnd)
                    r = cell.run
                    print(
                        f"  {r.rps:,.0f} req/s, p50 {r.p50:.2f} ms, p99 {r.p99:.2f} ms, "
                        f"router/proxy CPU {cell.proxy_ms:.2f} ms/req, other load "
                        f"{cell.other_cores:.2f} cores, {len(r.failures)} failed"
                        f"{': ' + r.failures[0] if r.failures else ''}",
                        flush=True,
                    )
                    done[t.key] = merge(done[t.key], cell) if t.key in done else cell
            cells += [done[t.key] for t in targets]
    finally:
        for proc in procs:
            proc.stop()
        for s in sims:
            s.stop()
    body = report(cells, n_by_c, time.perf_counter() - started, quiet)
    print(body)
    if not args.no_write:
        write_section("router_overhead", body)
    if any(c.run.failures for c in cells):
        sys.exit(1)


if __name__ == "__main__":
    main()
