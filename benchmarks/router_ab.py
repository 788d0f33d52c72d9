"""Router CPU per turn, two builds side by side: another commit's router against this tree's.

``router_overhead.py`` compares the router with vLLM's proxy and a relay floor; a change to the
router is best measured against the router it changes, in one run, on the same load: this
starts one router from ``git archive BASE`` (a temporary directory) and one from this tree, in
front of the same simulator P and D (``--preset zero --time-scale 0``), and sends each the same
conversations (``benchmarks/_turns.py``; streamed, 128 tokens per answer, c=1), the two
alternating round after round. *CPU ms/turn* is each router process's CPU time (``/proc``) per
turn; the figure is the median of the rounds. Both routers go P then D on every turn
(``paths.mode = "pull"`` where the base has it). On a shared machine the rounds' spread says how
far to trust a difference.

Run: ``python benchmarks/router_ab.py --base 9917efb --lengths 32k --kinds exact,chat,messages``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentkv.procs import start_on_free_port
from agentkv.router.config_legacy import FLAT_KEYS
from benchmarks._loadgen import ROOT, Proc, one_p_one_d
from benchmarks._overhead_setup import (
    D_TTL_S,
    LENGTHS,
    PULL,
    ROUTER_DEADLINES,
    d_blocks,
    loadavg,
    sim_args,
    tree_cpu,
)
from benchmarks._turns import PLAIN, STREAMED, Material, Target, drive

KINDS = ("exact", "chat", "messages", "responses")


@contextlib.contextmanager
def exported(rev: str) -> Iterator[Path]:
    """``git archive rev`` of this repository in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="agentkv-ab-") as tmp:
        archive = subprocess.run(
            ["git", "archive", rev], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def for_tree(tree: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (nested by group, ``paths.mode = "pull"``) as ``tree``'s router reads it: as it is
    where its configuration has the groups; else flat (each key under its old name,
    :data:`~agentkv.router.config_legacy.FLAT_KEYS`), without ``paths`` where it has no such
    setting (a router from before the paths went P then D on every turn)."""
    config = (tree / "agentkv" / "router" / "config.py").read_text()
    if "class PathSettings" in config:
        return cfg
    old = {new: flat for flat, new in FLAT_KEYS.items()}
    out: dict[str, Any] = {}
    for group, fields in cfg.items():
        for name, value in fields.items():
            if (group, name) == ("http", "host") or (group, name) in old:
                out[old.get((group, name), name)] = value
    if "paths:" not in config and "paths =" not in config:
        out.pop("paths", None)
    return out


def router_from(tree: Path, cfg: dict[str, Any], logs: Path) -> Proc:
    """A router process importing ``agentkv`` from ``tree`` (its cwd and ``PYTHONPATH``), on
    127.0.0.1 (its default host, in every version) with ``cfg`` as ``tree`` reads it."""

    def argv(port: int) -> list[str]:
        path = logs / f"router-{port}.json"
        path.write_text(json.dumps(cfg))
        cmd = [sys.executable, "-m", "agentkv", "router", "--config", str(path)]
        return [*cmd, "--port", str(port), "--log-level", "warning"]

    saved_env, saved_cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = str(tree)
    os.chdir(tree)
    try:
        return start_on_free_port(
            argv, name="router", log=lambda port: logs / f"router-{port}.log", timeout_s=60
        )
    finally:
        os.chdir(saved_cwd)
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (git rev)")
    parser.add_argument("--lengths", default="1k,32k", help=f"of {','.join(LENGTHS)}")
    parser.add_argument("--kinds", default="exact,chat", help=f"of {','.join(KINDS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, help="per round (default: by length)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--concurrency", type=int, default=1, help="conversations at once")
    parser.add_argument(
        "--plain", action="store_true", help="not streamed, 8 tokens (default: streamed, 128)"
    )
    args = parser.parse_args()
    workload, c = (PLAIN if args.plain else STREAMED), args.concurrency
    kinds = args.kinds.split(",")
    lengths = [LENGTHS[n] for n in args.lengths.split(",")]
    per_length = {1_000: 16, 8_000: 8, 32_000: 4, 128_000: 2}
    print(f"load average at the start: {loadavg()}", flush=True)
    rows: list[str] = []
    with exported(args.base) as base_tree:
        for length in lengths:
            with one_p_one_d(sim_args(), sim_args(d_blocks(length))) as engines:
                cfg = engines.router_config(
                    retention={"decoder_kv_blocks_ttl_s": D_TTL_S, "ttl_margin_s": 10.0},
                    upstream=ROUTER_DEADLINES,
                    paths=PULL,
                )
                routers = {
                    "base": router_from(base_tree, for_tree(base_tree, cfg), engines.logs),
                    "this": router_from(ROOT, for_tree(ROOT, cfg), engines.logs),
                }
                engines.procs.extend(routers.values())
                mat = Material(engines.p.url, engines.d.url, length)
                n = max(args.conversations or per_length.get(length, 4), c)
                cpu: dict[tuple[str, str], list[float]] = {}
                for rnd in range(args.rounds):
                    order = list(routers.items())
                    for build, proc in order if rnd % 2 == 0 else order[::-1]:
                        for kind in kinds:
                            t = Target(build, f"{build} {kind}", proc.url, kind, proc.pid)
                            cell = f"ab-{build}-{kind}-{length}-{rnd}-{os.getpid()}"
                            asyncio.run(drive(t, workload, c, c, f"{cell}-warm", mat, 2))
                            before = tree_cpu(proc.pid)
                            st, _ = asyncio.run(drive(t, workload, c, n, cell, mat, args.turns))
                            if st.failures:
                                raise SystemExit(f"{build} {kind}: {st.failures[0]}")
                            ms = (tree_cpu(proc.pid) - before) / len(st.latencies) * 1000
                            cpu.setdefault((build, kind), []).append(ms)
                            print(f"{length} {build} {kind} r{rnd}: {ms:.2f} ms/turn", flush=True)
                for kind in kinds:
                    base, this = (cpu[(b, kind)] for b in ("base", "this"))
                    mb, mt = statistics.median(base), statistics.median(this)
                    ratio = f"{mt / mb:.2f}" if mb else "–"  # CPU ticks are 10 ms
                    rows.append(
                        f"| {length // 1000}k | {kind} | {mb:.2f} ({min(base):.2f}–{max(base):.2f})"
                        f" | {mt:.2f} ({min(this):.2f}–{max(this):.2f}) | {ratio} |"
                    )
    print(f"load average at the end: {loadavg()}")
    shape = f"{workload.key}, c={c}"
    print(f"\nbase {args.base}, this tree ({shape}); router CPU ms per turn, median (min–max)")
    print("| prompt | kind | base | this | this ÷ base |\n|---:|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
