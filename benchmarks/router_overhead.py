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
* **ASGI floor** (``benchmarks/_asgi_floor.py``, ``--targets asgi``, not in the default set):
  the same steps on the router's own stack (uvicorn with httptools and uvloop, a bare ASGI
  callable, aiohttp, orjson): what that stack costs before the router does any work;
* **agentkv router (chat)**: ``agentkv router`` given the chat messages, so it also asks P's
  ``/tokenize`` for the prompt ids and verifies the stored handle against them;
* **agentkv router (exact ids)**: given ``kv_transfer_params.prompt_token_ids`` as agentkv's SDK
  sends them (no ``/tokenize``);
* **agentkv router (Messages)** and **(Responses)**: the same conversation as Anthropic
  Messages (``X-Conversation-Id``) and as stateless OpenAI Responses (``store: false``, the
  whole input every turn, ``prompt_cache_key``), as Claude Code and Codex send them;
* **P then D (client)**: the client itself does the exact-ids P then D steps, keeping D's
  handle: the baseline for the router's *added* latency (streamed, c=1).

Conversations of 8 turns (``benchmarks/_turns.py``) whose first prompt is 1k, 8k, 32k or 128k
tokens (``--lengths``), streamed with 128 tokens per answer, c=1 and c=8 (``--concurrency``);
closed loop, the targets in alternating order in each round; CPU per turn of each proxy's
process from ``/proc``; then the RSS per live 32k-token conversation of fresh router and proxy
processes. ``--lengths short`` is the concurrency sweep of short conversations (c=1, 16, 64,
256 streamed and c=64 non-streamed with 8 tokens), its own section.

