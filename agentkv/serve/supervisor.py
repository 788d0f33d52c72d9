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
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import httpx
from rich.console import Console
from rich.text import Text

from agentkv.serve import Deployment, ProcessSpec

__all__ = ["ServeError", "Supervisor"]

_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta")
_PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when the process (strictly: the
    thread) that starts it dies, however it dies; None where ``prctl`` does not exist (not
    Linux). SIGTERM rather than SIGKILL, so an engine can still stop what it started itself.

    libc is resolved here, in the parent: the child, between fork and exec, only makes the
    call (and checks that the parent did not die before it).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody will signal
            os._exit(1)

    return preexec


def _stat(pid: int | str) -> list[bytes]:
    """``/proc/PID/stat`` after the command name: state, ppid, …, start time at index 19."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rfind(b")") + 2 :].split()


def _descendants(pid: int) -> list[tuple[int, bytes]]:
    """Every process below ``pid``, with its start time (Linux ``/proc``; elsewhere none)."""
    children: dict[int, list[tuple[int, bytes]]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            fields = _stat(entry) if entry.isdigit() else []
            if len(fields) > 19:
                children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    out: list[tuple[int, bytes]] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


class ServeError(Exception):
    """A process failed to start or died; ``name`` says which."""

    def __init__(self, name: str, message: str, *, code: int | None = None) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.code = name, code


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen[bytes]
    color: str
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    reader: threading.Thread | None = None


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
        self._preexec = die_with_parent()

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
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # PR_SET_PDEATHSIG fires when the starting *thread* ends: only from the main
                # thread, whose end is the process's
                preexec_fn=(
                    self._preexec if threading.current_thread() is threading.main_thread() else None
                ),
            )
        except OSError as exc:
            raise ServeError(spec.name, f"cannot start {argv[0]!r}: {exc}") from exc
        child = _Child(spec, process, color)
        child.reader = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.reader.start()
        self.children.append(child)

    def _pump(self, child: _Child) -> None:
        stream: IO[bytes] | None = child.process.stdout
        if stream is None:
            return
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            child.tail.append(line)
            if self.console is not None:
                prefix = Text(f"{child.spec.name:>10} | ", style=child.color)
                self.console.print(prefix + Text(line), soft_wrap=True, highlight=False)
        stream.close()

    def _dead(self, child: _Child) -> ServeError:
        code = child.process.returncode
        last = "\n".join(list(child.tail)[-5:])
        message = f"exited with code {code}" + (f"; last output:\n{last}" if last else "")
        return ServeError(child.spec.name, message, code=code)

    def _wait_healthy(self, child: _Child) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        status = (
            self.console.status(f"waiting for {child.spec.name} ({child.spec.health_url})")
            if self.console is not None
            else contextlib.nullcontext()
        )
        with status, httpx.Client(trust_env=False) as client:
            while time.monotonic() < deadline:
                if child.process.poll() is not None:
                    if self._stop.is_set():
                        raise ServeError(child.spec.name, "interrupted while starting")
                    raise self._dead(child)
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(child.spec.health_url, timeout=2.0).status_code == 200:
                        if self.console is not None:
                            self.console.print(
                                f"[green]✓[/] {child.spec.name} is up ({child.spec.health_url})"
                            )
                        return
                if self._stop.wait(0.2):
                    raise ServeError(child.spec.name, "interrupted while starting")
        raise ServeError(child.spec.name, f"not healthy after {self.startup_timeout_s:.0f}s")

    # -- running -------------------------------------------------------------------------------
    def request_stop(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        """Ask :meth:`wait` to return (a signal handler)."""
        self._stop.set()

    def wait(self) -> int:
        """Until a signal or a child's exit: 0 after a signal, 1 when a child died."""
        while not self._stop.wait(0.2):
            for child in self.children:
                if child.process.poll() is not None:
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
            self._terminate(child)
        for child in self.children:
            if child.reader is not None:
                child.reader.join(timeout=2)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _terminate(self, child: _Child) -> None:
        if child.process.poll() is not None:
            return
        below = _descendants(child.process.pid)
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            child.process.wait()
        for pid, started in below:  # what it started and left behind (the same process)
            fields = _stat(pid)
            if len(fields) > 19 and fields[19] == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
