"""The tables of router_overhead.py: its cells, the summaries by prompt length, the goals."""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from benchmarks._turns import PLAIN, STREAMED, Stats, Target, Workload

ORDER = ["vllm", "floor", "asgi", "router", "exact", "messages", "responses", "pd"]
LABELS = {0: "short", 1_000: "1k", 8_000: "8k", 32_000: "32k", 128_000: "128k"}


def label(length: int) -> str:
    return LABELS.get(length) or f"{length / 1000:g}k"


@dataclass
class Cell:
    target: Target
    workload: Workload
    length: int
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


@dataclass
class Memory:
    """RSS of a fresh proxy process before and after ``conversations`` more live ones."""

    name: str
    length: int
    conversations: int
    before_kib: int
    after_kib: int
    handles: int | None
    """Handles the router's ``/health`` counted at the end (None: not a router)."""

    @property
    def per_conversation_kib(self) -> float:
        return (self.after_kib - self.before_kib) / self.conversations


Key = tuple[str, str, int, int]
"""(target key, workload key, prompt length, concurrency)."""


def index(cells: list[Cell]) -> dict[Key, Cell]:
    return {(c.target.key, c.workload.key, c.length, c.concurrency): c for c in cells}


def cell_table(cells: list[Cell]) -> list[str]:
    """Every cell: CPU per turn of the proxy, throughput, latency, decisions, noise."""
    by = index(cells)
    lines = [
        "| workload | prompt | c | target | CPU ms/turn | × vLLM | turns/s | p50 ms | p99 ms "
        "| TTFB p50 | decisions | other |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    keys = ORDER + sorted({x.target.key for x in cells} - set(ORDER))
    for wl in (STREAMED, PLAIN):
        for length in sorted({x.length for x in cells}):
            for c in sorted({x.concurrency for x in cells if x.workload == wl}):
                base = by.get(("vllm", wl.key, length, c))
                for key in keys:
                    cell = by.get((key, wl.key, length, c))
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
                        f"| {wl.name} | {label(length)} | {c} | {cell.target.name}{fails} "
                        f"| {cpu} | {ratio} | {cell.rps:,.1f} | {cell.pct('latencies', 50):.2f} "
                        f"| {cell.pct('latencies', 99):.2f} | {cell.pct('ttfb', 50):.2f} "
                        f"| {dec or '—'} | {cell.other:.2f} |"
                    )
    return lines


def _ms(cell: Cell | None) -> str:
    return f"{cell.cpu_ms:.2f}" if cell and cell.turns else "—"


def _ratio(a: Cell | None, b: Cell | None) -> str:
    if not (a and b and a.turns and b.turns and b.cpu_ms):
        return "—"
    return f"{a.cpu_ms / b.cpu_ms:.2f}"


def added_p50(cell: Cell | None, base: Cell | None) -> float | None:
    """p50 latency of ``cell`` minus the client's own P then D (``base``), ms."""
    if not (cell and base and cell.turns and base.turns):
        return None
    return cell.pct("latencies", 50) - base.pct("latencies", 50)


