"""The ``agentkv`` command line (typer). Every command is a thin shell over a config object."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from agentkv.__version__ import __version__

__all__ = ["app", "main"]

app = typer.Typer(
    name="agentkv",
    help="Fast, verified multi-turn KV reuse for AI agents on self-hosted vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"agentkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],  # noqa: UP045 - typer needs the runtime type on 3.10
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = None,
) -> None:
    """agentkv: conversation ids, exact token history and verified KV reuse for vLLM P/D."""


@app.command()
def sim(
    role: Annotated[str, typer.Option(help="prefill | decode | both")] = "both",
    port: Annotated[int, typer.Option(help="HTTP port (127.0.0.1 unless --host).")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    template: Annotated[Optional[str], typer.Option(help="Jinja chat template file.")] = None,  # noqa: UP045
    tokenizer: Annotated[
        str | None, typer.Option(help="tokenizer.json (or its directory).")
    ] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    num_blocks: Annotated[
        int, typer.Option(help="KV blocks in the pool (block 0 is reserved).")
    ] = 16384,
    max_model_len: Annotated[int, typer.Option(help="Longest prompt + output.")] = 131072,
    preset: Annotated[
        str, typer.Option(help="Cost model preset (see docs/simulator.md).")
    ] = "laptop",
    time_scale: Annotated[float, typer.Option(help="Multiply simulated delays; 0 = none.")] = 1.0,
    decoder_kv_blocks_ttl: Annotated[
        float, typer.Option(help="Seconds D keeps a finished turn's blocks.")
    ] = 480.0,
    kv_lease_duration: Annotated[
        float, typer.Option(help="Seconds P keeps blocks for D's read.")
    ] = 30.0,
    kv_recompute_threshold: Annotated[
        int, typer.Option(help="Recompute when fewer remote tokens would be read.")
    ] = 64,
    kv_load_failure_policy: Annotated[
        str, typer.Option(help="fail (HTTP 500) | recompute")
    ] = "fail",
    no_bidirectional: Annotated[
        bool, typer.Option("--no-bidirectional", help="Turn off bidirectional_kv_xfer.")
    ] = False,
    no_prefix_caching: Annotated[
        bool, typer.Option("--no-prefix-caching", help="Turn off prefix caching.")
    ] = False,
    no_prompt_tokens_details: Annotated[
        bool, typer.Option("--no-prompt-tokens-details", help="Omit usage.prompt_tokens_details.")
    ] = False,
    compat: Annotated[
        str, typer.Option(help="0.33 | 0.32 (reproduce vLLM 0.32's rough edges).")
    ] = "0.33",
    served_model_name: Annotated[str, typer.Option(help="Model name to serve.")] = "agentkv-sim",
    engine_id: Annotated[Optional[str], typer.Option(help="Engine id (default: random).")] = None,  # noqa: UP045
    side_channel_host: Annotated[
        str, typer.Option(help="remote_host advertised in handles.")
    ] = "localhost",
    seed: Annotated[int, typer.Option(help="Base seed for generated text.")] = 0,
    fail_next: Annotated[int, typer.Option(help="Fault: fail the next N generation requests.")] = 0,
    fail_status: Annotated[
        int, typer.Option(help="Fault: HTTP status of injected failures.")
    ] = 500,
    delay: Annotated[float, typer.Option(help="Fault: extra seconds before each request.")] = 0.0,
    cut_stream_after: Annotated[
        Optional[int], typer.Option(help="Fault: drop streams after N tokens.")  # noqa: UP045
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Run one simulated vLLM 0.33 engine (OpenAI server + NixlConnector P/D protocol)."""
    import uvicorn

    from agentkv.sim import Faults, SimConfig, create_app

    extra = {"engine_id": engine_id} if engine_id else {}
    try:
        config = SimConfig.model_validate(
            dict(
                role=role,
                host=host,
                port=port,
                template=template,
                tokenizer=tokenizer,
                block_size=block_size,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                preset=preset,
                time_scale=time_scale,
                decoder_kv_blocks_ttl=decoder_kv_blocks_ttl,
                kv_lease_duration=kv_lease_duration,
                kv_recompute_threshold=kv_recompute_threshold,
                kv_load_failure_policy=kv_load_failure_policy,
                bidirectional_kv_xfer=not no_bidirectional,
                prefix_caching=not no_prefix_caching,
                prompt_tokens_details=not no_prompt_tokens_details,
                compat=compat,
                served_model_name=served_model_name,
                side_channel_host=side_channel_host,
                seed=seed,
                **extra,
            )
        )
        faults = Faults(
            fail_next=fail_next,
            fail_status=fail_status,
            delay_s=delay,
            cut_stream_after=cut_stream_after,
        )
        application = create_app(config, faults=faults)
    except (ValueError, OSError) as exc:
        typer.echo(f"agentkv sim: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(
        f"agentkv sim: {config.role} engine {config.engine_id} on http://{host}:{port} "
        f"(model {served_model_name}, block size {block_size}, preset {preset}, compat {compat})",
        err=True,
    )
    uvicorn.run(application, host=host, port=port, log_level=log_level, access_log=False)


@app.command()
def demo(
    turns: Annotated[int, typer.Option(help="Turns of the scripted conversation.")] = 4,
    time_scale: Annotated[float, typer.Option(help="Simulated-delay scale (0 = instant).")] = 1.0,
) -> None:
    """Start a simulated P and D, run a multi-turn conversation with verified reuse, and show
    what an unverified stale handle does."""
    from agentkv.sim.demo import run_demo

    raise typer.Exit(run_demo(turns=turns, time_scale=time_scale))


@app.command()
def router(
    prefill: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option("--prefill", help="Prefill instance URL (repeat for several)."),
    ] = None,
    decode: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option("--decode", help="Decode instance URL (repeat for several)."),
    ] = None,
    config: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="TOML or JSON router config (flags override it)."),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    block_size: Annotated[
        Optional[int], typer.Option(help="Engines' KV block size.")  # noqa: UP045
    ] = None,
    decoder_kv_blocks_ttl: Annotated[
        Optional[float], typer.Option(help="D's decoder_kv_blocks_ttl (s).")  # noqa: UP045
    ] = None,
    store: Annotated[
        Optional[str], typer.Option(help="memory or redis://host:port/db")  # noqa: UP045
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run agentkv's KV-aware P/D router: verified bidirectional KV reuse per conversation."""
    import logging

    import uvicorn
    from pydantic import ValidationError

    from agentkv.router import RouterConfig, create_app

    overrides = {
        "prefill": [{"url": u} for u in prefill] if prefill else None,
        "decode": [{"url": u} for u in decode] if decode else None,
        "host": host,
        "port": port,
        "block_size": block_size,
        "decoder_kv_blocks_ttl_s": decoder_kv_blocks_ttl,
        "store": store,
    }
    try:
        if config:
            cfg = RouterConfig.load(config, **overrides)
        else:
            cfg = RouterConfig.model_validate({k: v for k, v in overrides.items() if v is not None})
    except (ValidationError, ValueError, OSError) as exc:
        typer.echo(f"agentkv router: invalid configuration: {exc}", err=True)
        raise typer.Exit(2) from exc
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    typer.echo(
        f"agentkv router on http://{cfg.host}:{cfg.port}: "
        f"{len(cfg.prefill)} prefill, {len(cfg.decode)} decode, store {cfg.store}, "
        f"router TTL {cfg.router_ttl_s:.0f}s",
        err=True,
    )
    uvicorn.run(
        create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", access_log=False
    )


def main() -> None:
    app()
