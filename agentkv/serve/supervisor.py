"""Run a :class:`~agentkv.serve.Deployment`: start, watch, and stop every process in order.

1. Write each process's config file (the router's) into a private directory.
2. Start the processes in the deployment's order (prefill, decode, router), with their output
   prefixed by their names. They stay in the supervisor's process group, so Ctrl-C in the shell
   that started it (or ``kill -- -PGID``) reaches every one of them, and on Linux each is told
   to die with the supervisor (``PR_SET_PDEATHSIG``: SIGTERM when the supervisor dies, even
   by SIGKILL).
3. Wait until each answers ``/health``, showing progress; a process that exits first fails the
   start with its name and exit code (and its last lines).
4. Watch: a child that exits ends the run with its name (non-zero); SIGINT/SIGTERM/SIGHUP end
   it cleanly.
5. Stop in reverse order (router first): SIGTERM, then SIGKILL after a grace period, to the
   process and to what it started (an engine's own workers).

Each child is an :class:`agentkv.procs.Process`; :func:`start_router` runs one router the same
way (the demo's and the bench's second router, the tests' routers).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.text import Text

from agentkv.procs import Process, ProcessError, start, start_on_free_port
from agentkv.serve import Deployment, ProcessSpec

__all__ = ["ServeError", "Supervisor", "start_router"]

_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ServeError(Exception):
    """A process failed to start or died; ``name`` says which."""

    def __init__(self, name: str, message: str, *, code: int | None = None) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.code = name, code


@dataclass
class _Child:
    spec: ProcessSpec
    process: Process
    color: str


class Supervisor:
    """Starts and stops one deployment's processes.

    Args:
        deployment: what to run (from :func:`agentkv.serve.expand`).
        console: where progress and the prefixed logs go (None: quiet, logs kept in memory).
        startup_timeout_s: how long each process may take to answer ``/health``.
        grace_s: how long a process may take to exit after SIGTERM.
    """

    def __init__(
        self,
        deployment: Deployment,
        *,
        console: Console | None = None,
        startup_timeout_s: float = 120.0,
        grace_s: float = 10.0,
    ) -> None:
        self.deployment = deployment
        self.console = console
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.children: list[_Child] = []
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._stop = threading.Event()
        self.failed: ServeError | None = None

    # -- starting ------------------------------------------------------------------------------
    def _argv(self, spec: ProcessSpec, config_dir: str) -> list[str]:
        return [a.replace("{config_dir}", config_dir) for a in spec.argv]

    def start(self) -> None:
        """Start every process and wait until all are healthy (raises :class:`ServeError`)."""
        self._dir = tempfile.TemporaryDirectory(prefix="agentkv-serve-")
        config_dir = self._dir.name
        try:
            for i, spec in enumerate(self.deployment.processes):
                if spec.config_file is not None:
                    name, contents = spec.config_file
                    Path(config_dir, name).write_text(contents)
                self._spawn(spec, self._argv(spec, config_dir), _COLORS[i % len(_COLORS)])
            for child in self.children:
                self._wait_healthy(child)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, spec: ProcessSpec, argv: list[str], color: str) -> None:
        def show(line: str) -> None:
            if self.console is not None:
                prefix = Text(f"{spec.name:>10} | ", style=color)
                self.console.print(prefix + Text(line), soft_wrap=True, highlight=False)

        try:
            process = start(argv, name=spec.name, env=spec.env, on_line=show)
        except ProcessError as exc:
            raise ServeError(spec.name, exc.message) from exc
        self.children.append(_Child(spec, process, color))

    def _dead(self, child: _Child) -> ServeError:
        exc = child.process.error()
        return ServeError(child.spec.name, exc.message, code=exc.code)

    def _wait_healthy(self, child: _Child) -> None:
        status = (
            self.console.status(f"waiting for {child.spec.name} ({child.spec.health_url})")
            if self.console is not None
            else contextlib.nullcontext()
        )
        with status:
            try:
                child.process.wait_ready(
                    health_url=child.spec.health_url,
                    timeout_s=self.startup_timeout_s,
                    interval_s=0.2,
                    interrupt=self._stop,
                )
            except ProcessError as exc:
                message = exc.reason if exc.interrupted else exc.message
                raise ServeError(child.spec.name, message, code=exc.code) from None
        if self.console is not None:
            self.console.print(f"[green]✓[/] {child.spec.name} is up ({child.spec.health_url})")

    # -- running -------------------------------------------------------------------------------
    def request_stop(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        """Ask :meth:`wait` to return (a signal handler)."""
        self._stop.set()

    def wait(self) -> int:
        """Until a signal or a child's exit: 0 after a signal, 1 when a child died."""
        while not self._stop.wait(0.2):
            for child in self.children:
                if child.process.returncode is not None:
                    if self._stop.wait(0.5):
                        return 0  # Ctrl-C reached the child too, and it was first to act
                    self.failed = self._dead(child)
                    return 1
        return 0

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """Route SIGINT, SIGTERM and SIGHUP to :meth:`request_stop` while the block runs."""
        old = {s: signal.signal(s, self.request_stop) for s in _STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    # -- stopping -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every process, router first, prefill last."""
        for child in reversed(self.children):
            child.process.stop(self.grace_s)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_router(
    config: Mapping[str, Any],
    *,
    workdir: Path | None = None,
    args: Sequence[str] = (),
    log_level: str = "warning",
    timeout_s: float = 60.0,
    new_session: bool = False,
) -> Process:
    """``agentkv router`` with ``config`` (its ``port`` set) on a free port of 127.0.0.1, ready
    (``/health`` 200) when this returns; stop it with :meth:`Process.stop` or a ``with`` block.

    The config file and the log are ``router-PORT.json`` and ``router-PORT.log`` in
    ``workdir``, or in a private directory that stop removes. Raises
    :class:`agentkv.procs.ProcessError` (with the router's last log lines).
    """
    own: tempfile.TemporaryDirectory[str] | None = None
    if workdir is None:
        own = tempfile.TemporaryDirectory(prefix="agentkv-router-")
        workdir = Path(own.name)
    where = workdir

    def argv(port: int) -> list[str]:
        path = where / f"router-{port}.json"
        http = {**dict(config.get("http") or {}), "port": port}
        path.write_text(json.dumps({**config, "http": http}))
        cmd = [sys.executable, "-m", "agentkv", "router", "--config", str(path)]
        return [*cmd, "--port", str(port), "--log-level", log_level, *args]

    try:
        router = start_on_free_port(
            argv,
            name="router",
            log=lambda port: where / f"router-{port}.log",
            timeout_s=timeout_s,
            new_session=new_session,
        )
    except BaseException:
        if own is not None:
            own.cleanup()
        raise
    if own is not None:
        router.on_stop.append(own.cleanup)
    return router
