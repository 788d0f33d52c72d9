"""The ``agentkv`` command: :func:`agentkv.cli.main`, with a missing optional dependency named by
the extra that brings it (one line on stderr, exit status 1) instead of a traceback."""

from __future__ import annotations

import sys

from agentkv._extras import missing_extra

__all__ = ["main"]


def main() -> None:
    try:
        from agentkv.cli import main as cli_main

        cli_main()
    except ModuleNotFoundError as exc:
        message = missing_extra(exc)
        if message is None:
            raise
        print(f"agentkv: {message}", file=sys.stderr)
        raise SystemExit(1) from None
