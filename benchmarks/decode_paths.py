"""Every path of one turn on the simulator's ``qwen3-32b-p5en`` preset: TTFT and D's
inter-token latency (issue 24, docs/paths.md).

A conversation holds a 24k-token history on D (turn 1: P prefills, D reads and answers). Turn 2
adds 128, 2k or 16k new tokens and runs each way:

* ``decode``: straight to D, which prefills the new tokens from its prefix cache;
* ``pull``: P (without the history in its cache) reads D's KV back, computes the new tokens, D
  reads the prompt from P;
* ``local``: P that prefilled turn 1 (its prefix cache holds the history) computes the rest;
* ``recompute``: P without the history computes everything;
* ``cpu``: D's GPU prefix cache is gone (reset) but its CPU tier holds the history: straight to
  D, which loads it and prefills the rest.

TTFT is the simulator's modelled time (``X-AgentKV-Sim-Model-TTFT-Ms``, P's + D's, noise-free).
D's inter-token latency is measured on the wall clock (time scale 1): a stream of ``ignore_eos``
tokens runs on D during the turn; the figures are its median step before the turn and its
longest step that starts while the turn runs. Each path's turn has new tokens of its own, so no
path finds another's in a cache. Then ``agentkv.router.paths.choose`` picks a path for each turn
from what the engines reported (D's cached tokens, the handle, P's cache), with the default
curves and budget, and the crossover is the largest new-token count at which it still picks
``decode``.

Run: ``python benchmarks/decode_paths.py`` (``--quick`` for a smoke run at a smaller history;
writes its section of docs/benchmarks.md unless ``--no-write``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from agentkv.protocol import (
    HEADER_SIM_CACHED_TOKENS,
    HEADER_SIM_COMPUTED_TOKENS,
    HEADER_SIM_CPU_TOKENS,
    HEADER_SIM_MODEL_TTFT_MS,
)
from agentkv.protocol import Metric as M
from agentkv.protocol.promtext import parse_metrics
from agentkv.router.paths import DecodeBudget, TurnState, choose
from agentkv.sim.costmodel import PRESETS
from agentkv.sim.launch import SimProcess, start_sims
from benchmarks._report import arguments, machine, write_section

BS = 16
PRESET = "qwen3-32b-p5en"
STREAM_PROMPT = 32
KEEP = {"do_remote_prefill": False, "do_remote_decode": False}
PATH_ORDER = ("decode", "local", "pull", "recompute", "cpu")


@dataclass
class Row:
    new: int
    path: str
    ttft_ms: float
    itl_before_ms: float
    itl_during_ms: float
    itl_model_ms: float
    computed_on_d: int
    cached_on_d: int


class Bench:
    def __init__(self, p_warm: SimProcess, p_cold: SimProcess, d: SimProcess) -> None:
        self.p_warm, self.p_cold, self.d = p_warm, p_cold, d
        self.http = httpx.AsyncClient(timeout=600, trust_env=False)
        self.rng = random.Random(0)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 60000) for _ in range(n)]

    async def post(self, sim: SimProcess, body: dict[str, Any]) -> httpx.Response:
        r = await self.http.post(f"{sim.url}/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{sim.url}: {r.status_code} {r.text[:300]}")
        return r

    async def pd_turn(
        self, p: SimProcess, prompt: list[int], kv: dict[str, Any], salt: str, out: int
    ) -> tuple[float, httpx.Response]:
        """P then D, as the router runs a turn: (modelled TTFT s, D's answer)."""
        pr = await self.post(
            p,
            {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv, "cache_salt": salt},
        )
        dr = await self.post(
            self.d,
            {
                "prompt": prompt,
                "max_tokens": out,
                "ignore_eos": True,
                "return_token_ids": True,
                "cache_salt": salt,
                "kv_transfer_params": pr.json()["kv_transfer_params"],
            },
        )
        ttft = float(pr.headers[HEADER_SIM_MODEL_TTFT_MS]) + float(
            dr.headers[HEADER_SIM_MODEL_TTFT_MS]
        )
        return ttft / 1000, dr

    async def slowdown(self) -> tuple[float, float]:
        text = (await self.http.get(f"{self.d.url}/metrics")).text
        m = parse_metrics(text)
        return (
            m.get(f"{M.SIM_DECODE_SLOWDOWN_SECONDS}_total", 0.0),
            m.get(f"{M.SIM_SLOWED_DECODE_STEPS}_total", 0.0),
        )

    async def with_stream(self, turn: Any) -> tuple[Any, float, float, float]:
        """Run ``turn()`` while a stream decodes on D: (its result, D's median step before,
        D's longest step that starts during it, D's step during it as the model has it)."""
        arrivals: list[float] = []
        tick = asyncio.Event()
        body = {
            "prompt": self.ids(STREAM_PROMPT),
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
            "cache_salt": uuid.uuid4().hex,
        }

        async def read() -> None:
            async with self.http.stream("POST", f"{self.d.url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())
                        tick.set()

        task = asyncio.create_task(read())

        async def until(n: int | None = None, after: float | None = None) -> None:
            while not task.done() and not (
                (n is not None and len(arrivals) >= n)
                or (after is not None and arrivals and arrivals[-1] > after)
            ):
                tick.clear()
                waiter = asyncio.ensure_future(tick.wait())
                await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()

        try:
            await until(n=12)
            added0, steps0 = await self.slowdown()
            t0 = time.perf_counter()
            result = await turn()
            t1 = time.perf_counter()
            await until(after=t1)
            added1, steps1 = await self.slowdown()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
        gaps = list(itertools.pairwise(arrivals))
        before = statistics.median(b - a for a, b in gaps if b <= t0)
        during = max((b - a for a, b in gaps if t0 <= a < t1), default=before)
        step = PRESETS[PRESET].decode_s(1, STREAM_PROMPT + len(arrivals))
        if steps1 > steps0:
            step += (added1 - added0) / (steps1 - steps0)
        return result, before, during, step

    async def case(self, history: int, new: int) -> tuple[list[Row], dict[str, Any]]:
        salt = uuid.uuid4().hex
        first = self.ids(history)
        # turn 1: P (warm: it keeps the history) prefills, D reads and answers
        _, dr = await self.pd_turn(self.p_warm, first, {"do_remote_decode": True}, salt, 8)
        handle = dr.json()["kv_transfer_params"]
        out = dr.json()["choices"][0]["token_ids"]
        held = first + out
        rows: list[Row] = []
        seen: dict[str, Any] = {"handle_tokens": int(handle["remote_num_tokens"])}

        async def run(path: str) -> None:
            prompt = held + self.ids(new)
            seen["prompt_tokens"] = len(prompt)

            async def turn() -> tuple[float, httpx.Response]:
                if path in ("decode", "cpu"):
                    r = await self.post(
                        self.d,
                        {
                            "prompt": prompt,
                            "max_tokens": 1,
                            "cache_salt": salt,
                            "kv_transfer_params": dict(KEEP),
                        },
                    )
                    return float(r.headers[HEADER_SIM_MODEL_TTFT_MS]) / 1000, r
                if path == "pull":
                    return await self.pd_turn(self.p_cold, prompt, dict(handle), salt, 1)
                p = self.p_warm if path == "local" else self.p_cold
                return await self.pd_turn(p, prompt, {"do_remote_decode": True}, salt, 1)

            (ttft, r), before, during, model = await self.with_stream(turn)
            rows.append(
                Row(
                    new,
                    path,
                    ttft * 1000,
                    before * 1000,
                    during * 1000,
                    model * 1000,
                    int(r.headers[HEADER_SIM_COMPUTED_TOKENS]),
                    int(r.headers[HEADER_SIM_CACHED_TOKENS])
                    + int(r.headers[HEADER_SIM_CPU_TOKENS]),
                )
            )
            if path == "decode":
                seen["d_cached_tokens"] = int(r.headers[HEADER_SIM_CACHED_TOKENS])
            if path == "cpu":
                seen["d_cpu_tokens"] = int(r.headers[HEADER_SIM_CPU_TOKENS])

        for path in ("decode", "local", "pull", "recompute"):
            await run(path)
        # D's GPU prefix cache goes (its TTL passed and the blocks were reused); its CPU tier
        # still holds the history
        await self.http.post(f"{self.d.url}/reset_prefix_cache")
        await run("cpu")
        return rows, seen


def picks(history: int, news: list[int], seen: dict[int, dict[str, Any]]) -> list[list[str]]:
    """What the cost model picks for each measured turn: (a) D holds the history on its GPU,
    (b) D's GPU copy is gone but its CPU tier holds it (no handle)."""
    table = []
    for new in news:
        s = seen[new]
        n = s["prompt_tokens"]
        for label, state in (
            (
                "D's GPU holds it",
                TurnState(
                    n,
                    handle_tokens=s["handle_tokens"],
                    d_cached_tokens=s["d_cached_tokens"],
                    d_cpu_tokens=s["d_cpu_tokens"],
                ),
            ),
            ("only D's CPU tier", TurnState(n, d_cpu_tokens=s["d_cpu_tokens"])),
        ):
            c = choose(state)
            runner = "-"
            if c.runner_up is not None and c.runner_up_ttft_s is not None:
                runner = f"{c.runner_up} {c.runner_up_ttft_s * 1000:.0f} ms"
            table.append([f"{new:,}", label, f"{c.path} {c.ttft_s * 1000:.0f} ms", runner])
    return table


def crossover(history: int) -> tuple[int, int | None]:
    """The largest new-token count at which the model picks ``decode`` (default budget), and
    the one past which ``decode`` would stop being the cheapest even with no budget."""
    held = history + 7
    last_decode = 0
    unbounded: int | None = None
    wide = DecodeBudget(max_new_tokens=10**9, tokens_in_flight=10**9)
    for new in range(16, 64 * 1024 + 1, 16):
        state = TurnState(held + new, handle_tokens=held, d_cached_tokens=held // BS * BS)
        if choose(state).path == "decode":
            last_decode = new
        if unbounded is None and choose(state, budget=wide).path != "decode":
            unbounded = new
    return last_decode, unbounded


def table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


async def main_async(history: int, news: list[int]) -> tuple[list[Row], dict[int, Any]]:
    common = ["--preset", PRESET, "--time-scale", "1", "--block-size", str(BS)]
    common += ["--kv-load-failure-policy", "recompute"]
    sims = start_sims(
        [
            ["--role", "prefill", *common],
            ["--role", "prefill", "--no-prefix-caching", *common],
            ["--role", "decode", "--cpu-offload-blocks", "16384", *common],
        ],
        timeout_s=120,
    )
    try:
        bench = Bench(*sims)
        rows: list[Row] = []
        seen: dict[int, Any] = {}
        for new in news:
            got, seen[new] = await bench.case(history, new)
            rows += got
        await bench.http.aclose()
        return rows, seen
    finally:
        for sim in sims:
            sim.stop()


def main() -> None:
    ap = arguments(__doc__.split("\n\n")[0], "a 4k history, new 128 and 2k")
    args = ap.parse_args()
    history = 4096 if args.quick else 24 * 1024
    news = [128, 2048] if args.quick else [128, 2048, 16 * 1024]
    rows, seen = asyncio.run(main_async(history, news))
    measured = [
        [
            "new tokens",
            "path",
            "TTFT (model)",
            "D's ITL before",
            "D's ITL during (model)",
            "D's ITL during (wall clock)",
            "D computed",
            "D found cached",
        ]
    ]
    for r in sorted(rows, key=lambda r: (r.new, PATH_ORDER.index(r.path))):
        measured.append(
            [
                f"{r.new:,}",
                r.path,
                f"{r.ttft_ms:.0f} ms",
                f"{r.itl_before_ms:.1f} ms",
                f"{r.itl_model_ms:.1f} ms",
                f"{r.itl_during_ms:.1f} ms",
                f"{r.computed_on_d:,}",
                f"{r.cached_on_d:,}",
            ]
        )
    chosen = [["new tokens", "what D holds", "picked (estimate)", "runner-up (estimate)"]]
    chosen += picks(history, news, seen)
    last_decode, unbounded = crossover(history)
    limit = "any size tried (64k)" if unbounded is None else f"{unbounded:,} new tokens"
    body = f"""## Every path of a turn (issue 24)

`python benchmarks/decode_paths.py` — {machine()}.

The simulator's `qwen3-32b-p5en` preset at full speed (time scale 1): one P that keeps the
history in its prefix cache, one without prefix caching, one D with a CPU tier. A
{history:,}-token history is on D (turn 1 through P); turn 2 adds new tokens and runs each way
(docs/paths.md). TTFT is the simulator's modelled time (P's + D's). D's inter-token latency comes
from a stream decoding on D during the turn: its median step before the turn (wall clock), a
step while the turn runs as the model has it (the preset's step plus what each slowed step
gained: D's `agentkv_sim_decode_slowdown_seconds_total` over
`agentkv_sim_slowed_decode_steps_total`), and its longest step while the turn
runs on the wall clock (which also counts this 2-core machine's contention: the simulator moves
KV over HTTP inside D's own process, so a read slows D's stream where NIXL would not).
"D computed" and "D found cached" are D's `X-AgentKV-Sim-Computed-Tokens` and its GPU + CPU
hit (`X-AgentKV-Sim-Cached-Tokens` + `X-AgentKV-Sim-CPU-Tokens`) for the turn's request to D.

{table(measured)}

What `agentkv.router.paths.choose` picks from those counts (default curves: the preset's
figures; default budget: at most 2,048 new tokens, 8,192 in flight per D):

{table(chosen)}

A turn of `n` new tokens leaves D `n` + 8 tokens to compute (turn 1's 8-token answer sits in a
block D had not filled, so its prefix cache ends where the history does): the 2k turn's 2,056
are just over the default 2,048.

Crossover: with the default budget the model sends a turn to D up to **{last_decode:,} new
tokens** on this history and reads it back above that; on TTFT alone decode in place stays
cheapest up to {limit}: what ends it is
the cost to D's running streams (each of their steps grows by up to 8,192 × 22 µs ≈ 180 ms
while a long prefill runs), which the budget bounds.
"""
    print(body)
    if not args.no_write:
        write_section("decode_paths", body)


if __name__ == "__main__":
    main()
