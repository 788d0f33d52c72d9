"""`agentkv plan`: TTLs, threshold and retention policies from a trace."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from agentkv.cli._common import BlockSize, Trace, TraceFormat, floats, print_rows

__all__ = ["plan"]


# Help texts too long to share their option's line.
_COSTS = "Cost file (from `agentkv calibrate`, or CostModel fields)."
_PRESET = "Simulator cost preset [default: qwen3-32b-p5en]."
_THRESHOLD = "kv_recompute_threshold values to try, comma-separated."
_TARGET = "Recommend the shortest TTL capturing this share of the best."
_OFFLOAD_HORIZON = "How long a CPU tier keeps KV (s)."
_RETENTION = "Retention policies to compare: fixed,oracle,lease,lease-sweep."
_RETENTION_TTL = "Fixed TTLs (s) of the fixed policy, comma-separated."
_UI_IDLE_S = "Lease: a user wait's agent is dead after this long (s)."
_LEASE_S = "Lease: lapses this long after the agent dies (s)."
_MAX_HOLD_S = "Lease: D's TTL, the longest any hold lasts (s)."
_JSON_OUT = "Write the plan and the retention table to this file."
_CPU_TIER = (
    "Retention: put D's CPU tier behind the fixed and lease policies, at each of these "
    "capacities (blocks, comma-separated)."
)
_CPU_FAIL = "CPU tier: share of block stores that fail (offload is best effort)."
_CONCURRENCY = "CPU tier: sessions in flight on D at once (one starts when one ends)."
_CPU_NEW = "CPU tier: most new tokens D prefills after a load, else P recomputes (0: no limit)."


def plan(
    trace: Trace,
    costs: Annotated[str | None, typer.Option(help=_COSTS)] = None,
    preset: Annotated[str | None, typer.Option(help=_PRESET)] = None,
    sessions: Annotated[int | None, typer.Option(help="Use only the first N sessions.")] = None,
    block_size: BlockSize = 16,
    ttl: Annotated[str | None, typer.Option(help="D TTLs to try (s), comma-separated.")] = None,
    threshold: Annotated[str | None, typer.Option(help=_THRESHOLD)] = None,
    target: Annotated[float, typer.Option(help=_TARGET)] = 0.95,
    offload_gbps: Annotated[float, typer.Option(help="CPU tier read bandwidth (GB/s).")] = 25.0,
    offload_horizon: Annotated[float, typer.Option(help=_OFFLOAD_HORIZON)] = 3600.0,
    epoch_rule: Annotated[
        bool,
        typer.Option(
            help="Plan as if a rewritten history (a summary, stripped reasoning) read nothing "
            "back, as a router that drops the handle on every rewrite would. Default: the "
            "part the rewrite left unchanged is read back, as agentkv's router does."
        ),
    ] = False,
    trace_format: TraceFormat = None,
    out: Annotated[str | None, typer.Option(help="Directory for plan.json and plan.png.")] = None,
    retention: Annotated[str | None, typer.Option(help=_RETENTION)] = None,
    retention_ttl: Annotated[str, typer.Option(help=_RETENTION_TTL)] = "60,450,900,1800",
    ui_idle_s: Annotated[float, typer.Option(help=_UI_IDLE_S)] = 300.0,
    lease_s: Annotated[float, typer.Option(help=_LEASE_S)] = 30.0,
    max_hold_s: Annotated[float, typer.Option(help=_MAX_HOLD_S)] = 1800.0,
    json_out: Annotated[str | None, typer.Option("--json", help=_JSON_OUT)] = None,
    cpu_tier_blocks: Annotated[str | None, typer.Option(help=_CPU_TIER)] = None,
    cpu_save_failure_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help=_CPU_FAIL)] = 0.0,
    concurrency: Annotated[int, typer.Option(min=1, help=_CONCURRENCY)] = 8,
    cpu_max_new_tokens: Annotated[int, typer.Option(min=0, help=_CPU_NEW)] = 2048,
) -> None:
    """Recommend decoder_kv_blocks_ttl, the router TTL and kv_recompute_threshold from a trace's
    gaps and token profile, and say whether a CPU offload tier pays beyond the TTL;
    --retention compares KV retention policies (fixed TTLs, an oracle, a liveness lease), with
    D's CPU tier behind them (--cpu-tier-blocks)."""
    from agentkv.bench.plan_report import cost_model, plan_trace, write_plan
    from agentkv.bench.traces import TraceError

    tiers = [int(x) for x in floats(cpu_tier_blocks, "--cpu-tier-blocks") or []]
    if tiers and (not retention or min(tiers) < 1):
        typer.echo("agentkv plan: --cpu-tier-blocks needs --retention and capacities ≥ 1", err=True)
        raise typer.Exit(2)

    try:
        cost, source = cost_model(costs, preset)
    except ValueError as exc:
        typer.echo(f"agentkv: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        report = plan_trace(
            trace,
            cost,
            source,
            trace_format=trace_format,
            sessions=sessions,
            block_size=block_size,
            ttls=floats(ttl, "--ttl"),
            thresholds=[int(x) for x in floats(threshold, "--threshold") or []],
            target=target,
            epoch_rule=epoch_rule,
            offload_horizon_s=offload_horizon,
            offload_gbps=offload_gbps,
            retention=[x.strip() for x in (retention or "").split(",") if x.strip()],
            retention_ttls=floats(retention_ttl, "--retention-ttl") or [],
            lease=(ui_idle_s, lease_s, max_hold_s),
            cpu_tiers=tiers,
            cpu_save_failure_rate=cpu_save_failure_rate,
            concurrency=concurrency,
            cpu_max_new_tokens=cpu_max_new_tokens,
        )
    except (TraceError, OSError, ValueError) as exc:
        typer.echo(f"agentkv plan: {exc}", err=True)
        raise typer.Exit(2) from exc
    print_rows(report.ttl_rows(), report.title())
    print_rows(report.threshold_rows(), f"at decoder_kv_blocks_ttl = {report.plan.ttl_s:g} s")
    typer.echo(report.recommendation())
    typer.echo(report.offload_line())
    if report.retention:
        _print_retention(report.retention)
    if report.cpu_tiers:
        _print_cpu_tiers(report.retention, report.cpu_tiers)
    for written in write_plan(report, trace, json_out=json_out, out=out):
        typer.echo(f"wrote {written}")


