"""`agentkv sim`: one simulated vLLM 0.33 engine."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from agentkv.cli._common import one_line

__all__ = ["sim"]

_SIM_FLAGS = {"served_model_name": "--served-model-name"}


def sim(
    role: Annotated[str, typer.Option(help="prefill | decode | both")] = "both",
    port: Annotated[int, typer.Option(help="HTTP port (127.0.0.1 unless --host).")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    template: Annotated[str | None, typer.Option(help="Jinja chat template file.")] = None,
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
    costs: Annotated[
        str | None,
        typer.Option(
            help="Cost file (JSON/TOML, e.g. from `agentkv calibrate`); replaces --preset."
        ),
    ] = None,
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
    engine_id: Annotated[str | None, typer.Option(help="Engine id (default: random).")] = None,
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
        int | None, typer.Option(help="Fault: drop streams after N tokens.")
    ] = None,
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            help="vLLM's --kv-events-config JSON, e.g. "
            '\'{"enable_kv_cache_events":true,"publisher":"zmq",'
            '"endpoint":"tcp://127.0.0.1:5557","topic":"kv"}\' (ZMQ BlockStored/BlockRemoved/'
            "AllBlocksCleared, as vLLM 0.33)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Run one simulated vLLM 0.33 engine (OpenAI server + NixlConnector P/D protocol)."""
    import uvicorn

    from agentkv.sim import Faults, SimConfig, create_app

    extra: dict[str, Any] = {"engine_id": engine_id} if engine_id else {}
    try:
        if kv_events_config is not None:
            try:
                extra["kv_events_config"] = json.loads(kv_events_config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
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
                costs=costs,
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
        typer.echo(f"agentkv sim: {one_line(exc, _SIM_FLAGS)}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(
        f"agentkv sim: {config.role} engine {config.engine_id} on http://{host}:{port} "
        f"(model {served_model_name}, block size {block_size}, "
        f"{'costs ' + costs if costs else 'preset ' + preset}, compat {compat})",
        err=True,
    )
    uvicorn.run(application, host=host, port=port, log_level=log_level, access_log=False)
