"""`agentkv sim`: one simulated vLLM 0.33 engine.

Its options are :class:`~agentkv.sim.SimConfig`'s fields (``agentkv.cli._options``: a new field
is a new flag), then the fault knobs and the log level. The command is built when it is first
needed (:func:`command`), so that other commands do not import the simulator."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from agentkv.cli._common import one_line, unavailable_command
from agentkv.cli._options import Flag, model_command, model_values

__all__ = ["HELP", "SIM_FLAGS", "command"]

HELP = "Run one simulated vLLM 0.33 engine (OpenAI server + NixlConnector P/D protocol)."

# The CLI's short help per SimConfig field, and the names kept from before the flags were
# generated (--no-bidirectional, not --no-bidirectional-kv-xfer). A field missing here is still
# a flag: its help is the field's description, else its docstring's first sentence.
SIM_FLAGS = {
    "role": Flag("prefill | decode | both"),
    "port": Flag("HTTP port (127.0.0.1 unless --host)."),
    "host": Flag("Interface to listen on."),
    "template": Flag("Jinja chat template file."),
    "tokenizer": Flag("tokenizer.json (or its directory)."),
    "block_size": Flag("Tokens per KV block."),
    "num_blocks": Flag("KV blocks in the pool (block 0 is reserved)."),
    "max_model_len": Flag("Longest prompt + output."),
    "preset": Flag("Cost model preset."),  # its names are added when the command is built
    "costs": Flag("Cost file (JSON/TOML, e.g. from `agentkv calibrate`); replaces --preset."),
    "time_scale": Flag("Multiply simulated delays; 0 = none."),
    "decoder_kv_blocks_ttl": Flag("Seconds D keeps a finished turn's blocks."),
    "kv_lease_duration": Flag("Seconds P keeps blocks for D's read."),
    "kv_recompute_threshold": Flag("Recompute when fewer remote tokens would be read."),
    "kv_load_failure_policy": Flag("fail (HTTP 500) | recompute"),
    "bidirectional_kv_xfer": Flag("Turn off bidirectional_kv_xfer.", off="--no-bidirectional"),
    "prefix_caching": Flag("Turn off prefix caching."),
    "prompt_tokens_details": Flag("Omit usage.prompt_tokens_details."),
    "compat": Flag("0.33 | 0.32 (reproduce vLLM 0.32's rough edges)."),
    "served_model_name": Flag("Model name to serve."),
    "engine_id": Flag("Engine id [default: random]."),
    "side_channel_host": Flag("remote_host advertised in handles."),
    "seed": Flag("Base seed for generated text."),
    "tool_format": Flag("Tool-call parser, as vLLM's --tool-call-parser (none: no parsing)."),
    "reasoning_parser": Flag("Leave reasoning in the text (no vLLM --reasoning-parser)."),
    "max_num_batched_tokens": Flag("Tokens per step: a prefill chunk's most (interference)."),
    "cpu_offload_blocks": Flag("Blocks of the CPU tier (0: none)."),
    "cpu_save_failure_rate": Flag("Share of CPU-tier block saves that fail (0-1)."),
    "prompt_scripts": Flag(
        "Script answers from the prompt: the JSON after 'agentkv_sim:' in the last user message "
        "(one script, or a list: one per answer)."
    ),
    "kv_events_config": Flag(
        "vLLM's --kv-events-config JSON, e.g. "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq",'
        '"endpoint":"tcp://127.0.0.1:5557","topic":"kv"}\' (ZMQ BlockStored/BlockRemoved/'
        "AllBlocksCleared, as vLLM 0.33)."
    ),
}


def _extra(
    fail_next: Annotated[int, typer.Option(help="Fault: fail the next N generation requests.")] = 0,
    fail_status: Annotated[
        int, typer.Option(help="Fault: HTTP status of injected failures.")
    ] = 500,
    delay: Annotated[float, typer.Option(help="Fault: extra seconds before each request.")] = 0.0,
    cut_stream_after: Annotated[
        int | None, typer.Option(help="Fault: drop streams after N tokens.")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """The options of `agentkv sim` that are not SimConfig fields."""


def _run(**values: Any) -> None:
    import uvicorn

    from agentkv.sim import Faults, SimConfig, create_app

    try:
        config = SimConfig.model_validate(model_values(SimConfig, values))
        faults = Faults(
            fail_next=values["fail_next"],
            fail_status=values["fail_status"],
            delay_s=values["delay"],
            cut_stream_after=values["cut_stream_after"],
        )
        application = create_app(config, faults=faults)
    except (ValueError, OSError) as exc:
        typer.echo(f"agentkv sim: {one_line(exc, {})}", err=True)
        raise typer.Exit(2) from exc
    cost = f"costs {config.costs}" if config.costs else f"preset {config.preset}"
    typer.echo(
        f"agentkv sim: {config.role} engine {config.engine_id} on "
        f"http://{config.host}:{config.port} (model {config.served_model_name}, block size "
        f"{config.block_size}, {cost}, compat {config.compat})",
        err=True,
    )
    uvicorn.run(
        application,
        host=config.host,
        port=config.port,
        log_level=values["log_level"],
        access_log=False,
    )


def command() -> Any:
    """The ``sim`` click command, its options generated from SimConfig. Without the serve
    extra: a command that says which extra is missing when it runs (``agentkv._main``)."""
    try:
        from agentkv.sim import SimConfig
    except ModuleNotFoundError as exc:
        return unavailable_command("sim", HELP, exc)

    from agentkv.sim.costmodel import PRESETS

    names = " | ".join(PRESETS)
    flags = {**SIM_FLAGS, "preset": Flag(f"Cost model preset: {names}.")}
    return model_command("sim", HELP, _run, SimConfig, flags, extra=_extra)