def length_tables(cells: list[Cell]) -> list[str]:
    """Issue 23's table (CPU per turn by prompt length against vLLM's proxy and the floor) and
    issue 22's (Messages and Responses against chat)."""
    by = index(cells)
    lengths = sorted({c.length for c in cells if c.workload == STREAMED})
    concs = sorted({c.concurrency for c in cells if c.workload == STREAMED})
    lines = [
        "| prompt | c | router exact ids | router chat | vLLM proxy | relay floor "
        "| exact ÷ proxy | chat ÷ proxy | exact ÷ floor | chat ÷ floor "
        "| added p50 ms, exact / chat |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        for c in concs:

            def get(key: str, length: int = length, c: int = c) -> Cell | None:
                return by.get((key, "stream", length, c))

            exact, chat, vllm, floor = get("exact"), get("router"), get("vllm"), get("floor")
            pd = by.get(("pd", "stream", length, 1))
            added = "—"
            if c == 1:
                a, b = added_p50(exact, pd), added_p50(chat, pd)
                added = " / ".join("—" if x is None else f"{x:+.1f}" for x in (a, b))
            lines.append(
                f"| {label(length)} | {c} | {_ms(exact)} | {_ms(chat)} | {_ms(vllm)} "
                f"| {_ms(floor)} | {_ratio(exact, vllm)} | {_ratio(chat, vllm)} "
                f"| {_ratio(exact, floor)} | {_ratio(chat, floor)} | {added} |"
            )
    lines += stack_table(by, lengths, concs)
    lines += [
        "",
        "Messages and Responses against chat, router CPU ms per turn in the same run (issue 22:",
        "within 20 % of chat):",
        "",
        "| prompt | c | router chat | Messages | Responses | Messages ÷ chat | Responses ÷ chat |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        for c in concs:
            chat = by.get(("router", "stream", length, c))
            msgs = by.get(("messages", "stream", length, c))
            resp = by.get(("responses", "stream", length, c))
            lines.append(
                f"| {label(length)} | {c} | {_ms(chat)} | {_ms(msgs)} | {_ms(resp)} "
                f"| {_ratio(msgs, chat)} | {_ratio(resp, chat)} |"
            )
    return lines


def stack_table(
    by: dict[tuple[str, str, int, int], Cell], lengths: list[int], concs: list[int]
) -> list[str]:
    """Where the router's CPU goes, when the ASGI floor ran: the raw floor, the router's stack
    doing the floor's work, and the router's own work on top (CPU ms per turn, streamed)."""
    if not any(key == "asgi" for key, *_ in by):
        return []
    lines = [
        "",
        "The router's stack against the floors, CPU ms per turn in the same run: *stack* is the",
        "ASGI floor over the relay floor (uvicorn, ASGI and aiohttp doing the floor's work),",
        "*router's work* the router over the ASGI floor (routing, middleware, verification,",
        "handles, receipts, metrics):",
        "",
        "| prompt | c | relay floor | ASGI floor | router exact ids | router chat | vLLM proxy "
        "| ASGI ÷ floor | ASGI ÷ proxy | stack ms | router's work ms, exact / chat |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        for c in concs:
            floor, asgi = (
                by.get(("floor", "stream", length, c)),
                by.get(("asgi", "stream", length, c)),
            )
            exact, chat = (
                by.get(("exact", "stream", length, c)),
                by.get(("router", "stream", length, c)),
            )
            vllm = by.get(("vllm", "stream", length, c))
            lines.append(
                f"| {label(length)} | {c} | {_ms(floor)} | {_ms(asgi)} | {_ms(exact)} "
                f"| {_ms(chat)} | {_ms(vllm)} | {_ratio(asgi, floor)} | {_ratio(asgi, vllm)} "
                f"| {_diff(asgi, floor)} | {_diff(exact, asgi)} / {_diff(chat, asgi)} |"
            )
    return lines


def _diff(a: Cell | None, b: Cell | None) -> str:
    if not (a and b and a.turns and b.turns):
        return "—"
    return f"{a.cpu_ms - b.cpu_ms:+.2f}"


def memory_table(rows: list[Memory], warm: int) -> list[str]:
    if not rows:
        return []
    n = rows[0].conversations
    lines = [
        "",
        "Memory: each proxy started afresh (after the cells, in front of a fresh P and D that",
        f"keep every handle for 600 s, the router told so), warmed with {warm} conversations,",
        f"then {n} more, all of one turn at {label(rows[0].length)} tokens, one at a time,",
        "all left live (the router's handles are counted by its `/health`; vLLM's proxy keeps",
        "every conversation's handle). RSS from `/proc/<pid>/status`, each reading after 2 s at",
        "rest (past the router's heap trim, `http.heap_trim_interval_s`); per conversation: the",
        f"growth over the {n} divided by {n}.",
        "",
        "| proxy | RSS before | RSS after | live handles | KiB per live conversation |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in rows:
        handles = "—" if m.handles is None else f"{m.handles}"
        lines.append(
            f"| {m.name} | {m.before_kib / 1024:.1f} MiB | {m.after_kib / 1024:.1f} MiB "
            f"| {handles} | {m.per_conversation_kib:,.0f} |"
        )
    return lines


def length_goals(cells: list[Cell], memory: list[Memory]) -> list[str]:
    """Issue 23's goals and issue 22's Messages/Responses evidence, met or not, in this run."""
    by = index(cells)
    out: list[str] = []
    missed, total = [], 0
    for (key, wl, length, c), cell in sorted(by.items()):
        if wl != "stream" or key not in ("exact", "router"):
            continue
        vllm, floor = by.get(("vllm", wl, length, c)), by.get(("floor", wl, length, c))
        if not (vllm and floor and cell.turns):
            continue
        total += 1
        if cell.cpu_ms > vllm.cpu_ms / 3 or cell.cpu_ms > 2 * floor.cpu_ms:
            missed.append(f"{'exact' if key == 'exact' else 'chat'} {label(length)} c={c}")
    if total:
        out.append(
            "- Router CPU per turn ≤ 1/3 of vLLM's proxy and ≤ 2× the relay floor (issue 23): "
            f"met in {total - len(missed)} of {total} cells"
            + (f"; not met: {', '.join(missed)}." if missed else ".")
        )
    added = []
    for length in sorted({c.length for c in cells}):
        pd = by.get(("pd", "stream", length, 1))
        bound = 1 + 0.02 * length / 1000
        for key, name in (("exact", "exact"), ("router", "chat")):
            x = added_p50(by.get((key, "stream", length, 1)), pd)
            if x is not None:
                added.append(
                    f"{name} {label(length)} {x:+.1f} ms ({'ok' if x <= bound else 'over'})"
                )
    if added:
        out.append(
            "- Added p50 at c=1 over the client's own P then D, goal ≤ 1 ms + 0.02 ms per 1k "
            f"prompt tokens (issue 23): {', '.join(added)}."
        )
    proxy = next((m for m in memory if m.name == "vLLM proxy"), None)
    for m in memory:
        if m is proxy:
            continue
        verdict = ""
        if proxy:
            ok = m.per_conversation_kib <= proxy.per_conversation_kib
            verdict = (
                f" against vLLM's proxy's {proxy.per_conversation_kib:,.0f} KiB "
                f"(goal ≤, issue 23: **{'met' if ok else 'not met'}**)"
            )
        out.append(
            f"- {m.name}: {m.per_conversation_kib:,.0f} KiB per live {label(m.length)}-token "
            f"conversation{verdict}; {m.per_conversation_kib * 10_000 / 1024**2:.1f} GiB for "
            "10,000."
        )
    for key, name in (("messages", "Messages"), ("responses", "Responses")):
        ratios = []
        for (k, wl, length, c), cell in sorted(by.items()):
            chat = by.get(("router", wl, length, c))
            if k == key and wl == "stream" and chat and cell.turns and chat.cpu_ms:
                ratios.append(cell.cpu_ms / chat.cpu_ms)
        if ratios:
            ok = all(r <= 1.2 for r in ratios)
            out.append(
                f"- {name} router CPU per turn ÷ chat's: {min(ratios):.2f}–{max(ratios):.2f} "
                f"(issue 22: within 20 %: **{'met' if ok else 'not met'}**)."
            )
    return out


def sweep_goals(cells: list[Cell]) -> list[str]:
    """The short-prompt sweep's goals (c=64 against vLLM's proxy; flat across concurrency)."""
    by = {(c.target.key, c.workload.key, c.concurrency): c for c in cells}
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


def failed_cells(cells: list[Cell]) -> list[str]:
    failed = [c for c in cells if c.failures]
    if not failed:
        return []
    return [
        "",
        "Failed turns (first message of each cell):",
        "",
        *(
            f"- {c.target.name}, {c.workload.name}, {label(c.length)}, c={c.concurrency}: "
            f"{len(c.failures)}, `{c.failures[0]}`"
            for c in failed
        ),
    ]
