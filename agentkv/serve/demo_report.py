"""``agentkv demo``'s verdict and tables: the claims it checks over the three clients' turns and
the tables that show them, fitting 80 columns."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from agentkv.serve.demo_agent import REWRITES, Row

__all__ = ["check", "print_tables"]

DECISIONS = {
    "miss": "the router holds no handle for the conversation (its first turn, or no "
    "conversation id)",
    "pull": "P read the verified history's KV back from D instead of recomputing it "
    "([bold]trimmed[/]: after a rewrite, only the prefix the rewrite left unchanged)",
    "decode": "the turn went straight to the D that held the history, which prefilled only "
    "the new tokens from its own prefix cache (the router's cost model chose it: faster than "
    "reading the KV back through P)",
    "cpu": "the handle was gone; the turn went to the D whose CPU tier held the history, "
    "which loaded it and prefilled the rest (router config paths.mode = choose, D's KV events)",
    "stale": "a handle the prompt does not extend, released, nothing read",
    "local": "P's own prefix cache held what D offered; nothing read",
    "recompute": "too little to read; recomputed",
    "expired": "the handle was too close to D's TTL to read",
}
FOOTER = (
    "[bold]wrong KV[/] = prompt tokens that ran on KV computed for other tokens (silent "
    "corruption: vLLM places a handle's blocks by position and checks nothing); an answer "
    "computed on them is not the model's, so the TTFT such a turn saves counts for nothing. "
    "TTFT = the simulator's modelled time to first token (its cost model, noise-free), in ms."
)


def check(verified: list[Row], naive: list[Row], unverified: list[Row]) -> list[str]:
    """The demo's claims, each that failed as a sentence: agentkv reads no wrong KV and reuses
    the history on every turn after the first (``pull`` or ``decode``; the rewrite turns
    trimmed), unverified reuse reads wrong KV, and agentkv's modelled TTFT is below the naive
    client's."""
    problems = []
    if sum(r.wrong_kv for r in verified):
        problems.append("agentkv's turns ran on wrong KV")
    if not sum(r.wrong_kv for r in unverified):
        problems.append("unverified reuse read no wrong KV")
    for r in verified[1:]:
        if r.decision not in ("pull", "decode"):
            problems.append(f"turn {r.turn}: decision {r.decision}, not pull or decode")
        elif (r.turn in REWRITES) != r.trimmed:
            problems.append(f"turn {r.turn}: {'not ' if r.turn in REWRITES else ''}trimmed")
    if sum(r.ttft_ms for r in verified) >= sum(r.ttft_ms for r in naive):
        problems.append("agentkv's modelled TTFT is not below the naive client's")
    return problems


def _how(r: Row) -> str:
    """How a turn reused the tokens it did not recompute."""
    return "found in D's prefix cache" if r.decision in ("decode", "cpu") else "read back"


def _decision(r: Row) -> str:
    return f"{r.decision} (trimmed)" if r.trimmed else r.decision


def _turns(rows: list[Row]) -> str:
    """``"4 and 6"``: the turns of ``rows``."""
    names = [str(r.turn) for r in rows]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _table(title: str, caption: str) -> Table:
    """A table that fits 80 columns: no outer edge, one space between columns."""
    return Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )


def print_tables(
    console: Console, verified: list[Row], naive: list[Row], unverified: list[Row]
) -> None:
    table = _table(
        "agentkv: exact ids, one conversation id, verified reuse",
        "modelled ms; no reuse = the same turn without a conversation id; saved = no reuse - TTFT",
    )
    for col in ("turn", "TTFT", "no reuse", "saved", "prompt", "reused", "decision", "wrong KV"):
        table.add_column(col, justify="right", no_wrap=True)
    for r, base in zip(verified, naive, strict=True):
        table.add_row(
            str(r.turn),
            f"{r.ttft_ms:.0f}",
            f"{base.ttft_ms:.0f}",
            f"{base.ttft_ms - r.ttft_ms:.0f}",
            f"{r.prompt_tokens:,}",
            f"{r.reused:,}",
            _decision(r),
            str(r.wrong_kv),
        )
    console.print(table)
    for r in verified:
        if r.turn in REWRITES:
            console.print(
                f"turn {r.turn} ({REWRITES[r.turn]}): {r.reused:,} of {r.prompt_tokens:,} prompt "
                f"tokens {_how(r)}: {r.survived}, unchanged by the rewrite; the rest recomputed",
                highlight=False,
            )
    console.print()
    compare = _table(
        f"the same {len(verified)} turns, three clients",
        "TTFT saved against no reuse, over the turns that read no wrong KV",
    )
    compare.add_column("client", no_wrap=True)
    for col in ("TTFT", "saved", "correct", "wrong KV"):
        compare.add_column(col, justify="right", no_wrap=True)
    baseline = {r.turn: r.ttft_ms for r in naive}
    base_total = sum(baseline.values())
    for name, rows in (
        ("agentkv (verified)", verified),
        ("no conversation id", naive),
        ("reuse without verification", unverified),
    ):
        wrong = sum(r.wrong_kv for r in rows)
        correct = f"{sum(1 for r in rows if not r.wrong_kv)} of {len(rows)}"
        saved = sum(baseline[r.turn] - r.ttft_ms for r in rows if not r.wrong_kv)
        share = f" ({saved / base_total:.0%})" if base_total else ""
        compare.add_row(
            name,
            f"{sum(r.ttft_ms for r in rows):.0f}",
            "-" if rows is naive else f"{saved:.0f}{share}",
            f"[red]{correct}[/]" if wrong else correct,
            f"[red]{wrong:,}[/]" if wrong else "0",
        )
    console.print(compare)
    bad = [r for r in unverified if r.wrong_kv]
    if bad:
        console.print(
            f"reuse without verification: turn{'s' if len(bad) > 1 else ''} {_turns(bad)} ran on"
            f" KV computed for other tokens ({sum(r.wrong_kv for r in bad):,} prompt tokens): "
            "faster, and wrong",
            highlight=False,
        )
    console.print()
    seen = {r.decision for rows in (verified, naive, unverified) for r in rows}
    legend = "; ".join(f"[bold]{d}[/] = {text}" for d, text in DECISIONS.items() if d in seen)
    console.print(f"decisions: {legend}. {FOOTER}")
