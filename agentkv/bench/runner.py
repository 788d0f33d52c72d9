"""``agentkv bench replay``: pick sessions, script them, run each policy, write the report."""

from __future__ import annotations

import asyncio
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agentkv.bench.content import script_session
from agentkv.bench.deploy import Stack
from agentkv.bench.replay import replay_policy, wait_drained
from agentkv.bench.replay_metrics import engine_counters, measured_delta
from agentkv.bench.replay_records import (
    POLICIES,
    Policy,
    ReplaySettings,
    SessionScript,
    TurnRecord,
)
from agentkv.bench.report import (
    SHORTFALL_NOTE,
    PolicySummary,
    policy_name,
    shortfall_cause,
    shortfall_rows,
    summarize,
    write_csv,
    write_json,
)
from agentkv.bench.retention import LeaseParams
from agentkv.bench.traces import Session, TraceFormat, detect_format, iter_claude_code, load_trace
from agentkv.bench.wire import ClientName

__all__ = [
    "PolicyTarget",
    "ReplayOutcome",
    "ReplayRun",
    "lease_router_options",
    "render_markdown",
    "run",
    "select_sessions",
    "stack_settings",
    "stack_target",
]


async def _counters(run: PolicyTarget) -> dict[str, float]:
    return await engine_counters(run.engine_urls, run.decode_urls)


@dataclass(frozen=True)
class PolicyTarget:
    """A policy that runs on a deployment of its own (``lease``: D with a long TTL)."""

    url: str
    settings: ReplaySettings
    decode_urls: tuple[str, ...] = ()
    engine_urls: tuple[str, ...] = ()
    drain_timeout_s: float = 0.0


@dataclass
class ReplayRun:
    """Everything one ``bench replay`` needs besides the sessions."""

    targets: dict[Policy, str]
    """Router base URL (``…/v1``) per policy, in the order to run them."""
    settings: ReplaySettings
    decode_urls: tuple[str, ...] = ()
    """Decode instances to scrape (simulator counters) and to wait for between policies."""
    engine_urls: tuple[str, ...] = ()
    drain_timeout_s: float = 0.0
    setup: dict[str, Any] = field(default_factory=dict)
    """Described in the report (profile, TTLs, preset, …)."""
    own: dict[Policy, PolicyTarget] = field(default_factory=dict)
    """Policies on deployments of their own, run after ``targets``."""

    def plan(self) -> list[tuple[Policy, PolicyTarget]]:
        """Every policy to run, in order, with where and how."""
        shared = [
            (
                policy,
                PolicyTarget(
                    url, self.settings, self.decode_urls, self.engine_urls, self.drain_timeout_s
                ),
            )
            for policy, url in self.targets.items()
            if policy not in self.own
        ]
        return shared + list(self.own.items())


@dataclass
class ReplayOutcome:
    records: list[TurnRecord]
    summaries: dict[str, PolicySummary]
    meta: dict[str, Any]
    files: list[Path]


def stack_settings(
    stack: Stack,
    *,
    concurrency: int = 8,
    honor_starts: bool = False,
    lease: LeaseParams | None = None,
    client: ClientName = "sdk",
) -> ReplaySettings:
    """How to replay on a deployment from :func:`~agentkv.bench.deploy.local_stack` (a raw
    client's token identity outlives D's KV: a longer gap must still land beyond it)."""
    identity = stack.identity_ttl_real_s if client != "sdk" else 0.0
    return ReplaySettings(
        model=stack.model,
        block_size=stack.block_size,
        time_scale=stack.time_scale,
        router_ttl_s=stack.router_ttl_s,
        decoder_ttl_s=stack.decoder_ttl_s,
        gap_cap_real_s=max(stack.decoder_ttl_real_s, identity) + 1,
        concurrency=concurrency,
        honor_starts=honor_starts,
        lease=lease,
        client=client,
    )


def lease_router_options(lease: LeaseParams, time_scale: float) -> dict[str, Any]:
    """Router keys for a lease deployment on a compressed clock: lapsed leases are looked for
    six times per (real) lease, so a lapse is noticed within a sixth of it."""
    interval = max(0.02, min(0.5, lease.lease_s * time_scale / 6))
    return {"retention": {"lease_check_interval_s": interval}}


def stack_target(stack: Stack, settings: ReplaySettings) -> PolicyTarget:
    """A policy that runs on ``stack`` of its own, drained within D's TTL after the run."""
    return PolicyTarget(
        stack.base_url,
        settings,
        stack.decode_urls,
        stack.engine_urls,
        drain_timeout_s=stack.decoder_ttl_real_s + 5,
    )