Run: ``python benchmarks/router_overhead.py`` (``--quick`` for a smoke run; writes its section of
docs/benchmarks.md unless ``--no-write``; ``--compare`` adds router variants: uvicorn without
uvloop/httptools, granian (the httpx upstream client it once compared is gone); ``--profile``
adds a py-spy profile of the router at c=64, streamed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._loadgen import CPUMeter, one_p_one_d, wait_quiet
from benchmarks._overhead_report import (
    Cell,
    Memory,
    cell_table,
    failed_cells,
    label,
    length_goals,
    length_tables,
    memory_table,
    sweep_goals,
)
from benchmarks._overhead_setup import (
    CONVERSATIONS,
    D_TTL_S,
    LENGTHS,
    PROXY_PYTHON,
    PULL,
    ROUTER_DEADLINES,
    RSS_CONVERSATIONS,
    RSS_WARM,
    d_blocks,
    loadavg,
    memory_phase,
    profile,
    proxy_python,
    sim_args,
    start_targets,
    tree_cpu,
)
from benchmarks._report import arguments, machine, write_section
from benchmarks._turns import PLAIN, STREAMED, TURNS, Material, Stats, Target, Workload, drive


def measure(
    t: Target,
    wl: Workload,
    c: int,
    n_conv: int,
    warm: tuple[int, int],
    rnd: int,
    mat: Material,
    pids: list[int],
    turns: int = TURNS,
) -> tuple[Stats, float, float, float]:
    """One round of one cell: ``warm`` (conversations, turns) unmeasured, then ``n_conv``
    conversations of ``turns`` turns, c at a time."""
    cell = f"{t.key}-{wl.key}-{mat.length}-c{c}-r{rnd}-{os.getpid()}"
    asyncio.run(drive(t, wl, min(c, warm[0]), warm[0], f"{cell}-warm", mat, warm[1]))
    with CPUMeter(pids) as meter:
        before = tree_cpu(t.pid) if t.pid else 0.0
        st, wall = asyncio.run(drive(t, wl, c, n_conv, cell, mat, turns))
        proxy = (tree_cpu(t.pid) - before) if t.pid else 0.0
    return st, wall, proxy, meter.other_cores


def rounds(n: int) -> str:
    return "1 round" if n == 1 else f"{n} rounds"


# -- report ------------------------------------------------------------------------------------

TARGET_LINES = [
    "- **vLLM proxy**: vLLM 0.33's `disagg_proxy_multiturn.py`, unmodified, in its own",
    "  virtualenv (`fastapi uvicorn httpx sniffio`); it logs each request at INFO, as",
    "  shipped;",
    "- **relay floor**: `benchmarks/_relay_floor.py`, the same P/D steps in raw asyncio,",
    "  pooled keep-alive connections, D's bytes passed through (no verification, nothing",
    "  stripped): the floor for a Python proxy;",
    "- **ASGI floor** (when run): `benchmarks/_asgi_floor.py`, the same steps on the router's",
    "  stack (uvicorn with httptools and uvloop, a bare ASGI callable, aiohttp, orjson), no",
    "  routing, middleware or verification: the router's stack before the router's work;",
    "- **agentkv router (chat)**: given the messages: it asks P's `/tokenize`, verifies the",
    "  handle against the ids, strips internal fields;",
    "- **agentkv router (exact ids)**: given `kv_transfer_params.prompt_token_ids` and",
    "  `return_token_ids`, as the SDK sends them;",
    "- **agentkv router (Messages)**: the same conversation as Anthropic Messages",
    "  (`POST /v1/messages`, system and content as blocks, `X-Conversation-Id`);",
    "- **agentkv router (Responses)**: as OpenAI Responses the way Codex sends it",
    "  (`POST /v1/responses`, `store: false`, the whole input every turn,",
    "  `prompt_cache_key`);",
    "- **P then D (client)**: the client does the exact-ids P then D steps itself (the",
    "  baseline for the router's added latency).",
    "",
    'Every agentkv router here has `paths.mode = "pull"`: each turn goes P then D, the',
    "path vLLM's proxy and the floor take (the default, `choose`, would decode a turn's few",
    "new tokens on D in place and skip P).",
]

MEASURE_LINES = [
    "*CPU ms/turn* is the proxy process's CPU time (`/proc`, user + system) per",
    "turn, the median of the rounds (min–max in brackets); *× vLLM* divides it by vLLM's",
    "proxy's in the same cell. Latency is per turn on the client (a raw asyncio HTTP/1.1",
    "client, one keep-alive connection per worker, in the benchmark's process), TTFB to",
    "the first body byte. *other*: cores used by processes outside the benchmark during",
    "the cell (noise).",
]


def lengths_report(
    cells: list[Cell],
    mem: list[Memory],
    mats: list[Material],
    args: argparse.Namespace,
    run: dict[str, Any],
    extra: list[str],
) -> str:
    concs = ", ".join(f"c={c}" for c in sorted({c.concurrency for c in cells}))
    sizes = ", ".join(f"{label(m.length)} {m.exact_tokens:,} / {m.chat_tokens:,}" for m in mats)
    per = "/".join(str(c) for c in sorted({c.concurrency for c in cells}))
    lines = [
        "## Router data plane by prompt length (and overhead)",
        "",
        f"`python benchmarks/router_overhead.py{run['argv']}` — {machine()}.",
        "",
        "One simulator P and one simulator D with no simulated delays (`--preset zero",
        "--time-scale 0`): every millisecond is HTTP, JSON and Python. Conversations of",
        f"{args.turns} turns (the next prompt is the history, the answer and a new question,",
        f"so turns 2–{args.turns} can pull the last turn's KV from D), streamed with 128 tokens",
        "per answer (`stream_options.include_usage`, as the SDK sends it). The first prompt",
        "of each conversation is a system prompt unique to it and a shared filler of words,",
        "one token each; each turn adds about 155 tokens. First-turn prompt tokens in exact",
        f"ids / as chat: {sizes}.",
        "",
        "Targets, each its own process in front of the same P and D:",
        "",
        *TARGET_LINES,
        "",
        "The router's `decode_first_byte_timeout_s` and `prefill_deadline_s` are 300 s: their",
        "30 s defaults fire at 128k tokens, c=8, on a loaded machine, and a retry is a second",
        "P pass (vLLM's proxy waits without a limit). P keeps its blocks for D's read 240 s",
        "(the simulator's default 30 s passes there too; vLLM's own is 480 s).",
        "",
        f"{rounds(args.rounds)}, the targets in alternating order in each, {concs}.",
        f"Conversations per cell and round at c={per}: {run['conversations']}; before each",
        "cell, warm-up conversations of 2 turns. " + MEASURE_LINES[0],
        *MEASURE_LINES[1:],
        "",
        f"**Load**: `uptime`'s load average (1, 5, 15 min) at the start {run['load_start']},",
        f"at the end {run['load_end']}, on {os.cpu_count()} cores shared with other work; "
        f"cores used outside the benchmark at the start: {run['quiet']:.2f}.",
        "",
        "Router CPU ms per turn by prompt length (streamed, 128 tokens; medians of the rounds).",
        "*Added p50* (c=1): the router's p50 latency minus the client's own P then D's (which",
        "sends exact ids); the chat figure includes P's `/tokenize` of the whole conversation.",
        "",
        *length_tables(cells),
        *memory_table(mem, RSS_WARM),
        "",
        *length_goals(cells, mem),
        "",
        "Every cell:",
        "",
        *cell_table(cells),
        *extra,
        *failed_cells(cells),
        "",
        f"Whole run: {run['wall_s']:.0f} s.",
    ]
    return "\n".join(lines)


def sweep_report(
    cells: list[Cell], args: argparse.Namespace, run: dict[str, Any], extra: list[str]
) -> str:
    lines = [
        "## Router data plane: short prompts across concurrency",
        "",
        f"`python benchmarks/router_overhead.py{run['argv']}` — {machine()}.",
        "",
        "One simulator P and one simulator D with no simulated delays (`--preset zero",
        "--time-scale 0`): every millisecond is HTTP, JSON and Python. Conversations of 8",
        "turns (the next prompt is the history, the answer and a new question, so turns 2–8",
        "can pull the last turn's KV from D; a system prompt of about 40 tokens), streamed",
        "with 128 tokens per answer (`stream_options.include_usage`, as the SDK sends it) or",
        "not streamed with 8. Targets, each its own process in front of the same P and D:",
        "",
        *TARGET_LINES,
        "",
        f"{rounds(args.rounds)}, the targets in alternating order in each; a warm-up before",
        "each cell. " + " ".join(MEASURE_LINES[:1]),
        *MEASURE_LINES[1:],
        "",
        *cell_table(cells),
        "",
        *sweep_goals(cells),
        *extra,
        *failed_cells(cells),
        "",
        f"Whole run: {run['wall_s']:.0f} s; load outside the benchmark at start: "
        f"{run['quiet']:.2f} cores; load average at the start {run['load_start']}, at the end "
        f"{run['load_end']}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], "few turns per cell")
    parser.add_argument(
        "--lengths",
        help=f"first-prompt lengths, comma-separated, of {','.join(LENGTHS)} "
        "(default 1k,8k,32k,128k; 'short' alone: the concurrency sweep)",
    )
    parser.add_argument("--rounds", type=int, help="default 2 (--quick: 1)")
    parser.add_argument("--turns", type=int, default=TURNS, help="turns per conversation")
    parser.add_argument("--conversations", type=int, help="conversations per cell and round")
    parser.add_argument("--wait-quiet", type=float, metavar="S", help="default 30 (--quick: 0)")
    parser.add_argument(
        "--concurrency",
        type=int,
        action="append",
        help="default 1 8 (--quick: 1 2; short: 1 16 64 256)",
    )
    parser.add_argument(
        "--plain-concurrency", type=int, action="append", help="default none (short: 64)"
    )
    parser.add_argument(
        "--targets",
        help="comma-separated subset of vllm,floor,router,exact,messages,responses,pd "
        "(default all of them) and asgi (the ASGI floor, only when named)",
    )
    parser.add_argument(
        "--rss-conversations",
        type=int,
        help=f"live conversations for the memory figure (default {RSS_CONVERSATIONS}; 0: none)",
    )
    parser.add_argument("--compare", action="store_true", help="router variants (server)")
    parser.add_argument("--profile", action="store_true", help="py-spy the router at c=64")
    parser.add_argument(
        "--vllm-proxy-python",
        default=os.environ.get("VLLM_PROXY_PYTHON", str(PROXY_PYTHON)),
        help="python of a virtualenv with fastapi uvicorn httpx sniffio (default: "
        ".venv-vllm-proxy, made on first use)",
    )
    args = parser.parse_args()
    names = (args.lengths or ("1k,8k" if args.quick else "1k,8k,32k,128k")).split(",")
    unknown = [n for n in names if n not in LENGTHS]
    if unknown:
        parser.error(f"unknown length {', '.join(unknown)}; known: {', '.join(LENGTHS)}")
    lengths = [LENGTHS[n] for n in names]
    sweep = lengths == [0]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    concs = args.concurrency or ([1, 16, 64, 256] if sweep else [1, 2] if args.quick else [1, 8])
    plain_concs = args.plain_concurrency or ([64] if sweep else [])
    wait_s = args.wait_quiet if args.wait_quiet is not None else (0.0 if args.quick else 30.0)
    rss_n = args.rss_conversations
    if rss_n is None:
        rss_n = 0 if sweep else (4 if args.quick else RSS_CONVERSATIONS)

    def n_conv(length: int, c: int) -> int:
        if args.conversations:
            return max(c, int(args.conversations))
        if args.quick:
            return max(c, 8 if sweep else 1)
        return max(c, CONVERSATIONS[length]) if c < 256 else c

    def warm(length: int, c: int) -> tuple[int, int]:
        """(conversations, turns) of a cell's warm-up."""
        if sweep:
            return max(c, 8), args.turns
        return (min(c, 8 if length <= 8_000 else 2), 2)

    argv = " ".join(sys.argv[1:])
    run: dict[str, Any] = {
        "argv": f" {argv}" if argv else "",
        "load_start": loadavg(),
        "conversations": ", ".join(
            f"{label(n)} {'/'.join(str(n_conv(n, c)) for c in concs)}" for n in lengths
        ),
    }
    print(f"load average at the start: {run['load_start']}", flush=True)
    started = time.perf_counter()
    extra: list[str] = []
    mem: list[Memory] = []
    mats: list[Material] = []
    cells: list[Cell] = []
    keep = set(args.targets.split(",")) if args.targets else None
    if keep is None or "vllm" in keep:
        args.vllm_proxy_python = proxy_python(args.vllm_proxy_python)
    with one_p_one_d(sim_args(), sim_args(d_blocks(max(lengths)))) as engines:
        p, d, logs, procs = engines.p, engines.d, engines.logs, engines.procs
        cfg = engines.router_config(
            retention={"decoder_kv_blocks_ttl_s": D_TTL_S, "ttl_margin_s": 10.0},
            upstream=ROUTER_DEADLINES,
            paths=PULL,
        )
        targets = start_targets(engines, cfg, keep, args.vllm_proxy_python, args.compare)
        sim_pids = [p.process.pid, d.process.pid]
        run["quiet"] = wait_quiet([*sim_pids, *(x.pid for x in procs)], max_wait_s=wait_s)
        print(f"load outside the benchmark: {run['quiet']:.2f} cores", flush=True)
        plan = [(STREAMED, c) for c in concs] + [(PLAIN, c) for c in plain_concs]
        for length in lengths:
            mat = Material(p.url, d.url, length)
            mats.append(mat)
            print(
                f"prompt {label(length)}: {mat.exact_tokens} tokens in exact ids, "
                f"{mat.chat_tokens} as chat",
                flush=True,
            )
            for wl, c in plan:
                # the client's own P then D is the latency baseline at c=1 only
                here = [t for t in targets if t.kind != "pd" or (c == 1 and wl == STREAMED)]
                done = {t.key: Cell(t, wl, length, c) for t in here}
                for rnd in range(args.rounds):
                    order = here if rnd % 2 == 0 else here[::-1]
                    for t in order:
                        res = measure(
                            t,
                            wl,
                            c,
                            n_conv(length, c),
                            warm(length, c),
                            rnd,
                            mat,
                            sim_pids,
                            args.turns,
                        )
                        done[t.key].rounds.append(res)
                        st, wall, cpu, other = res
                        print(
                            f"{wl.key} {label(length)} c={c} r{rnd} {t.name}: "
                            f"{len(st.latencies) / wall:,.1f} turns/s, p50 "
                            f"{statistics.median(st.latencies or [0]) * 1000:.2f} ms, CPU "
                            f"{cpu / max(1, len(st.latencies)) * 1000:.2f} ms/turn, other "
                            f"{other:.2f}, {dict(st.decisions)}, {len(st.failures)} failed"
                            f"{': ' + st.failures[0] if st.failures else ''}",
                            flush=True,
                        )
                cells += done.values()
        if args.profile:
            extra += profile(cfg, logs, mats[0])
    if rss_n:
        rss_len = 32_000 if 32_000 in lengths else max(lengths)
        mem = memory_phase(args.vllm_proxy_python, rss_len, rss_n, keep)
    run["wall_s"] = time.perf_counter() - started
    run["load_end"] = loadavg()
    print(f"load average at the end: {run['load_end']}", flush=True)
    if sweep:
        body = sweep_report(cells, args, run, extra)
    else:
        body = lengths_report(cells, mem, mats, args, run, extra)
    print(body)
    if not args.no_write:
        write_section("router_overhead_short" if sweep else "router_overhead", body)
    if any(c.failures for c in cells):
        sys.exit(1)


if __name__ == "__main__":
    main()
