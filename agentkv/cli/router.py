"""`agentkv router`: the KV-aware P/D router."""

from __future__ import annotations

from typing import Annotated

import typer

from agentkv.cli._common import one_line

__all__ = ["router"]

_ROUTER_FLAGS = {
    "prefill": "--prefill URL (or prefill in --config)",
    "decode": "--decode URL (or decode in --config)",
}


# Help texts too long to share their option's line.
_PREFILL = "Prefill instance URL (repeat for several)."
_DECODE = "Decode instance URL (repeat for several)."
_CONFIG = "TOML or JSON router config (flags override it)."
_HOST = "Interface to listen on [default: 127.0.0.1]."
_METRICS_PORT = "Serve /metrics on this port instead of the main one."
_LOG_FORMAT = "text (control characters escaped) or json (one object a line)."


def router(
    prefill: Annotated[list[str] | None, typer.Option("--prefill", help=_PREFILL)] = None,
    decode: Annotated[list[str] | None, typer.Option("--decode", help=_DECODE)] = None,
    config: Annotated[str | None, typer.Option(help=_CONFIG)] = None,
    host: Annotated[str | None, typer.Option(help=_HOST)] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on [default: 8000].")] = None,
    block_size: Annotated[int | None, typer.Option(help="Engines' KV block size.")] = None,
    decoder_kv_blocks_ttl: Annotated[
        float | None, typer.Option(help="D's decoder_kv_blocks_ttl (s).")
    ] = None,
    store: Annotated[str | None, typer.Option(help="memory or redis://host:port/db")] = None,
    metrics_port: Annotated[int | None, typer.Option(help=_METRICS_PORT)] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
    log_format: Annotated[str | None, typer.Option(help=_LOG_FORMAT)] = None,
) -> None:
    """Run agentkv's KV-aware P/D router: verified bidirectional KV reuse per conversation.

    The tenant salt secret may come from the environment (AGENTKV_SALT_SECRET) instead of the
    config file."""
    import logging
    import os

    import uvicorn
    from pydantic import ValidationError

    from agentkv.router import RouterConfig, create_app
    from agentkv.router.logs import configure_logging
    from agentkv.router.server import HeadLimits, bounded_protocol
    from agentkv.router.tracing import configure_opentelemetry

    overrides = {
        "prefill": [{"url": u} for u in prefill] if prefill else None,
        "decode": [{"url": u} for u in decode] if decode else None,
        "host": host,
        "port": port,
        "block_size": block_size,
        "decoder_kv_blocks_ttl_s": decoder_kv_blocks_ttl,
        "store": store,
        "metrics_port": metrics_port,
        "log_format": log_format,
    }
    if os.environ.get("AGENTKV_SALT_SECRET"):
        overrides["salt_secret"] = os.environ["AGENTKV_SALT_SECRET"]
    try:
        if config:
            cfg = RouterConfig.load(config, **overrides)
        else:
            cfg = RouterConfig.model_validate({k: v for k, v in overrides.items() if v is not None})
    except (ValidationError, ValueError, OSError) as exc:
        typer.echo(
            f"agentkv router: invalid configuration: {one_line(exc, _ROUTER_FLAGS)}", err=True
        )
        raise typer.Exit(2) from exc
    configure_logging(cfg.log_format, log_level)
    configure_opentelemetry("agentkv-router")  # from OTEL_* (the otel extra), else a no-op
    banner = (
        f"agentkv router on http://{cfg.host}:{cfg.port}: "
        f"{len(cfg.prefill)} prefill, {len(cfg.decode)} decode, store {cfg.store}, "
        f"router TTL {cfg.router_ttl_s:.0f}s"
    )
    if cfg.log_format == "json":
        logging.getLogger("agentkv.router").info(banner)
    else:
        typer.echo(banner, err=True)
    try:
        app = create_app(cfg)
    except (OSError, ValueError) as exc:  # e.g. the kept salt secret cannot be made or read
        typer.echo(f"agentkv router: {one_line(exc, _ROUTER_FLAGS)}", err=True)
        raise typer.Exit(2) from exc
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        http=bounded_protocol(HeadLimits(cfg.max_header_bytes, cfg.max_headers), cfg.http_parser),
        log_level="warning",
        log_config=None,  # uvicorn's records go through configure_logging's handler
        access_log=False,
    )