def select_sessions(
    sessions: Iterable[Session],
    *,
    count: int | None,
    token_scale: float,
    max_turns: int | None,
    max_context: int | None,
    min_turns: int = 2,
    skip: int = 0,
) -> list[Session]:
    """The first ``count`` sessions (after ``skip``) with at least ``min_turns`` turns whose
    prompts, cut to ``max_turns`` and scaled, stay within ``max_context`` tokens."""
    out: list[Session] = []
    seen = 0
    for session in sessions:
        if count is not None and len(out) >= count:
            break
        cut = session.truncated(max_turns) if max_turns else session
        if len(cut.turns) < min_turns:
            continue
        scale = token_scale if cut.block_size else 1.0
        if max_context is not None and cut.max_input_tokens * scale > max_context:
            continue
        seen += 1
        if seen <= skip:
            continue
        out.append(cut)
    return out


def load_sessions(
    path: str | Path, fmt: TraceFormat | None, *, include_subagents: bool = False
) -> Iterable[Session]:
    """Sessions of a trace, streamed for Claude Code files (441 MB uncompressed)."""
    fmt = fmt or detect_format(path)
    if fmt == "claude-code":
        return iter_claude_code(path, include_subagents=include_subagents)
    return load_trace(path, format=fmt)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with_cpuinfo = Path("/proc/cpuinfo")
    if with_cpuinfo.exists():
        for line in with_cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} × {cpu}, Python {platform.python_version()}"


async def _run_all(
    scripts: Sequence[SessionScript], run: ReplayRun, progress: bool
) -> tuple[list[TurnRecord], dict[str, dict[str, float]]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    total = sum(len(s.turns) for s in scripts)
    records: list[TurnRecord] = []
    measured: dict[str, dict[str, float]] = {}
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not progress,
        transient=False,
    )
    plan = run.plan()
    with bar:
        tasks = {p: bar.add_task(policy_name(p), total=total) for p, _ in plan}
        for policy, target in plan:
            before = await _counters(target) if target.decode_urls else {}
            task = tasks[policy]

            def advance(_r: TurnRecord, task: Any = task) -> None:
                bar.advance(task)

            done = await replay_policy(
                scripts, target.url, policy, target.settings, on_turn=advance
            )
            records += done.records
            if target.decode_urls:
                drained = await wait_drained(target.decode_urls, target.drain_timeout_s)
                gone = time.perf_counter() - (done.last_death or time.perf_counter())
                after = await _counters(target)
                measured[policy] = measured_delta(before, after)
                measured[policy]["drained"] = float(drained)
                if done.last_death is not None:
                    # how long D kept blocks after the last agent died (its renewals stopped)
                    measured[policy]["freed_after_last_death_s"] = gone
    return records, measured


def run(
    sessions: Sequence[Session],
    run: ReplayRun,
    *,
    token_scale: float,
    out_dir: Path | None,
    plots: bool = True,
    progress: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> ReplayOutcome:
    """Replay ``sessions`` under each policy of ``run`` and write the report into ``out_dir``."""
    scripts = [
        SessionScript(
            s.id,
            script_session(s, token_scale=token_scale),
            s.start_s,
            s.meta.get("next_gap_s"),
        )
        for s in sessions
    ]
    started = datetime.now(timezone.utc)
    records, measured = asyncio.run(_run_all(scripts, run, progress))
    for rec in records:
        rec.shortfall_cause = shortfall_cause(rec)
    summaries = summarize(records, measured)
    info: dict[str, Any] = {
        "command": "agentkv " + shlex.join(sys.argv[1:]) if sys.argv else "",
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "sessions": [s.id for s in sessions],
        "turns": sum(len(s.turns) for s in scripts),
        "token_scale": token_scale,
        "settings": asdict(run.settings),
        "setup": run.setup,
        **(meta or {}),
    }
    files: list[Path] = []
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "turns.json", [r.to_dict() for r in records])
        write_csv(out_dir / "turns.csv", records)
        write_json(
            out_dir / "summary.json",
            {"meta": info, "policies": {p: s.to_dict() for p, s in summaries.items()}},
        )
        files += [out_dir / "turns.json", out_dir / "turns.csv", out_dir / "summary.json"]
        images: list[Path] = []
        if plots:
            from agentkv.bench import plots as figures

            images = [
                figures.plot_ttft_by_context(records, out_dir / "ttft_by_context.png"),
                figures.plot_reuse_fraction(summaries, out_dir / "reuse_fraction.png"),
                figures.plot_retention(summaries, out_dir / "retained_block_seconds.png"),
            ]
            files += images
        report = out_dir / "report.md"
        report.write_text(render_markdown(info, summaries, [p.name for p in images]))
        files.append(report)
    return ReplayOutcome(records, summaries, info, files)


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}{suffix}"


