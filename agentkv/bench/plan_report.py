"""``agentkv plan`` end to end: the cost model, the trace, the plan (:mod:`agentkv.bench.plan`),
the retention comparison (:mod:`agentkv.bench.retention`), their tables, the recommendation in
words and the files written. The command only parses options and prints what this returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv.bench.plan import DEFAULT_TTLS, TtlThresholdPlan, make_plan
from agentkv.sim.costmodel import CostModel

__all__ = ["PlanReport", "cost_model", "plan_trace", "write_plan"]

DEFAULT_PRESET = "qwen3-32b-p5en"


def cost_model(costs: str | None, preset: str | None) -> tuple[CostModel, str]:
    """A cost file or a preset (``qwen3-32b-p5en`` when neither), and how to name it; ValueError
    when both are given, the file is bad or the preset unknown."""
    from agentkv.sim.costmodel import PRESETS, load_cost_file

    if costs and preset:
        raise ValueError("give --costs or --preset, not both")
    if costs:
        return load_cost_file(costs), f"cost file {costs}"
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name], f"preset {name}"


@dataclass
class PlanReport:
    plan: TtlThresholdPlan
    source: str
    """The cost model's name (``preset …`` or ``cost file …``)."""
    retention: list[Any] = field(default_factory=list)
    """:func:`agentkv.bench.retention.retention_report`'s rows, when policies were asked for."""
    data: dict[str, Any] = field(default_factory=dict)
    """What ``plan.json`` / ``--json`` holds."""
    cpu_tiers: list[dict[str, Any]] = field(default_factory=list)
    """Each CPU tier's run (``retention_cpu_tiers``), when capacities were asked for."""

    def title(self) -> str:
        st = self.plan.stats
        return f"agentkv plan: {st['sessions']} sessions, {st['turns']} turns, {self.source}"

    def ttl_rows(self) -> list[list[str]]:
        """One row per D TTL at the recommended threshold (the first row: the header)."""
        rows = [
            [
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
        ]
        for r in self.plan.rows:
            if r.threshold == self.plan.threshold:
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
        return rows

    def threshold_rows(self) -> list[list[str]]:
        """One row per threshold at the recommended TTL (the first row: the header)."""
        rows = [["threshold", "reuse captured", "lost to threshold", "TTFT saved"]]
        for r in self.plan.rows:
            if r.ttl_s == self.plan.ttl_s:
                rows.append(
                    [
                        str(r.threshold),
                        f"{r.captured_pct:.2f}%",
                        f"{r.lost_to_threshold_tokens:,}",
                        f"{r.ttft_saved_pct:.2f}%",
                    ]
                )
        return rows

    def recommendation(self) -> str:
        p = self.plan
        chosen = p.row(p.ttl_s, p.threshold)
        return (
            f"recommend: decoder_kv_blocks_ttl = {p.ttl_s:g} (captures "
            f"{chosen.captured_pct:.1f}% of the reusable tokens, ≥ {p.target:.0%} of the best on "
            f"the grid); router TTL = {p.router_ttl_s:g} s (retention.ttl_margin_s = "
            f"{p.ttl_s - p.router_ttl_s:g}); kv_recompute_threshold = {p.threshold} "
            + (
                f"(reading fewer tokens is slower than recomputing them with {self.source})"
                if p.break_even_tokens is not None
                else "(reading KV never beats recomputing with these costs)"
            )
        )

    def offload_line(self) -> str:
        off = self.plan.offload
        return (
            f"CPU offload tier beyond the TTL: {'pays' if off.pays else 'does not pay'} — "
            f"{off.reason} ({off.turns} turns, {off.tokens:,} tokens, {off.ttft_s_saved:,.1f} s "
            f"of TTFT saved, {off.gib_hours:,.1f} GiB-hours of CPU memory)"
        )


def plan_trace(
    trace: str,
    cost: CostModel,
    source: str,
    *,
    trace_format: Any = None,
    sessions: int | None = None,
    block_size: int = 16,
    ttls: Sequence[float] | None = None,
    thresholds: Sequence[int] | None = None,
    target: float = 0.95,
    epoch_rule: bool = False,
    offload_horizon_s: float = 3600.0,
    offload_gbps: float = 25.0,
    retention: Sequence[str] = (),
    retention_ttls: Sequence[float] = (),
    lease: tuple[float, float, float] = (300.0, 30.0, 1800.0),
    cpu_tiers: Sequence[int] = (),
    cpu_save_failure_rate: float = 0.0,
    concurrency: int = 8,
    cpu_max_new_tokens: int = 2048,
) -> PlanReport:
    """Load the trace and plan it; ``retention`` names the policy families to compare
    (``lease``: ``(ui_idle_s, lease_s, max_hold_s)``), ``cpu_tiers`` the capacities (blocks) of
    D's CPU tier to put behind its fixed and lease policies (:mod:`agentkv.bench.cpu_tier`).
    Raises TraceError, OSError, ValueError."""
    from agentkv.bench.retention import (
        ASSUMPTIONS,
        LeaseParams,
        retention_report,
        wait_stats,
    )
    from agentkv.bench.traces import load_trace

    loaded = load_trace(trace, format=trace_format, limit=sessions)
    retained: list[Any] = []
    if retention:
        retained = retention_report(
            loaded,
            list(retention),
            fixed_ttls=list(retention_ttls),
            lease=LeaseParams(*lease),
            block_size=block_size,
            horizon_s=offload_horizon_s,
        )
    tiers: list[dict[str, Any]] = []
    if retention and cpu_tiers:
        from agentkv.bench.cpu_tier import CpuTierSpec, cpu_tier_table, load_s_per_token

        specs = [CpuTierSpec(c, cpu_save_failure_rate, concurrency) for c in cpu_tiers]
        with_cpu, runs = cpu_tier_table(
            loaded,
            list(retention),
            specs,
            cost=cost,
            fixed_ttls=list(retention_ttls),
            lease=LeaseParams(*lease),
            block_size=block_size,
            horizon_s=offload_horizon_s,
            max_new_tokens=cpu_max_new_tokens,
        )
        retained += with_cpu
        gib = cost.kv_bytes_per_token * block_size / 2**30
        fixed_450 = _fixed_450_block_s(loaded, block_size)
        tiers = [
            {
                "cpu_tier_blocks": run.spec.capacity_blocks,
                "cpu_tier_gib": run.spec.capacity_blocks * gib,
                "cpu_save_failure_rate": run.spec.failure_rate,
                "concurrency": run.spec.concurrency,
                "cpu_max_new_tokens": cpu_max_new_tokens,
                "load_s_per_token": load_s_per_token(cost),
                "clock_hours": run.duration_s / 3600,
                "mean_cpu_blocks": run.occupancy_block_s / run.duration_s if run.duration_s else 0,
                "mean_gpu_blocks_fixed_450": fixed_450 / run.duration_s if run.duration_s else 0,
                "stored_blocks": run.stored,
                "failed_blocks": run.failed,
                "evicted_blocks": run.evicted,
                "unstored_blocks": run.unstored,
            }
            for run in runs
        ]
    result = make_plan(
        loaded,
        cost,
        block_size=block_size,
        ttls=list(ttls or DEFAULT_TTLS),
        thresholds=list(thresholds) if thresholds else None,
        target=target,
        epoch_rule=epoch_rule,
        offload_horizon_s=offload_horizon_s,
        offload_gbps=offload_gbps,
    )
    data = result.to_dict()
    data["costs"] = {"source": source, **cost.model_dump()}
    if retention:
        data["retention"] = [r.to_dict() for r in retained]
        data["retention_assumptions"] = ASSUMPTIONS
        data["retention_waits"] = wait_stats(loaded, block_size)
    if tiers:
        data["retention_cpu_tiers"] = tiers
    return PlanReport(result, source, retained, data, tiers)


def _fixed_450_block_s(sessions: Sequence[Any], block_size: int) -> float:
    from agentkv.bench.plan import steps_of
    from agentkv.bench.retention import BASELINE, evaluate_holds, fixed_hold

    steps, tails = steps_of(sessions, block_size)
    return evaluate_holds(
        steps, tails, fixed_hold(BASELINE), tail_hold_s=BASELINE, block_size=block_size
    ).block_seconds


def write_plan(
    report: PlanReport, trace: str, *, json_out: str | None, out: str | None
) -> list[str]:
    """``--json FILE`` and ``--out DIR`` (plan.json and plan.png); what was written, in words."""
    from agentkv.bench.report import write_json

    wrote = []
    if json_out:
        write_json(Path(json_out), report.data)
        wrote.append(json_out)
    if out:
        from agentkv.bench import plots

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "plan.json", report.data)
        plots.plot_tradeoff(
            [r.to_dict() for r in report.plan.rows],
            folder / "plan.png",
            title=f"{Path(trace).parent.name}/{Path(trace).name}: reuse against retained KV "
            f"({report.source})",
        )
        wrote.append(f"{folder / 'plan.json'} and {folder / 'plan.png'}")
    return wrote
