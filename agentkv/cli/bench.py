"""`agentkv bench replay|curves`: trace replay and preset TTFT curves."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from agentkv.cli._common import Trace, TraceFormat, exit_on_sigterm, floats, group, print_rows

__all__ = ["bench_app"]

bench_app = group(
    "Benchmarks: replay real agent traces through the SDK and router; preset TTFT curves."
)


# Help texts too long to share their option's line.
_ENDPOINT = "agentkv router's OpenAI base URL (…/v1) of a running deployment."
_LOCAL = "Start this profile (name or TOML) for the run [default: local]."
_COMPARE = "Also run no reuse and unverified reuse on the same engines."
_UNVERIFIED_ENDPOINT = "With --endpoint --compare: a router with paths.reuse_policy=unverified."
_MAX_TURNS = "Replay at most this many turns per session."
_MAX_CONTEXT = "Skip sessions whose scaled prompts exceed this many tokens."
_TOKEN_SCALE = "Multiply hashed traces' token counts (e.g. 0.0625)."
_ROUTER_TTL = "--endpoint: the router's TTL in real seconds."
_DECODER_TTL = "--endpoint: D's decoder_kv_blocks_ttl in real seconds."
_SUBAGENTS = "Claude Code: sub-agents as sessions too."
_HONOR_STARTS = "Start sessions at their trace times."
_LEASES = "Also run agentkv with retention leases (a D with a long TTL)."
_UI_IDLE_S = "--leases: the UI idle timeout of user waits, trace seconds."
_MAX_HOLD_S = "--leases: D's TTL (the longest hold), trace seconds."
_PATHS = (
    "--local: the routers' paths.mode: choose (the cost model), pull (always through P) or "
    "decode (in place on D whenever its budget allows). Default: the profile's (choose unless "
    "it sets one)."
)
_LEASE_ENDPOINT = "--endpoint --leases: a router before a D with a --max-hold-s TTL."
_CLIENT = (
    "Who sends the turns: sdk (agentkv's SDK, exact mode), or a raw HTTP client that knows "
    "nothing of agentkv: chat (Chat Completions), messages (Anthropic Messages, as Claude "
    "Code), responses (OpenAI Responses, as Codex)."
)


@bench_app.command("replay")
def bench_replay(
    trace: Trace,
    endpoint: Annotated[str | None, typer.Option(help=_ENDPOINT)] = None,
    local: Annotated[str | None, typer.Option(help=_LOCAL)] = None,
    compare: Annotated[bool, typer.Option("--compare", help=_COMPARE)] = False,
    unverified_endpoint: Annotated[str | None, typer.Option(help=_UNVERIFIED_ENDPOINT)] = None,
    sessions: Annotated[int, typer.Option(help="Sessions to replay (the first that fit).")] = 16,
    skip: Annotated[int, typer.Option(help="Skip this many fitting sessions first.")] = 0,
    max_turns: Annotated[int | None, typer.Option(help=_MAX_TURNS)] = None,
    max_context: Annotated[int | None, typer.Option(help=_MAX_CONTEXT)] = None,
    token_scale: Annotated[float, typer.Option(help=_TOKEN_SCALE)] = 1.0,
    time_scale: Annotated[float, typer.Option(help="Multiply the trace's gaps (and TTLs).")] = 1.0,
    concurrency: Annotated[int, typer.Option(help="Sessions in flight at once.")] = 8,
    preset: Annotated[str | None, typer.Option(help="--local: simulator cost preset.")] = None,
    costs: Annotated[str | None, typer.Option(help="--local: simulator cost file.")] = None,
    router_ttl: Annotated[float, typer.Option(help=_ROUTER_TTL)] = 450.0,
    decoder_ttl: Annotated[float, typer.Option(help=_DECODER_TTL)] = 480.0,
    trace_format: TraceFormat = None,
    subagents: Annotated[bool, typer.Option("--subagents", help=_SUBAGENTS)] = False,
    honor_starts: Annotated[bool, typer.Option("--honor-starts", help=_HONOR_STARTS)] = False,
    with_leases: Annotated[bool, typer.Option("--leases", help=_LEASES)] = False,
    lease_s: Annotated[float, typer.Option(help="--leases: the lease, trace seconds.")] = 30.0,
    ui_idle_s: Annotated[float, typer.Option(help=_UI_IDLE_S)] = 300.0,
    max_hold_s: Annotated[float, typer.Option(help=_MAX_HOLD_S)] = 1800.0,
    lease_endpoint: Annotated[str | None, typer.Option(help=_LEASE_ENDPOINT)] = None,
    client: Annotated[str, typer.Option(help=_CLIENT)] = "sdk",
    paths: Annotated[str | None, typer.Option(help=_PATHS)] = None,
    out: Annotated[str, typer.Option(help="Directory for the report.")] = "agentkv-replay",
    plots: Annotated[bool, typer.Option(help="Write PNG plots (needs matplotlib).")] = True,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Replay a trace's sessions through the SDK (exact mode) or a raw HTTP client, and the
    router: TTFT, reuse against the ideal, recompute, wrong-KV tokens and D's retained
    block-seconds, per turn."""
    import contextlib
    from pathlib import Path

    from agentkv.bench import replay_setup as setup
    from agentkv.bench import runner
    from agentkv.bench.retention import LeaseParams
    from agentkv.bench.traces import TraceError, detect_format
    from agentkv.bench.wire import CLIENTS

    exit_on_sigterm()
    if client not in CLIENTS:
        typer.echo(f"agentkv bench replay: unknown --client {client!r}", err=True)
        raise typer.Exit(2)
    if with_leases and client != "sdk":
        typer.echo("agentkv bench replay: --leases needs --client sdk", err=True)
        raise typer.Exit(2)
    who: Any = client
    if endpoint and local:
        typer.echo("agentkv bench replay: give --endpoint or --local, not both", err=True)
        raise typer.Exit(2)
    if paths not in (None, "choose", "pull", "decode"):
        typer.echo(f"agentkv bench replay: unknown --paths {paths!r}", err=True)
        raise typer.Exit(2)
    if paths is not None and endpoint:
        typer.echo(
            "agentkv bench replay: --paths needs --local (set the router's paths.mode)", err=True
        )
        raise typer.Exit(2)
    if token_scale <= 0 or time_scale <= 0:
        typer.echo("agentkv bench replay: scales must be positive", err=True)
        raise typer.Exit(2)
    fmt: Any = trace_format
    if fmt not in (None, "claude-code", "mooncake", "vllm-multi-turn"):
        typer.echo(f"agentkv bench replay: unknown --format {fmt!r}", err=True)
        raise typer.Exit(2)
    try:
        chosen = runner.select_sessions(
            runner.load_sessions(trace, fmt, include_subagents=subagents),
            count=sessions,
            token_scale=token_scale,
            max_turns=max_turns,
            max_context=max_context,
            skip=skip,
        )
        fmt = fmt or detect_format(trace)
    except (TraceError, OSError) as exc:
        typer.echo(f"agentkv bench replay: {exc}", err=True)
        raise typer.Exit(2) from exc
    if not chosen:
        typer.echo("agentkv bench replay: no session of the trace fits the filters", err=True)
        raise typer.Exit(2)
    selection = (
        f"the first {len(chosen)} sessions"
        + (f" after skipping {skip}" if skip else "")
        + " with 2 turns or more"
        + (f", cut to {max_turns} turns" if max_turns else "")
        + (f", whose scaled prompts stay within {max_context:,} tokens" if max_context else "")
    )
    meta = {"trace": trace, "format": fmt, "selection": selection}
    leases = LeaseParams(ui_idle_s, lease_s, max_hold_s) if with_leases else None
    with contextlib.ExitStack() as stack:
        try:
            if endpoint:
                run = setup.endpoint_run(
                    endpoint,
                    ttls=setup.EndpointTTLs(router_ttl, decoder_ttl),
                    time_scale=time_scale,
                    concurrency=concurrency,
                    honor_starts=honor_starts,
                    unverified_endpoint=unverified_endpoint,
                    compare=compare,
                    lease=leases,
                    lease_endpoint=lease_endpoint,
                    client=who,
                )
            else:
                typer.echo(f"agentkv bench replay: starting profile {local or 'local'} …", err=True)
                run = stack.enter_context(
                    setup.local_run(
                        local or "local",
                        time_scale=time_scale,
                        preset=preset,
                        costs=costs,
                        compare=compare,
                        concurrency=concurrency,
                        honor_starts=honor_starts,
                        lease=leases,
                        client=who,
                        paths=paths,
                    )
                )
        except setup.SetupError as exc:
            typer.echo(f"agentkv bench replay: {exc}", err=True)
            raise typer.Exit(exc.status) from exc
        outcome = runner.run(
            chosen,
            run,
            token_scale=token_scale,
            out_dir=Path(out),
            plots=plots,
            progress=progress,
            meta=meta,
        )
    print_rows(runner.summary_rows(outcome.summaries), "agentkv bench replay")
    for path in outcome.files:
        typer.echo(f"wrote {path}")


