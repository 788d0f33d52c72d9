"""The ``agentkv`` command line (typer). Every command is a thin shell over a config object or a
domain function: it parses options, calls one function of ``agentkv.serve``/``bench``/``sim``/
``router`` and prints. One module per command group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar

import typer
from typer.core import TyperGroup

from agentkv.__version__ import __version__
from agentkv.cli import bench, calibrate, check, plan, router, serve, sim

__all__ = ["app", "command", "main"]


class _Root(TyperGroup):
    """The root command group; ``sim`` and ``router`` are built when they are asked for, so that
    other commands do not import the simulator or the router to generate their options (``sim``
    is listed first; ``router`` where its placeholder is registered)."""

    lazy: ClassVar[dict[str, Callable[[], Any]]] = {"sim": sim.command, "router": router.command}

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        return [*(n for n in self.lazy if n not in names), *names]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        known = getattr(self.commands.get(cmd_name), "callback", None)
        if cmd_name in self.lazy and getattr(known, "__wrapped__", known) in (
            None,
            router.placeholder,
        ):
            self.commands[cmd_name] = tidy(self.lazy[cmd_name]())
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    cls=_Root,
    name="agentkv",
    help="Fast, verified multi-turn KV reuse for AI agents on self-hosted vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings rewrapped; "[default: …]" in help shown as written
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"agentkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = None,
) -> None:
    """agentkv: conversation ids, exact token history and verified KV reuse for vLLM P/D."""


# The order of registration is the order of `agentkv --help`.
app.command("demo")(serve.demo)
app.command("serve")(serve.serve)
app.add_typer(serve.profiles_app, name="profiles")
app.add_typer(serve.setup_app, name="setup")
app.command("router", help=router.HELP)(router.placeholder)  # listed here, built by _Root
app.command("check-template")(check.check_template)
app.add_typer(bench.bench_app, name="bench")
app.command("plan")(plan.plan)
app.command("calibrate")(calibrate.calibrate)


def command() -> Any:
    """The click command of ``app`` with tidy help: no ``<bool>`` on flags (they take no
    value) and a list option's element type (``<str>``; the help says to repeat it)."""
    import typer.main

    return tidy(typer.main.get_command(app))


def tidy(cmd: Any) -> Any:
    """``cmd`` and its subcommands without ``<bool>`` on flags and with a list option's element
    type as its metavar."""
    ctx = cmd.context_class(cmd)
    for param in cmd.get_params(ctx):  # includes the (cached) --help option
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif getattr(param, "multiple", False) and param.metavar is None:
            shown = str(param.display_type(ctx))  # "<list[str]>"
            param.metavar = shown.replace("list[", "").replace("]", "")
    for sub in getattr(cmd, "commands", {}).values():
        tidy(sub)
    return cmd


def main() -> None:
    command()()
