"""`agentkv router`: the KV-aware P/D router.

Its options are :class:`~agentkv.router.RouterConfig`'s fields, group by group
(``--GROUP-FIELD``: ``agentkv.cli._options``, a new field is a new flag), then ``--prefill``,
``--decode``, ``--config`` and ``--log-level``. Flags override the environment
(``AGENTKV_ROUTER_<GROUP>__<FIELD>``), which overrides the file (:mod:`agentkv.router.settings`).
The command is built when it is first needed (:func:`command`), so that other commands do not
import the router."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from agentkv.cli._common import one_line, unavailable_command
from agentkv.cli._options import Flag, group_values, model_command

__all__ = ["HELP", "ROUTER_FLAGS", "command", "placeholder", "router"]

HELP = """Run agentkv's KV-aware P/D router: verified bidirectional KV reuse per conversation.

Settings come from flags, then the environment (`AGENTKV_ROUTER_<GROUP>__<FIELD>`, e.g.
AGENTKV_ROUTER_STORE__BACKEND; the tenant salt secret also from AGENTKV_SALT_SECRET), then the
--config file, then the defaults."""

# The names kept from before the flags were generated (--port, not only --http-port), and help
# texts shorter than the field's docstring. A field missing here is still a flag.
ROUTER_FLAGS = {
    "http.host": Flag(aliases=("--host",)),
    "http.port": Flag(aliases=("--port",)),
    "http.metrics_port": Flag(aliases=("--metrics-port",)),
    "http.log_format": Flag(
        "text (control characters escaped) or json (one object a line).",
        aliases=("--log-format",),
    ),
    "upstream.block_size": Flag(aliases=("--block-size",)),
    "retention.decoder_kv_blocks_ttl_s": Flag(aliases=("--decoder-kv-blocks-ttl",)),
    "store.backend": Flag("memory or redis://host:port/db", aliases=("--store",)),
    "identity.keep": Flag("Render every chat request's messages whole (no token identity)."),
}
# --prefill/--decode take URLs (repeated), not the groups' JSON lists of backends
_SKIP = ("upstream.prefill", "upstream.decode")
_WHERE = {
    "upstream.prefill": "--prefill URL (or upstream.prefill in --config)",
    "upstream.decode": "--decode URL (or upstream.decode in --config)",
}

# Help texts too long to share their option's line.
_PREFILL = "Prefill instance URL (repeat for several)."
_DECODE = "Decode instance URL (repeat for several)."
_CONFIG = "TOML or JSON router config (the environment and flags override it)."


def _extra(
    prefill: Annotated[list[str] | None, typer.Option("--prefill", help=_PREFILL)] = None,
    decode: Annotated[list[str] | None, typer.Option("--decode", help=_DECODE)] = None,
    config: Annotated[str | None, typer.Option(help=_CONFIG)] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """The options of `agentkv router` that are not RouterConfig fields."""


def router(**values: Any) -> None:
    """Run the router with the options of :func:`command` (``values``: typer's parameters)."""
    import logging
    import warnings

    import uvicorn
    from pydantic import ValidationError

    from agentkv.router import RouterConfig, create_app
    from agentkv.router.logs import configure_logging
    from agentkv.router.server import HeadLimits, bounded_protocol
    from agentkv.router.settings import load_settings
    from agentkv.router.tracing import configure_opentelemetry

    problem: str | None = None
    with warnings.catch_warnings(record=True) as caught:  # the file's deprecated keys
        warnings.simplefilter("always", DeprecationWarning)
        try:
            flags = group_values(RouterConfig, values)
            for role in ("prefill", "decode"):
                if values[role]:
                    flags.setdefault("upstream", {})[role] = [{"url": u} for u in values[role]]
            cfg = load_settings(values["config"], flags)
        except (ValidationError, ValueError, OSError) as exc:
            problem = one_line(exc, {})
            for loc, flag in _WHERE.items():
                problem = problem.replace(f"{loc}:", f"{flag}:")
    for warning in caught:
        typer.echo(f"agentkv router: {warning.message}", err=True)
    if problem is not None:
        typer.echo(f"agentkv router: invalid configuration: {problem}", err=True)
        raise typer.Exit(2)
    configure_logging(cfg.http.log_format, values["log_level"])
    configure_opentelemetry("agentkv-router")  # from OTEL_* (the otel extra), else a no-op
    banner = (
        f"agentkv router on http://{cfg.http.host}:{cfg.http.port}: "
        f"{len(cfg.upstream.prefill)} prefill, {len(cfg.upstream.decode)} decode, "
        f"store {cfg.store.backend}, router TTL {cfg.router_ttl_s:.0f}s"
    )
    if cfg.http.log_format == "json":
        logging.getLogger("agentkv.router").info(banner)
    else:
        typer.echo(banner, err=True)
    try:
        app = create_app(cfg)
    except (OSError, ValueError) as exc:  # e.g. the kept salt secret cannot be made or read
        typer.echo(f"agentkv router: {one_line(exc, {})}", err=True)
        raise typer.Exit(2) from exc
    http = cfg.http
    uvicorn.run(
        app,
        host=http.host,
        port=http.port,
        http=bounded_protocol(HeadLimits(http.max_header_bytes, http.max_headers), http.parser),
        log_level="warning",
        log_config=None,  # uvicorn's records go through configure_logging's handler
        access_log=False,
    )


def placeholder() -> None:
    """What ``agentkv --help`` lists; ``agentkv router`` runs :func:`command`'s command."""


def command() -> Any:
    """The ``router`` click command, its options generated from RouterConfig. Without the serve
    extra: a command that says which extra is missing when it runs (``agentkv._main``)."""
    try:
        from agentkv.router import RouterConfig
    except ModuleNotFoundError as exc:
        return unavailable_command("router", HELP, exc)
    return model_command(
        "router", HELP, router, RouterConfig, ROUTER_FLAGS, skip=_SKIP, extra=_extra, groups=True
    )
