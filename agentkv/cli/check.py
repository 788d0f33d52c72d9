"""`agentkv check-template`: is a chat template prefix-stable over an agent's turns."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["check_template"]


# Help texts too long to share their option's line.
_TOKENIZER = "tokenizer.json (or its directory); default: the Qwen3 vocabulary."
_CHAT_TEMPLATE_KWARGS = "JSON object of template kwargs, e.g. '{\"enable_thinking\": false}'."


def check_template(
    template: Annotated[str, typer.Argument(help="Jinja chat template file.")],
    tokenizer: Annotated[str | None, typer.Option(help=_TOKENIZER)] = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(help=_CHAT_TEMPLATE_KWARGS)] = None,
) -> None:
    """Render a scripted 10-turn tool-using conversation with reasoning through TEMPLATE and
    report, per turn, whether messages mode stays prefix-stable (else the hazard, token and
    message where it breaks) and that exact mode stays token-identical."""
    import json

    from rich.console import Console
    from rich.table import Table

    from agentkv.bench.template_check import CheckError
    from agentkv.bench.template_check import check_template as run_check

    try:
        kwargs = json.loads(chat_template_kwargs) if chat_template_kwargs else None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object")
        report = run_check(template, tokenizer, chat_template_kwargs=kwargs)
    except (CheckError, ValueError) as exc:
        typer.echo(f"agentkv check-template: {exc}", err=True)
        raise typer.Exit(2) from exc
    table = Table(title=f"{report.template} (tokenizer: {report.tokenizer})")
    for column in ("turn", "messages mode", "hazard", "at token", "message", "exact mode"):
        table.add_column(column)
    table.add_column("exact = fresh render")
    for row in report.turns:
        table.add_row(
            str(row.turn),
            "prefix-stable" if row.stable else "drifts",
            row.hazard or "",
            "" if row.position is None else str(row.position),
            "" if row.message_index is None else str(row.message_index),
            "token-identical" if row.exact else "error",
            "yes" if row.exact_is_fresh else "no",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    for row in report.turns:
        if row.detail:
            console.print(f"turn {row.turn}: {row.detail}", markup=False, highlight=False)
    stable = (
        "prefix-stable in messages mode" if report.stable else "NOT prefix-stable in messages mode"
    )
    console.print(f"{report.template}: {stable}; exact mode keeps every turn token-identical.")
