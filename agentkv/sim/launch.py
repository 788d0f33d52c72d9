"""Start simulator instances as real processes on loopback (demo, e2e tests, benchmarks).

The processes are :class:`agentkv.procs.Process` objects: output kept (a failure to start shows
the last lines), SIGTERM then SIGKILL on stop, and each dies with the process that started it.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Sequence

from agentkv.procs import Process, ProcessError, free_port, start, start_on_free_port

__all__ = ["SimProcess", "free_port", "start_sim", "start_sims"]

SimProcess = Process
"""One ``agentkv sim`` process (``process`` is its ``Popen``, ``url`` its root URL)."""


def _argv(argv: Sequence[str], port: int) -> list[str]:
    return [sys.executable, "-m", "agentkv", "sim", "--port", str(port), *argv]


def _name(port: int) -> str:
    return f"agentkv sim on port {port}"


def _echo(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def start_sim(
    *args: str, port: int | None = None, timeout_s: float = 60.0, quiet: bool = True
) -> Iterator[SimProcess]:
    """Run ``agentkv sim --port PORT *args`` until the block exits."""
    sims = start_sims(
        [list(args)], ports=[port] if port else None, timeout_s=timeout_s, quiet=quiet
    )
    try:
        yield sims[0]
    finally:
        sims[0].stop()


def start_sims(
    argvs: Sequence[Sequence[str]],
    *,
    ports: Sequence[int] | None = None,
    timeout_s: float = 60.0,
    quiet: bool = True,
) -> list[SimProcess]:
    """Start several simulators at once and wait until all are healthy.

    Each is on ``ports[i]``, or on a free port; one on a free port that exits while starting
    (the port was taken before it could bind) is started again on another. Raises
    :class:`agentkv.procs.ProcessError` (a ``RuntimeError``) with the simulator's last output
    lines when one exits or is not healthy in ``timeout_s``; none is left running then.
    """
    on_line = None if quiet else _echo
    sims: list[SimProcess] = []
    try:
        for i, argv in enumerate(argvs):
            port = ports[i] if ports else free_port()
            sims.append(start(_argv(argv, port), name=_name(port), port=port, on_line=on_line))
        for i, sim in enumerate(sims):
            try:
                sim.wait_ready(health_url=f"{sim.url}/health", timeout_s=timeout_s)
            except ProcessError as exc:
                if ports or not exc.port_taken:
                    raise
                sim.stop()
                sims[i] = start_on_free_port(
                    functools.partial(_argv, argvs[i]),
                    name="agentkv sim",
                    on_line=on_line,
                    timeout_s=timeout_s,
                    attempts=2,
                )
    except BaseException:
        for sim in sims:
            sim.stop()
        raise
    return sims
