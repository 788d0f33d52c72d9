"""Child processes on loopback: start one, wait until it is ready, stop it (standard library only).

One helper for every place that runs a server as a child process: the simulator launcher, the
``agentkv serve`` supervisor, ``agentkv demo``, the bench deploy step, the benchmarks and the
tests. What it guarantees:

* **output is kept**: in ``log`` (a file), through ``on_line`` (a pipe read by a thread), or in
  a private temporary file removed by :meth:`Process.stop`; the last lines are in every error;
* **readiness**: :meth:`Process.wait_ready` polls ``health_url`` (HTTP 200, no proxies) and/or a
  ``ready`` callable, and fails fast with :class:`ProcessError` (exit code and log tail) when the
  child exits first, or when ``timeout_s`` passes, or when an ``interrupt`` event is set;
* **no orphans**: on Linux a child started from the main thread gets ``PR_SET_PDEATHSIG``
  (SIGTERM when this process dies, even by SIGKILL); :meth:`Process.stop` sends SIGTERM, then
  SIGKILL after ``timeout_s``, and then SIGKILLs what the child started and left behind;
  ``new_session=True`` puts the child in a process group of its own, and stop signals the group;
* **port races**: :func:`start_on_free_port` picks a free port, and when the child exits while
  starting (someone took the port between the pick and the bind) tries again on another.

Imports nothing of agentkv and nothing outside the standard library (an import-linter contract),
so every layer, the simulator included, can use it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = [
    "Process",
    "ProcessError",
    "descendants",
    "die_with_parent",
    "free_port",
    "free_port_range",
    "http_ok",
    "log_contains",
    "start",
    "start_on_free_port",
]

_PR_SET_PDEATHSIG = 1
_TAIL_LINES = 20
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (another process may still take
    it before the caller binds it: :func:`start_on_free_port` retries for that)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def free_port_range(count: int, *, avoid: Collection[int] = ()) -> int:
    """A port B such that B, B+1, …, B+count-1 on 127.0.0.1 are all free now (bound together,
    with ``SO_REUSEADDR`` as servers bind) and none is in ``avoid``; from 20000 to 60000.
    Raises RuntimeError when 200 tries find none."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        if avoid and any(p in avoid for p in range(base, base + count)):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"found no {count} consecutive free ports on 127.0.0.1")


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 (no proxies from the environment; any error is
    False)."""
    try:
        with _NO_PROXY.open(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (OSError, http.client.HTTPException, ValueError):
        return False


def log_contains(text: str) -> Callable[[Process], bool]:
    """A ``ready`` check for :meth:`Process.wait_ready`: the child's output contains ``text``
    (a line a server prints once it is up, e.g. ``agentkv serve``'s "ready: OpenAI base URL")."""
    return lambda proc: text in proc.log_text()


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


def descendants(pid: int) -> list[int]:
    """The ids of every process below ``pid`` now (Linux ``/proc``; elsewhere empty)."""
    return [child for child, _ in _descendants(pid)]


class ProcessError(RuntimeError):
    """A child failed to start: it exited (``code`` is its exit code), did not become ready in
    time (``timed_out``), or the wait was interrupted. ``tail`` holds its last output lines, and
    the message names the child and shows the last of them."""

    def __init__(
        self,
        name: str,
        reason: str,
        *,
        code: int | None = None,
        tail: Sequence[str] = (),
        timed_out: bool = False,
        interrupted: bool = False,
        show: int = 5,
    ) -> None:
        last = "\n".join(list(tail)[-show:]) if show else ""
        self.message = reason + (f"; last output:\n{last}" if last else "")
        """The reason and the last lines, without the name."""
        super().__init__(f"{name}: {self.message}")
        self.name, self.reason, self.code = name, reason, code
        self.tail = list(tail)
        self.timed_out, self.interrupted = timed_out, interrupted

    @property
    def port_taken(self) -> bool:
        """Whether the child exited saying its address is in use (a lost race for a port)."""
        return self.code is not None and any("in use" in line.lower() for line in self.tail)


class Process:
    """One child process: its ``Popen`` (``process``), ``name``, ``port`` and output.

    A context manager: the block's end stops it. :meth:`stop` may be called more than once.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        *,
        name: str,
        port: int | None = None,
        log_path: Path | None = None,
        own_log: bool = False,
        new_session: bool = False,
    ) -> None:
        self.process, self.name, self.port = process, name, port
        self.log_path, self._own_log = log_path, own_log
        self.new_session = new_session
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._reader: threading.Thread | None = None
        self.on_stop: list[Callable[[], None]] = []
        """Called by :meth:`stop` once the child has exited (e.g. to remove its config)."""

    # -- facts ---------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (raises ValueError for a child started without a port)."""
        if self.port is None:
            raise ValueError(f"{self.name} has no port")
        return f"http://127.0.0.1:{self.port}"

    @property
    def returncode(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.process.poll()

    def log_text(self) -> str:
        """All output so far (from the log file), or the kept tail when it goes through a pipe."""
        if self.log_path is not None:
            try:
                return self.log_path.read_text(errors="replace")
            except OSError:
                return ""
        return "\n".join(self._tail)

    def tail(self, lines: int = _TAIL_LINES) -> list[str]:
        """The last ``lines`` lines of output (from the last 64 KiB of a log file)."""
        kept = list(self._tail)
        if self.log_path is not None:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
                    kept = f.read().decode(errors="replace").splitlines()
            except OSError:
                kept = []
        return kept[-lines:] if lines > 0 else []

    def error(self, reason: str | None = None, **kw: bool) -> ProcessError:
        """A :class:`ProcessError` for this child: its exit code (or ``reason``) and last lines."""
        code = self.process.poll()
        reason = reason or f"exited with code {code}"
        if self.log_path is not None and not self._own_log:
            reason += f" (log: {self.log_path})"
        return ProcessError(self.name, reason, code=code, tail=self.tail(), **kw)

    # -- readiness -----------------------------------------------------------------------------
    def wait_ready(
        self,
        *,
        health_url: str | None = None,
        ready: Callable[[Process], bool] | None = None,
        timeout_s: float = 60.0,
        interval_s: float = 0.1,
        interrupt: threading.Event | None = None,
    ) -> None:
        """Return once ``health_url`` answers 200 and ``ready(self)`` is true (each when given).

        Raises :class:`ProcessError` when the child exits first (its code and log tail), when
        ``timeout_s`` passes (``timed_out``) or when ``interrupt`` is set (``interrupted``).
        Does not stop the child: the caller decides (:func:`start` does).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if interrupt is not None and interrupt.is_set():
                raise self.error("interrupted while starting", interrupted=True)
            if self.process.poll() is not None:
                if interrupt is not None and interrupt.is_set():
                    raise self.error("interrupted while starting", interrupted=True)
                if self._reader is not None:  # its last lines, before they are shown
                    self._reader.join(timeout=1)
                raise self.error()
            if (health_url is None or http_ok(health_url)) and (ready is None or ready(self)):
                return
            if time.monotonic() >= deadline:
                raise self.error(f"not healthy after {timeout_s:.0f}s", timed_out=True)
            if interrupt is not None:
                interrupt.wait(interval_s)
            else:
                time.sleep(interval_s)

    # -- stopping ------------------------------------------------------------------------------
    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.new_session:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """Stop the child and return its exit code: SIGTERM (to its group with
        ``new_session``), SIGKILL after ``timeout_s``, then SIGKILL to whatever it started that
        is still running (Linux). Closes and (when private) removes its log. Idempotent."""
        below = _descendants(self.process.pid) if self.process.poll() is None else []
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        elif self.new_session:  # the leader is gone; what it left in its group is not
            self._signal(signal.SIGKILL)
        for pid, started in below:  # what it started and left behind (the same process)
            fields = _stat(pid)
            if len(fields) > 19 and fields[19] == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(timeout=2)
        if self._own_log and self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
        while self.on_stop:
            self.on_stop.pop()()
        return self.process.returncode

    def __enter__(self) -> Process:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Process({self.name!r}, pid={self.process.pid}, port={self.port})"


def _pump(proc: Process, stream: IO[bytes], on_line: Callable[[str], None]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        proc._tail.append(line)
        on_line(line)
    stream.close()


def start(
    argv: Sequence[str],
    *,
    health_url: str | None = None,
    ready: Callable[[Process], bool] | None = None,
    timeout_s: float = 60.0,
    name: str | None = None,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    cwd: str | Path | None = None,
    new_session: bool = False,
    parent_death: bool = True,
) -> Process:
    """Start ``argv``; with ``health_url`` or ``ready``, return once it is ready
    (:meth:`Process.wait_ready`), else at once (wait later with :meth:`Process.wait_ready`).

    Args:
        health_url, ready, timeout_s: what ready means, and how long it may take.
        name: for messages (default: the program's file name).
        port: the port the child will listen on (for :attr:`Process.url`).
        env: set over this process's environment (with ``PYTHONUNBUFFERED=1``).
        log: the file stdout and stderr go to (truncated); None: a private temporary file, or
            with ``on_line`` a pipe whose every line is passed to ``on_line`` from a thread.
        new_session: a session and process group of its own (stop signals the group).
        parent_death: on Linux, from the main thread, SIGTERM to the child when this process
            dies (``PR_SET_PDEATHSIG``).

    Raises :class:`ProcessError` when the program cannot be executed, or when it exits or
    times out before it is ready; it is stopped then (the error has its last output lines).
    """
    name = name or Path(argv[0]).name
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # PR_SET_PDEATHSIG fires when the starting *thread* ends: only from the main thread, whose
    # end is the process's
    main = threading.current_thread() is threading.main_thread()
    preexec = die_with_parent() if parent_death and main else None
    own_log = False
    out: IO[bytes] | int
    if on_line is not None and log is None:
        out = subprocess.PIPE
    else:
        if log is None:
            fd, raw = tempfile.mkstemp(prefix=f"agentkv-{name}-", suffix=".log")
            os.close(fd)
            log, own_log = Path(raw), True
        out = open(log, "wb")  # noqa: SIM115 - the child holds its own copy; ours closes below
    try:
        popen = subprocess.Popen(
            list(argv),
            env=full_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
            start_new_session=new_session,
        )
    except OSError as exc:
        if own_log and log is not None:
            log.unlink(missing_ok=True)
        raise ProcessError(name, f"cannot start {argv[0]!r}: {exc}") from exc
    finally:
        if not isinstance(out, int):
            out.close()
    proc = Process(
        popen, name=name, port=port, log_path=log, own_log=own_log, new_session=new_session
    )
    if popen.stdout is not None and on_line is not None:
        proc._reader = threading.Thread(
            target=_pump, args=(proc, popen.stdout, on_line), daemon=True, name=f"log-{name}"
        )
        proc._reader.start()
    if health_url is not None or ready is not None:
        try:
            proc.wait_ready(health_url=health_url, ready=ready, timeout_s=timeout_s)
        except BaseException:
            proc.stop()
            raise
    return proc


def start_on_free_port(
    argv: Callable[[int], Sequence[str]],
    *,
    health_path: str | None = "/health",
    ready: Callable[[Process], bool] | None = None,
    attempts: int = 3,
    timeout_s: float = 60.0,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    log: Callable[[int], Path] | None = None,
    on_line: Callable[[str], None] | None = None,
    cwd: str | Path | None = None,
    new_session: bool = False,
) -> Process:
    """Start ``argv(port)`` on a free port of 127.0.0.1 and wait until it is ready: GET
    ``health_path`` answers 200 (None: no HTTP check) and ``ready(process)`` is true.

    A child that exits while starting because the port was taken between the pick and its bind
    (its output says "in use": :attr:`ProcessError.port_taken`) is tried again on another port,
    ``attempts`` times in all; any other failure is raised at once as :class:`ProcessError`.
    ``log(port)`` names the log file.
    """
    failure: ProcessError | None = None
    for _ in range(max(1, attempts)):
        port = free_port()
        health = f"http://127.0.0.1:{port}{health_path}" if health_path is not None else None
        try:
            return start(
                argv(port),
                health_url=health,
                ready=ready,
                timeout_s=timeout_s,
                name=name,
                port=port,
                env=env,
                log=log(port) if log is not None else None,
                on_line=on_line,
                cwd=cwd,
                new_session=new_session,
            )
        except ProcessError as exc:
            if not exc.port_taken:
                raise
            failure = exc
    assert failure is not None
    raise failure