@bench_app.command("curves")
def bench_curves(
    preset: Annotated[
        list[str] | None,
        typer.Option("--preset", help="Preset to run (repeat) [qwen3-32b-p5en, glm-5-fp8-p5en]."),
    ] = None,
    sizes: Annotated[
        str, typer.Option(help="Prompt lengths, comma-separated.")
    ] = "1024,2048,4096,8192,12288,16384,20480,24576,32768",
    out: Annotated[str, typer.Option(help="PNG to write.")] = "preset_ttft.png",
    json_out: Annotated[
        str | None, typer.Option("--json", help="Also write the points as JSON.")
    ] = None,
) -> None:
    """Run the published benchmark's two scenarios (recompute; reuse of all but the last 10 %)
    as real P/D turns through the router and simulator processes of each preset, and plot them
    against the cost model and the published points."""
    import json as json_module
    from pathlib import Path

    from agentkv.bench import plots
    from agentkv.bench.calibrate import CalibrationError
    from agentkv.bench.curves import (
        DEFAULT_PRESETS,
        ROWS_HEADER,
        curve_rows,
        measure_preset,
        preset_curve,
    )
    from agentkv.sim.costmodel import PRESETS

    exit_on_sigterm()
    names = preset or list(DEFAULT_PRESETS)
    points = [int(x) for x in floats(sizes, "--sizes") or []]
    curves: dict[str, dict[str, Any]] = {}
    rows = [ROWS_HEADER]
    for name in names:
        if name not in PRESETS:
            typer.echo(f"agentkv: unknown preset {name!r}", err=True)
            raise typer.Exit(2)
        typer.echo(f"agentkv bench curves: {name} …", err=True)
        try:
            measured = measure_preset(name, points)
        except CalibrationError as exc:
            typer.echo(f"agentkv bench curves: {exc}", err=True)
            raise typer.Exit(1) from exc
        curves[name] = preset_curve(name, points, measured)
        rows += curve_rows(name, measured)
    plots.plot_preset_curves(curves, Path(out))
    if json_out:
        Path(json_out).write_text(json_module.dumps(curves, indent=2) + "\n")
    print_rows(rows, "TTFT through router + simulator (P/D turns, modelled)")
    typer.echo(f"wrote {out}")
