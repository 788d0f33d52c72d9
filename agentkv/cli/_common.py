"""What several commands share: options and arguments, command groups, one-line configuration
errors, profile loading, number lists, tables."""

from __future__ import annotations

from typing import Annotated, Any

import typer

__all__ = [
    "BlockSize",
    "DryRun",
    "ProfileFile",
    "Trace",
    "TraceFormat",
    "exit_on_sigterm",
    "floats",
    "group",
    "load_profile",
    "one_line",
    "print_rows",
    "single_command",
    "unavailable_command",
]

# Options and arguments that several commands take, with the same help.
Trace = Annotated[str, typer.Argument(help="Claude Code (.jsonl[.xz]), Mooncake or vLLM JSON.")]
TraceFormat = Annotated[
    str | None, typer.Option("--format", help="claude-code | mooncake | vllm-multi-turn [auto].")
]
BlockSize = Annotated[int, typer.Option(help="Engines' KV block size.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print what would run.")]
ProfileFile = Annotated[str, typer.Argument(help="Built-in profile name or TOML file.")]


def group(help: str) -> typer.Typer:
    """A command group (``agentkv bench …``): its help, and the list of its commands when it
    is given none."""
    return typer.Typer(help=help, no_args_is_help=True, rich_markup_mode="markdown")


def single_command(name: str, func: Any, **settings: Any) -> Any:
    """``func`` as the click command ``name`` (a command built when it is first asked for)."""
    import typer.main

    one = typer.Typer(rich_markup_mode="markdown", add_completion=False)
    one.command(name, **settings)(func)
    built = typer.main.get_command(one)
    built.name = name
    return built


def unavailable_command(name: str, help: str, missing: ModuleNotFoundError) -> Any:
    """A command that raises ``missing`` when it runs (``agentkv._main`` names the extra to
    install), whatever its arguments: what a command needing an extra is without it."""

    def unavailable(args: Annotated[list[str] | None, typer.Argument()] = None) -> None:
        raise missing

    unavailable.__doc__ = help
    return single_command(
        name,
        unavailable,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )


def one_line(exc: Exception, flags: dict[str, str]) -> str:
    """A configuration error in one line: each pydantic problem as ``where: what`` (the flag
    that sets the field, where known), not pydantic's multi-line dump."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    problems = []
    for err in exc.errors():
        loc = [str(x) for x in err["loc"]]
        where = (
            ".".join(loc) if len(loc) != 1 else flags.get(loc[0], "--" + loc[0].replace("_", "-"))
        )
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            message = "required"
        elif err["type"] in ("literal_error", "enum"):
            message = f"{err.get('input')!r}: {message[0].lower()}{message[1:]}"
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


def load_profile(name: str) -> Any:
    """A built-in profile or TOML file; exit 2 naming the problem (its deprecated keys said)."""
    import warnings

    from agentkv.serve import ProfileError
    from agentkv.serve import load_profile as load

    with warnings.catch_warnings(record=True) as caught:  # the profile's deprecated keys
        warnings.simplefilter("always", DeprecationWarning)
        try:
            return load(name)
        except ProfileError as exc:
            typer.echo(f"agentkv: {exc}", err=True)
            raise typer.Exit(2) from exc
        finally:
            for warning in caught:
                typer.echo(f"agentkv: {name}: {warning.message}", err=True)


def exit_on_sigterm() -> None:
    """SIGTERM ends the command like Ctrl-C, so started processes are stopped."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def floats(text: str | None, name: str) -> list[float] | None:
    """A comma-separated list of numbers (None when empty); exit 2 when it is not one."""
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        typer.echo(f"agentkv: {name} must be a comma-separated list of numbers", err=True)
        raise typer.Exit(2) from None


def print_rows(rows: list[list[str]], title: str) -> None:
    """A table: the first row is the header, the first column left-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(rows[0]):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows[1:]:
        table.add_row(*row)
    Console(width=max(140, Console().width)).print(table)