def _print_retention(rows: list[Any]) -> None:
    """`agentkv plan --retention`: one line per policy, then the sweep's best lease."""
    from agentkv.bench.retention import best_lease, sweep_grid

    table = [["policy", "reusable lost", "block-seconds", "vs fixed-450", "lost ≤ horizon"]]
    for r in (r for r in rows if not r.policy.startswith("lease-ui") and not r.cpu_tier_blocks):
        table.append(
            [
                r.policy,
                f"{100 * r.lost_fraction:.2f}%",
                f"{r.block_seconds:,.0f}",
                f"{r.block_seconds_vs_fixed_450:.2f}",
                f"{100 * r.cpu_tier_fraction:.2f}%",
            ]
        )
    print_rows(table, "retention: reusable tokens lost against D's block-seconds")
    grid = sweep_grid(rows)
    if grid:
        print_rows(grid, "lease sweep: reusable lost / block-seconds vs fixed-450")
    best = best_lease(rows)
    if best is not None:
        typer.echo(
            f"best lease within fixed-450's block-seconds: {best.policy} loses "
            f"{100 * best.lost_fraction:.2f}% at {best.block_seconds_vs_fixed_450:.2f}x"
        )


def _print_cpu_tiers(rows: list[Any], tiers: list[dict[str, Any]]) -> None:
    """`--cpu-tier-blocks`: each tier's run, the policies with it, the best within fixed-450's
    GPU block-seconds and the retention goal."""
    from agentkv.bench.cpu_tier import GOAL_LOST, best_with_cpu

    head = ["CPU tier blocks", "GiB", "clock h", "mean CPU blocks", "stored", "failed", "evicted"]
    runs = [head]
    for t in tiers:
        runs.append(
            [
                f"{t['cpu_tier_blocks']:,}",
                f"{t['cpu_tier_gib']:,.0f}",
                f"{t['clock_hours']:,.1f}",
                f"{t['mean_cpu_blocks']:,.0f}",
                f"{t['stored_blocks']:,}",
                f"{t['failed_blocks']:,}",
                f"{t['evicted_blocks']:,}",
            ]
        )
    first = tiers[0]
    print_rows(
        runs,
        f"D's CPU tier: {first['concurrency']} sessions in flight, "
        f"{100 * first['cpu_save_failure_rate']:g}% of stores failing "
        f"(fixed-450 holds {first['mean_gpu_blocks_fixed_450']:,.0f} GPU blocks on average)",
    )
    table = [
        [
            "policy",
            "CPU blocks",
            "reusable lost",
            "GPU vs fixed-450",
            "CPU vs fixed-450",
            "CPU loads",
            "tokens loaded",
            "load s",
            "ms a load",
            "prefill s saved",
            "over D's budget",
        ]
    ]
    for r in (r for r in rows if r.cpu_tier_blocks and not r.policy.startswith("lease-ui")):
        table.append(
            [
                r.policy.split("+")[0],
                f"{r.cpu_tier_blocks:,}",
                f"{100 * r.lost_fraction:.2f}%",
                f"{r.block_seconds_vs_fixed_450:.2f}",
                f"{r.cpu_occupancy_vs_fixed_450:.2f}",
                f"{r.cpu_loads:,}",
                f"{r.cpu_loaded_tokens:,}",
                f"{r.cpu_load_s:,.1f}",
                f"{1000 * r.cpu_load_s / r.cpu_loads if r.cpu_loads else 0:.0f}",
                f"{r.cpu_prefill_s_saved:,.1f}",
                f"{100 * r.cpu_over_budget_tokens / max(1, r.reusable_tokens):.2f}%",
            ]
        )
    print_rows(table, "retention with D's CPU tier: reusable lost, GPU and CPU block-seconds")
    for t in tiers:
        best = best_with_cpu(rows, t["cpu_tier_blocks"])
        if best is not None:
            typer.echo(
                f"best within fixed-450's GPU block-seconds with {t['cpu_tier_blocks']:,} CPU "
                f"blocks: {best.policy} loses {100 * best.lost_fraction:.2f}% at "
                f"{best.block_seconds_vs_fixed_450:.2f}x"
            )
    meets = [r for r in rows if r.lost_fraction <= GOAL_LOST and r.block_seconds_vs_fixed_450 <= 1]
    goal = f"retention goal (≤ {100 * GOAL_LOST:g}% lost within fixed-450's GPU block-seconds)"
    if meets:
        r = min(meets, key=lambda r: (r.cpu_tier_blocks, r.lost_fraction))
        typer.echo(
            f"{goal}: met by {r.policy} ({100 * r.lost_fraction:.2f}% at "
            f"{r.block_seconds_vs_fixed_450:.2f}x, {r.cpu_tier_blocks:,} CPU blocks)"
        )
    else:
        typer.echo(f"{goal}: not met by any policy and CPU tier modelled")
