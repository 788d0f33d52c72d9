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
) -> None:
    """Measure prefill time per token by context length, pull time per block and decode time
    per token on a live deployment, and write a cost file for `agentkv sim --costs` and
    `agentkv plan --costs`."""
    from pathlib import Path

    from agentkv.bench.calibrate import (
        CalibrationError,
        describe,
        fit_cost_model,
        fit_rows,
        run_measure,
        write_cost_file,
    )

    if timing not in ("wall", "model"):
        typer.echo("agentkv calibrate: --timing must be wall or model", err=True)
        raise typer.Exit(2)
    sizes = [int(x) for x in floats(contexts, "--contexts") or []]
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
        fitted = fit_cost_model(measurements, block_size, kv_bytes_per_token)
    except (CalibrationError, OSError) as exc:
        typer.echo(f"agentkv calibrate: {exc}", err=True)
        raise typer.Exit(1) from exc
    except Exception as exc:  # httpx errors: say where
        typer.echo(f"agentkv calibrate: {endpoint}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc
    write_cost_file(
        Path(out), fitted, measurements, endpoint=endpoint, timing=timing, block_size=block_size
    )
    print_rows(
        fit_rows(fitted, measurements, block_size),
        f"agentkv calibrate: {endpoint} ({timing} clock)",
    )
    typer.echo(describe(fitted, block_size))
    typer.echo(f"wrote {out}")
