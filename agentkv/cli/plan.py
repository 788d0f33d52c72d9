"""`agentkv plan`: TTLs, threshold and retention policies from a trace."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from agentkv.cli._common import floats, print_rows

__all__ = ["plan"]


def _cost_model(costs: str | None, preset: str | None) -> tuple[Any, str]:
    from agentkv.sim.costmodel import PRESETS, load_cost_file

    if costs and preset:
        typer.echo("agentkv: give --costs or --preset, not both", err=True)
        raise typer.Exit(2)
    if costs:
        try:
            return load_cost_file(costs), f"cost file {costs}"
        except ValueError as exc:
            typer.echo(f"agentkv: {exc}", err=True)
            raise typer.Exit(2) from exc
    name = preset or "qwen3-32b-p5en"
    if name not in PRESETS:
        typer.echo(
            f"agentkv: unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}", err=True
        )
        raise typer.Exit(2)
    return PRESETS[name], f"preset {name}"


def plan(
    trace: Annotated[str, typer.Argument(help="Claude Code (.jsonl[.xz]), Mooncake or vLLM JSON.")],
    costs: Annotated[
        str | None,
        typer.Option(help="Cost file (from `agentkv calibrate`, or CostModel fields)."),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(help="Simulator cost preset [default: qwen3-32b-p5en]."),
    ] = None,
    sessions: Annotated[int | None, typer.Option(help="Use only the first N sessions.")] = None,
    block_size: Annotated[int, typer.Option(help="Engines' KV block size.")] = 16,
    ttl: Annotated[str | None, typer.Option(help="D TTLs to try (s), comma-separated.")] = None,
    threshold: Annotated[
        str | None,
        typer.Option(help="kv_recompute_threshold values to try, comma-separated."),
    ] = None,
    target: Annotated[
        float, typer.Option(help="Recommend the shortest TTL capturing this share of the best.")
    ] = 0.95,
    offload_gbps: Annotated[float, typer.Option(help="CPU tier read bandwidth (GB/s).")] = 25.0,
    offload_horizon: Annotated[
        float, typer.Option(help="How long a CPU tier keeps KV (s).")
    ] = 3600.0,
    epoch_rule: Annotated[
        bool,
        typer.Option(
            help="Model the router before reuse planner v2: a rewrite (new epoch) reads "
            "nothing back. Default: its verified prefix is read, as the router does."
        ),
    ] = False,
    trace_format: Annotated[
        str | None,
        typer.Option("--format", help="claude-code | mooncake | vllm-multi-turn [auto]."),
    ] = None,
    out: Annotated[str | None, typer.Option(help="Directory for plan.json and plan.png.")] = None,
    retention: Annotated[
        str | None,
        typer.Option(help="Retention policies to compare: fixed,oracle,lease,lease-sweep."),
    ] = None,
    retention_ttl: Annotated[
        str, typer.Option(help="Fixed TTLs (s) of the fixed policy, comma-separated.")
    ] = "60,450,900,1800",
    ui_idle_s: Annotated[
        float, typer.Option(help="Lease: a user wait's agent is dead after this long (s).")
    ] = 300.0,
    lease_s: Annotated[
        float, typer.Option(help="Lease: lapses this long after the agent dies (s).")
    ] = 30.0,
    max_hold_s: Annotated[
        float, typer.Option(help="Lease: D's TTL, the longest any hold lasts (s).")
    ] = 1800.0,
    json_out: Annotated[
        str | None,
        typer.Option("--json", help="Write the plan and the retention table to this file."),
    ] = None,
) -> None:
    """Recommend decoder_kv_blocks_ttl, the router TTL and kv_recompute_threshold from a trace's
    gaps and token profile, and say whether a CPU offload tier pays beyond the TTL;
    --retention compares KV retention policies (fixed TTLs, an oracle, a liveness lease)."""
    from pathlib import Path

    from agentkv.bench.plan import DEFAULT_TTLS, make_plan
    from agentkv.bench.retention import LeaseParams, retention_report
    from agentkv.bench.traces import TraceError, load_trace

    cost, source = _cost_model(costs, preset)
    fmt: Any = trace_format
    families = [x.strip() for x in (retention or "").split(",") if x.strip()]
    retained: list[Any] = []
    try:
        loaded = load_trace(trace, format=fmt, limit=sessions)
        if families:
            retained = retention_report(
                loaded,
                families,
                fixed_ttls=floats(retention_ttl, "--retention-ttl") or [],
                lease=LeaseParams(ui_idle_s, lease_s, max_hold_s),
                block_size=block_size,
                horizon_s=offload_horizon,
            )
        result = make_plan(
            loaded,
            cost,
            block_size=block_size,
            ttls=floats(ttl, "--ttl") or DEFAULT_TTLS,
            thresholds=[int(x) for x in floats(threshold, "--threshold") or []] or None,
            target=target,
            epoch_rule=epoch_rule,
            offload_horizon_s=offload_horizon,
            offload_gbps=offload_gbps,
        )
    except (TraceError, OSError, ValueError) as exc:
        typer.echo(f"agentkv plan: {exc}", err=True)
        raise typer.Exit(2) from exc
    header = [
        "D TTL s",
        "router TTL s",
        "threshold",
        "reuse captured",
        "turns expired",
        "lost to rewrites",
        "retained block-hours",
        "prefill s saved",
        "TTFT saved",
    ]
    rows = [header]
    for r in result.rows:
        if r.threshold != result.threshold:
            continue
        rows.append(
            [
                f"{r.ttl_s:g}",
                f"{r.router_ttl_s:g}",
                str(r.threshold),
                f"{r.captured_pct:.2f}%",
                str(r.turns_expired),
                f"{r.lost_to_rewrites_tokens:,}",
                f"{r.retained_block_s / 3600:,.1f}",
                f"{r.prefill_s_saved:,.1f}",
                f"{r.ttft_saved_pct:.1f}%",
            ]
        )
    st = result.stats
    print_rows(
        rows,
        f"agentkv plan: {st['sessions']} sessions, {st['turns']} turns, {source}",
    )
    chosen = result.row(result.ttl_s, result.threshold)
    by_threshold = [["threshold", "reuse captured", "lost to threshold", "TTFT saved"]]
    for r in result.rows:
        if r.ttl_s == result.ttl_s:
            by_threshold.append(
                [
                    str(r.threshold),
                    f"{r.captured_pct:.2f}%",
                    f"{r.lost_to_threshold_tokens:,}",
                    f"{r.ttft_saved_pct:.2f}%",
                ]
            )
    print_rows(by_threshold, f"at decoder_kv_blocks_ttl = {result.ttl_s:g} s")
    even = result.break_even_tokens
    typer.echo(
        f"recommend: decoder_kv_blocks_ttl = {result.ttl_s:g} (captures "
        f"{chosen.captured_pct:.1f}% of the reusable tokens, ≥ {target:.0%} of the best on the "
        f"grid); router TTL = {result.router_ttl_s:g} s (ttl_margin_s = "
        f"{result.ttl_s - result.router_ttl_s:g}); kv_recompute_threshold = {result.threshold} "
        + (
            f"(reading fewer tokens is slower than recomputing them with {source})"
            if even is not None
            else "(reading KV never beats recomputing with these costs)"
        )
    )
    off = result.offload
    typer.echo(
        f"CPU offload tier beyond the TTL: {'pays' if off.pays else 'does not pay'} — {off.reason} "
        f"({off.turns} turns, {off.tokens:,} tokens, {off.ttft_s_saved:,.1f} s of TTFT saved, "
        f"{off.gib_hours:,.1f} GiB-hours of CPU memory)"
    )
    if retained:
        _print_retention(retained)
    data = result.to_dict()
    data["costs"] = {"source": source, **cost.model_dump()}
    if families:
        from agentkv.bench.retention import ASSUMPTIONS, wait_stats

        data["retention"] = [r.to_dict() for r in retained]
        data["retention_assumptions"] = ASSUMPTIONS
        data["retention_waits"] = wait_stats(loaded, block_size)
    if json_out:
        from agentkv.bench.report import write_json

        write_json(Path(json_out), data)
        typer.echo(f"wrote {json_out}")
    if out:
        from agentkv.bench import plots
        from agentkv.bench.report import write_json

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "plan.json", data)
        plots.plot_tradeoff(
            [r.to_dict() for r in result.rows],
            folder / "plan.png",
            title=f"{Path(trace).parent.name}/{Path(trace).name}: reuse against retained KV "
            f"({source})",
        )
        typer.echo(f"wrote {folder / 'plan.json'} and {folder / 'plan.png'}")


def _print_retention(rows: list[Any]) -> None:
    """`agentkv plan --retention`: one line per policy, then the sweep's best lease."""
    from agentkv.bench.retention import best_lease, sweep_grid

    table = [["policy", "reusable lost", "block-seconds", "vs fixed-450", "lost ≤ horizon"]]
    for r in (r for r in rows if not r.policy.startswith("lease-ui")):
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