def _in_order(summaries: Mapping[str, PolicySummary]) -> list[tuple[str, PolicySummary]]:
    """The policies that were run, in the report's order."""
    return [(policy, summaries[policy]) for policy in POLICIES if policy in summaries]


_Cell = Callable[[str, PolicySummary], str]
_SUMMARY_COLUMNS: tuple[tuple[str, _Cell], ...] = (
    ("policy", lambda policy, s: policy_name(policy)),
    ("turns", lambda policy, s: f"{s.turns}" + (f" ({s.errors} failed)" if s.errors else "")),
    ("ideal reusable tokens", lambda policy, s: f"{s.ideal_tokens:,}"),
    (
        "read back correctly",
        lambda policy, s: f"{s.useful_reused_tokens:,} ({_fmt(s.captured_pct, 2, '%')})",
    ),
    (
        "reusable lost (any gap)",
        lambda policy, s: "–" if policy == "none" else _fmt(s.lost_pct, 2, "%"),
    ),
    ("wrong-KV tokens (turns)", lambda policy, s: f"{s.wrong_kv_tokens:,} ({s.wrong_kv_turns})"),
    ("prefill tokens recomputed", lambda policy, s: f"{s.recomputed_tokens:,}"),
    ("compute saved", lambda policy, s: _fmt(s.compute_saved_pct, 1, "%")),
    ("TTFT p50 / p90 ms", lambda policy, s: _ttft_cell(s)),
    (
        "D ITL p50 / p90 / p99 ms",
        lambda policy, s: " / ".join(
            _fmt(s.measured.get(f"d_itl_p{q}_ms"), 2) for q in (50, 90, 99)
        ),
    ),
    (
        "TTFT saved / turn",
        lambda policy, s: (
            "–"
            if s.latency_saved_ms is None
            else f"{s.latency_saved_ms:,.1f} ms ({_fmt(s.ttft_saved_pct, 1, '%')})"
        ),
    ),
    ("expired", lambda policy, s: str(s.expired)),
    ("retained block-hours", lambda policy, s: _fmt(s.retained_block_s / 3600, 2)),
)
"""The summary table's columns: each header with how a policy's cell reads."""


def _ttft_cell(s: PolicySummary) -> str:
    d = s.to_dict()
    return f"{_fmt(d['model_ttft_p50_ms'], 1)} / {_fmt(d['model_ttft_p90_ms'], 1)}"


def summary_rows(summaries: Mapping[str, PolicySummary]) -> list[list[str]]:
    """The terminal and markdown summary table (header first)."""
    rows = [[header for header, _ in _SUMMARY_COLUMNS]]
    for policy, s in _in_order(summaries):
        rows.append([cell(policy, s) for _, cell in _SUMMARY_COLUMNS])
    return rows


