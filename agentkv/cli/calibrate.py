"""`agentkv calibrate`: a cost file measured on a live deployment."""

from __future__ import annotations

from typing import Annotated

import typer

from agentkv.cli._common import BlockSize, floats, print_rows

__all__ = ["calibrate"]


def calibrate(
    endpoint: Annotated[str, typer.Option(help="agentkv router's OpenAI base URL (…/v1).")],
    out: Annotated[str, typer.Option(help="Cost file to write.")] = "agentkv-costs.json",
    contexts: Annotated[
        str, typer.Option(help="Prompt lengths to measure, comma-separated.")
    ] = "512,1024,2048,4096,8192",
    repeats: Annotated[int, typer.Option(help="Measurements per length (median used).")] = 3,
    decode_tokens: Annotated[int, typer.Option(help="Tokens per decode measurement.")] = 24,
    block_size: BlockSize = 16,
    kv_bytes_per_token: Annotated[
        int, typer.Option(help="KV bytes per token (only sizes transfers and the CPU tier).")
    ] = 0,
    timing: Annotated[
        str, typer.Option(help="wall (client clock) | model (the simulator's TTFT header).")
    ] = "wall",
    model: Annotated[str | None, typer.Option(help="Model name [the server's first].")] = None,
    decode_url: Annotated[
        str | None,
        typer.Option(
            help="A decode instance's own URL (not the router's): also measure prefill on D "
            "and the slowdown it causes D's streams."
        ),
    ] = None,
    decode_contexts: Annotated[
        str, typer.Option(help="Prompt lengths prefilled on D, comma-separated.")
    ] = "1024,2048,4096",
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="D's vLLM max_num_batched_tokens (a step's largest chunk).")
    ] = 8192,
) -> None:
    """Measure prefill time per token by context length, pull time per block and decode time
    per token on a live deployment (and, with --decode-url, prefill on D and D's slowdown per
    prefill token in flight), and write a cost file for `agentkv sim --costs`, `agentkv plan
    --costs` and the path cost model."""
    from pathlib import Path

    from agentkv.bench.calibrate import (
        CalibrationError,
        curves_for,
        describe,
        fit_cost_model,
        fit_rows,
        write_cost_file,
    )
    from agentkv.bench.calibrate_measure import run_measure, run_measure_decode_side

    if timing not in ("wall", "model"):
        typer.echo("agentkv calibrate: --timing must be wall or model", err=True)
        raise typer.Exit(2)
    sizes = [int(x) for x in floats(contexts, "--contexts") or []]
    d_sizes = [int(x) for x in floats(decode_contexts, "--decode-contexts") or []]
    try:
        measurements = run_measure(
            endpoint,
            contexts=sizes,
            repeats=repeats,
            decode_tokens=decode_tokens,
            model=model,
            timing=timing,
            on_step=lambda s: typer.echo(f"  {s}", err=True),
        )
        if decode_url is not None:
            measurements += run_measure_decode_side(
                decode_url,
                contexts=d_sizes,
                repeats=repeats,
                model=model,
                timing=timing,
                on_step=lambda s: typer.echo(f"  {s}", err=True),
            )
        fitted = fit_cost_model(
            measurements,
            block_size,
            kv_bytes_per_token,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    except (CalibrationError, OSError) as exc:
        typer.echo(f"agentkv calibrate: {exc}", err=True)
        raise typer.Exit(1) from exc
    except Exception as exc:  # httpx errors: say where
        where = endpoint if decode_url is None else f"{endpoint} / {decode_url}"
        typer.echo(f"agentkv calibrate: {where}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc
    curves = curves_for(fitted, measurements, max_num_batched_tokens=max_num_batched_tokens)
    write_cost_file(
        Path(out),
        fitted,
        measurements,
        endpoint=endpoint,
        decode_url=decode_url,
        timing=timing,
        block_size=block_size,
        curves=curves,
    )
    print_rows(
        fit_rows(fitted, measurements, block_size),
        f"agentkv calibrate: {endpoint} ({timing} clock)",
    )
    typer.echo(describe(fitted, block_size))
    typer.echo(f"wrote {out}")
