"""Router under load: 1,000 conversations × 5 turns, 256 at a time, on zero-cost simulator engines.

One simulator P and one simulator D (1P1D, ``--preset zero --time-scale 0``) behind
``agentkv router`` (its own process) with a deliberately small handle store
(``store_max_entries`` 500, half the number of conversations), so the run shows the bounds
holding: the store never holds more than its bound, handles it evicts are released on D at once
(D does not pin their KV until its TTL), the router's memory stays flat, and no request fails.
Each conversation's turns are sequential (the next turn's messages are the history plus the
answer plus a new question) and 256 conversations are in flight at any time. The router's
``paths.mode`` is ``pull`` (every later turn P then D, as vLLM's proxy does).

Run: ``python benchmarks/router_load.py`` (``--quick`` for a smoke run; writes its section of
docs/benchmarks.md unless ``--no-write``). Exits non-zero when a request failed or a bound was
exceeded.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._loadgen import (
    Connection,
    CPUMeter,
    Proc,
    one_p_one_d,
    rss_kib,
    start_router,
    wait_quiet,
)
from benchmarks._report import arguments, machine, write_section

MODEL = "sim"
MAX_TOKENS = 8
NUM_BLOCKS = 32768
PATH = "/v1/chat/completions"
SIM_ARGS = [
    *("--preset", "zero", "--time-scale", "0", "--served-model-name", MODEL),
    *("--num-blocks", str(NUM_BLOCKS)),
]
_SAMPLE = re.compile(r"^([\w:]+)(?:\{([^}]*)\})? (\S+)$")


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out[m.group(2) or ""] = float(m.group(3))
    return out


def label(labels: str, key: str) -> str:
    m = re.search(rf'{key}="([^"]*)"', labels)
    return m.group(1) if m else ""


def system_prompt(i: int) -> str:
    return (
        f"You are coding agent number {i}. You work in a repository with a router, a store and "
        "a simulator. Answer in one short sentence, name the files you touch, never invent "
        "paths, and say when you are unsure. Keep a list of what you changed so far and "
        f"repeat it only when asked. Your ticket is T-{i * 7919 % 100000}."
    )


def question(i: int, turn: int) -> str:
    return f"Step {turn} of task {i}: which file should change next, and why?"


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    by_turn: dict[int, list[float]] = field(default_factory=dict)
    decisions: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    sent: int = 0


@dataclass
class Samples:
    handles: list[int] = field(default_factory=list)
    gauge: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    d_retained_requests: list[float] = field(default_factory=list)
    d_retained_blocks: list[float] = field(default_factory=list)
    d_usage: list[float] = field(default_factory=list)


async def conversation(conn: Connection, i: int, turns: int, stats: Stats) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system_prompt(i)},
        {"role": "user", "content": question(i, 0)},
    ]
    headers = {"X-Conversation-Id": f"load-{i}"}
    loop = asyncio.get_running_loop()
    for turn in range(turns):
        body = orjson.dumps(
            {
                "model": MODEL,
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "chat_template_kwargs": {"enable_thinking": False},
            }
        )
        stats.sent += 1
        t = loop.time()
        try:
            status, hdrs, data = await conn.post(PATH, body, headers)
        except Exception as exc:
            stats.failures.append(f"conversation {i} turn {turn}: {exc!r}"[:300])
            return
        elapsed = loop.time() - t
        if status != 200:
            stats.failures.append(f"conversation {i} turn {turn}: {status} {data[:200]!r}")
            return
        stats.latencies.append(elapsed)
        stats.by_turn.setdefault(turn, []).append(elapsed)
        stats.decisions[hdrs.get("x-agentkv-decision", "?")] += 1
        content = orjson.loads(data)["choices"][0]["message"]["content"] or ""
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": question(i, turn + 1)},
        ]


async def sample(router: Proc, d_url: str, out: Samples, stop: asyncio.Event) -> None:
    r, d = Connection(router.url), Connection(d_url)
    try:
        while not stop.is_set():
            _, _, health = await r.get("/health")
            out.handles.append(int(orjson.loads(health)["handles"]))
            _, _, text = await r.get("/metrics")
            out.gauge.append(
                next(iter(samples(text.decode(), "agentkv_router_store_handles").values()), 0)
            )
            out.rss_kib.append(rss_kib(router.pid))
            _, _, text = await d.get("/metrics")
            dm = text.decode()
            out.d_retained_requests.append(_one(dm, "agentkv_sim_retained_requests"))
            out.d_retained_blocks.append(_one(dm, "agentkv_sim_retained_blocks"))
            out.d_usage.append(_one(dm, "vllm:kv_cache_usage_perc"))
            with _suppress_timeout():
                await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        await r.close()
        await d.close()


def _suppress_timeout() -> Any:
    import contextlib

    return contextlib.suppress(asyncio.TimeoutError)


def _one(text: str, name: str) -> float:
    return sum(samples(text, name).values())


async def load(
    router: Proc, d_url: str, conversations: int, turns: int, in_flight: int
) -> tuple[Stats, Samples, float, int]:
    stats, smp = Stats(), Samples()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(router, d_url, smp, stop))
    ids = iter(range(conversations))
    rss_half = 0

    async def worker() -> None:
        nonlocal rss_half
        conn = Connection(router.url)
        try:
            for i in ids:
                await conversation(conn, i, turns, stats)
                if i == conversations // 2:
                    rss_half = rss_kib(router.pid)
        finally:
            await conn.close()

    t = time.perf_counter()
    last = time.perf_counter()

    async def progress() -> None:
        nonlocal last
        while True:
            await asyncio.sleep(10)
            print(
                f"  {time.perf_counter() - t:.0f} s: {len(stats.latencies):,} turns answered, "
                f"{len(stats.failures)} failed, store {smp.handles[-1] if smp.handles else 0}",
                flush=True,
            )

    ticker = asyncio.create_task(progress())
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    wall = time.perf_counter() - t
    ticker.cancel()
    stop.set()
    await sampler
    return stats, smp, wall, rss_half


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))] * 1000 if s else float("nan")


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], "200 conversations, 64 in flight")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="S",
        help="wait up to S seconds for other processes to leave the CPUs (default 60)",
    )
    args = parser.parse_args()
    conversations, turns, in_flight, store_max = (
        (200, 5, 64, 100) if args.quick else (1000, 5, 256, 500)
    )
    with one_p_one_d(SIM_ARGS) as engines:
        p, d = engines.p, engines.d
        cfg = engines.router_config(store={"max_entries": store_max}, paths={"mode": "pull"})
        router = start_router(cfg, engines.logs)
        engines.procs.append(router)
        pids = [p.process.pid, d.process.pid, router.pid]
        quiet = wait_quiet(pids, max_wait_s=args.wait_quiet)
        rss_start = rss_kib(router.pid)
        print(
            f"{conversations} conversations × {turns} turns, {in_flight} in flight, store bound "
            f"{store_max}; load outside the benchmark {quiet:.2f} cores",
            flush=True,
        )
        with CPUMeter(pids) as meter:
            stats, smp, wall, rss_half = asyncio.run(
                load(router, d.url, conversations, turns, in_flight)
            )
        time.sleep(1.0)  # let the router's background releases land
        import httpx

        def get(url: str) -> str:
            return httpx.get(url, timeout=10, trust_env=False).text

        rm, pm, dm = get(f"{router.url}/metrics"), get(f"{p.url}/metrics"), get(f"{d.url}/metrics")
        handles_end = int(orjson.loads(get(f"{router.url}/health"))["handles"])
        rss_end = rss_kib(router.pid)

    decisions = {
        label(k, "decision"): int(v)
        for k, v in samples(rm, "agentkv_router_requests_total").items()
    }
    released = {
        label(k, "reason"): int(v)
        for k, v in samples(rm, "agentkv_router_handles_released_total").items()
    }
    failed_router = {
        label(k, "status"): int(v)
        for k, v in samples(rm, "agentkv_router_failed_requests_total").items()
    }
    upstream = {
        f"{label(k, 'role')} {label(k, 'kind')}": int(v)
        for k, v in samples(rm, "agentkv_router_upstream_errors_total").items()
    }
    retries = {
        label(k, "reason"): int(v) for k, v in samples(rm, "agentkv_router_retries_total").items()
    }
    reused = _one(rm, "agentkv_router_reused_tokens_total")
    wrong = _one(pm, "agentkv_sim_wrong_kv_tokens_total") + _one(
        dm, "agentkv_sim_wrong_kv_tokens_total"
    )
    d_ret_req_end = _one(dm, "agentkv_sim_retained_requests")
    d_ret_blocks_end = _one(dm, "agentkv_sim_retained_blocks")
    expected = conversations * turns
    handles_max = max(smp.handles, default=0)
    gauge_max = max(smp.gauge, default=0)
    rss_max = max([*smp.rss_kib, rss_end])
    d_req_max = max(smp.d_retained_requests, default=0)
    # D's bound: the store's handles, plus per conversation in flight the handle its turn took
    # (D frees it once P's read is done) and the one its new handle displaced from the full
    # store (D frees it once the router's release lands): both are freed, not yet at once
    d_bound = store_max + 2 * in_flight
    checks = {
        "no failed request": not stats.failures and len(stats.latencies) == expected,
        f"store ≤ {store_max}": handles_max <= store_max and gauge_max <= store_max,
        f"D retained requests ≤ store bound + 2 × in flight ({d_bound})": d_req_max <= d_bound,
        "no wrong KV": wrong == 0,
    }

    def mib(kib: float) -> str:
        return f"{kib / 1024:.1f} MiB"

    first = stats.by_turn.get(0, [])
    later = [x for t, xs in stats.by_turn.items() if t > 0 for x in xs]
    lines = [
        "## Router under load",
        "",
        f"`python benchmarks/router_load.py` — {machine()}.",
        "",
        f"{conversations:,} conversations × {turns} turns, {in_flight} conversations in flight",
        "(each conversation's turns sequential: history + answer + a new question), through",
        "`agentkv router` (its own process) on one simulator P and one simulator D (1P1D) with",
        "no simulated delays. Chat messages with a per-conversation system prompt (about 80",
        f"tokens), `max_tokens` {MAX_TOKENS}, `enable_thinking: false`, `X-Conversation-Id`; the",
        "router asks P's `/tokenize` for the ids. The router's handle store is bounded to",
        f"`store_max_entries` = {store_max}, fewer than the conversations, so finished",
        "conversations' handles are evicted (and released on D) while the run goes on. Store",
        "size is sampled every 0.5 s from the router's `/health` (`handles`) and",
        "`agentkv_router_store_handles`; router RSS from `/proc/<pid>/status` (`VmRSS`); D's",
        "retention from its `/metrics`. **2 cores shared by the client, P, D and the router**",
        f"(processes outside the benchmark used {meter.other_cores:.2f} cores on average during",
        "the run), so throughput and latency are CPU-bound, not a property of the router alone.",
        "The router's `paths.mode` is `pull`: every later turn goes P then D, as vLLM's proxy",
        "does (the default, `choose`, would decode these short turns on D in place).",
        "",
        "| measure | value | bound or expectation |",
        "|---|---:|---|",
        f"| turns answered / sent / expected | {len(stats.latencies):,} / {stats.sent:,} / "
        f"{expected:,} | all |",
        f"| failed requests | {len(stats.failures)} | 0 |",
        f"| throughput | {len(stats.latencies) / wall:,.0f} turns/s ({wall:.0f} s) | |",
        f"| turn latency p50 / p99 | {pct(stats.latencies, 50):.0f} / "
        f"{pct(stats.latencies, 99):.0f} ms | |",
        f"| first turns p50 / later turns p50 | {pct(first, 50):.0f} / {pct(later, 50):.0f} ms | |",
        "| decisions (`agentkv_router_requests_total`) | "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(decisions.items()))
        + f" | miss = {conversations:,} first turns |",
        f"| tokens attached for P to read from D | {reused:,.0f} | |",
        "| handles released early, by reason | "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(released.items())) or "none")
        + f" | displaced ≈ {conversations:,} − {store_max} evicted |",
        f"| store handles, max over the run (`/health`) | {handles_max:,} | ≤ {store_max} |",
        f"| `agentkv_router_store_handles`, max | {gauge_max:,.0f} | ≤ {store_max} |",
        f"| store handles at the end | {handles_end:,} | ≤ {store_max} |",
        f"| router RSS: start / half-way / max / end | {mib(rss_start)} / {mib(rss_half)} / "
        f"{mib(rss_max)} / {mib(rss_end)} | flat once the store is full |",
        f"| D retained requests: max / end | {d_req_max:,.0f} / {d_ret_req_end:,.0f} "
        f"| ≤ {store_max} + 2 × {in_flight} in flight; end = store handles |",
        f"| D retained blocks: max / end | {max(smp.d_retained_blocks, default=0):,.0f} / "
        f"{d_ret_blocks_end:,.0f} | of {NUM_BLOCKS:,} |",
        f"| D KV usage, max | {max(smp.d_usage, default=0):.1%} | |",
        f"| wrong-KV tokens (P + D) | {wrong:,.0f} | 0 |",
        "| router's failed upstream calls / retries | "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(upstream.items())) or "none")
        + " / "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(retries.items())) or "none")
        + " | |",
        f"| router CPU | {meter.procs_s[2] / max(1, len(stats.latencies)) * 1000:.2f} ms/turn | |",
        "",
        "Checks: " + "; ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in checks.items()) + ".",
    ]
    if failed_router:
        lines.append(f"Router error answers by status: {failed_router}.")
    if stats.failures:
        lines += ["", "First failures:", *(f"- `{f}`" for f in stats.failures[:5])]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("router_load", body)
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