def _md_table(rows: Sequence[Sequence[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def kind_rows(summaries: Mapping[str, PolicySummary]) -> list[list[str]]:
    rows = [
        [
            "policy",
            "turn kind",
            "turns (within TTL)",
            "ideal reusable",
            "read back correctly",
            "wrong-KV tokens (turns)",
        ]
    ]
    for policy, s in _in_order(summaries):
        for kind in ("append", "strip", "rewrite"):
            k = s.by_kind.get(kind)
            if k is None:
                continue
            rows.append(
                [
                    policy_name(policy),
                    kind,
                    f"{k.turns} ({k.turns_within_ttl})",
                    f"{k.ideal_tokens:,}",
                    f"{k.useful_reused_tokens:,} ({_fmt(k.captured_pct, 2, '%')})",
                    f"{k.wrong_kv_tokens:,} ({k.wrong_kv_turns})",
                ]
            )
    return rows


def shortfall_lines(summaries: Mapping[str, PolicySummary]) -> list[str]:
    """The report's shortfall section (:func:`~agentkv.bench.report.shortfall_rows`)."""
    rows = shortfall_rows(dict(_in_order(summaries)))
    return ["## Shortfall by cause", "", _md_table(rows), "", SHORTFALL_NOTE, ""] if rows else []


def render_markdown(
    meta: Mapping[str, Any], summaries: Mapping[str, PolicySummary], images: Sequence[str]
) -> str:
    """The report's markdown body (the figures are referenced by file name)."""
    settings = meta.get("settings", {})
    setup = meta.get("setup", {})
    lines = [
        "# Trace replay",
        "",
        f"`{meta.get('command', '')}` — {meta.get('date', '')}, {meta.get('machine', '')}.",
        "",
        f"- trace: `{meta.get('trace', '')}` ({meta.get('format', '')}), "
        f"{len(meta.get('sessions', []))} sessions, {meta.get('turns', 0)} turns per policy; "
        f"{meta.get('selection', '')}",
        f"- token counts × {meta.get('token_scale')}; gaps × {settings.get('time_scale')} "
        f"(gaps longer than {_fmt(settings.get('gap_cap_real_s'), 1)} s real shortened to that: "
        "the handle, and a raw client's token identity, has expired either way); at most "
        f"{settings.get('concurrency')} sessions at once",
        f"- router TTL {_fmt(settings.get('router_ttl_s'), 0)} s and D TTL "
        f"{_fmt(settings.get('decoder_ttl_s'), 0)} s in trace time"
        + (
            f" (real: {_fmt(setup.get('router_ttl_real_s'), 2)} s and "
            f"{_fmt(setup.get('decoder_ttl_real_s'), 0)} s)"
            if setup.get("decoder_ttl_real_s")
            else ""
        ),
    ]
    for key, value in setup.items():
        if key not in ("router_ttl_real_s", "decoder_ttl_real_s"):
            lines.append(f"- {key.replace('_', ' ')}: {value}")
    lines += ["", "## Summary", "", _md_table(summary_rows(summaries)), ""]
    lines += [
        "*Ideal reusable*: for turns whose trace gap is within the router's TTL, the prompt "
        "tokens D held from the previous turn that a verifying router could let prefill read "
        "back (all it held when the prompt repeats all of it, else the common prefix in whole "
        "blocks). *Read back correctly*: prompt tokens prefill did not compute, less those that "
        "ran on KV of other tokens (the simulator's wrong-KV count), capped at the ideal. "
        "*Reusable lost*: the reusable tokens of every turn, whatever its gap, that were not "
        "read back correctly (what retention and verification lost; with leases the ideal "
        "also needs the agent alive). "
        "*Compute saved*: prompt tokens prefill did not compute, of all prompt tokens. *TTFT*: "
        "the simulator's cost model (`X-AgentKV-Sim-Model-TTFT-Ms`: modelled costs, a prefill "
        "queued behind the engine's earlier ones when they overlap); *saved* is against the "
        "baseline on the same turns. *D ITL*: the modelled time of D's decode steps after each "
        "request's first token, prefill interference included, over this run's steps (D's "
        "`agentkv_sim_model_inter_token_seconds`). *Retained "
        "block-hours*: blocks D holds between turns × how long, modelled at full speed from the "
        "trace's gaps (until the next turn, or D's TTL when it comes too late or never; with "
        "leases until the lease lapses after the agent died).",
        "",
        "## By turn kind",
        "",
        _md_table(kind_rows(summaries)),
        "",
    ]
    lines += shortfall_lines(summaries)
    measured = {p: s.measured for p, s in summaries.items() if s.measured}
    if measured:
        lines += [
            "## Simulator counters (this run, real seconds)",
            "",
            "Read from the engines' `/metrics` before and after each policy (after D freed "
            "everything it retained). D's block-seconds are on the compressed clock; every "
            "session ends without `close()`, so D's timer (or, with leases, the lapsed lease) "
            "frees its last blocks. *Freed after the last agent died*: real seconds from the "
            "last agent's death (its lease renewals stopped) until D held no block.",
            "",
            "| policy | D retained block-seconds | wrong-KV tokens on P | wrong-KV tokens on D "
            "| handles expired on D | D decode steps slowed by a prefill (of all) "
            "| freed after the last agent died |",
            "|---|---|---|---|---|---|---|",
        ]
        for p, m in measured.items():
            freed = m.get("freed_after_last_death_s")
            lines.append(
                f"| {policy_name(p)} | {m.get('retained_block_s_decode', 0):,.1f} | "
                f"{m.get('wrong_kv_tokens_prefill', 0):,.0f} | "
                f"{m.get('wrong_kv_tokens_decode', 0):,.0f} | {m.get('expired_decode', 0):,.0f} | "
                f"{m.get('slowed_steps_decode', 0):,.0f} ({m.get('d_itl_steps', 0):,.0f}) | "
                + ("–" if freed is None else f"{freed:.1f} s")
                + " |"
            )
        lines.append("")
    if images:
        lines += ["## Figures", ""]
        lines += [f"![{name}]({name})" for name in images]
        lines.append("")
    return "\n".join(lines) + "\n"
