"""agentkv.procs on real child processes: a tiny HTTP server child, one that exits early, one
that ignores SIGTERM, one that leaves a grandchild behind, and a lost race for a port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from agentkv import procs
from agentkv.procs import ProcessError

pytestmark = pytest.mark.e2e

SERVER = textwrap.dedent(
    """
    import http.server, os, signal, sys, time
    port, mode = int(sys.argv[1]), sys.argv[2]
    print("starting on", port, flush=True)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "grandchild":
        import subprocess
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("grandchild", g.pid, flush=True)
    if mode == "slow":
        time.sleep(60)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def server(mode: str = "plain") -> Callable[[int], list[str]]:
    return lambda port: [sys.executable, "-c", SERVER, str(port), mode]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    fields = procs._stat(pid)
    return bool(fields) and fields[0] != b"Z"


def gone(pid: int, timeout_s: float = 5) -> bool:
    """Whether ``pid`` is gone within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_server_child_is_ready_then_stopped() -> None:
    with procs.start_on_free_port(server(), name="tiny") as p:
        assert p.port is not None and p.returncode is None
        with urllib.request.urlopen(f"{p.url}/health", timeout=5) as r:
            assert r.status == 200
        assert procs.http_ok(f"{p.url}/health") and not procs.http_ok(f"{p.url}/nope")
        assert "starting on" in p.log_text()
        log = p.log_path
        assert log is not None and log.exists()
    assert p.returncode == -signal.SIGTERM
    assert not log.exists()  # the private log goes with the process
    assert p.stop() == -signal.SIGTERM  # idempotent


def test_an_early_exit_is_a_clear_error_with_the_log_tail(tmp_path: Path) -> None:
    code = "import sys; [print('line', i) for i in range(30)]; print('bad flag --x'); sys.exit(3)"
    started = time.monotonic()
    with pytest.raises(ProcessError) as info:
        procs.start(
            [sys.executable, "-c", code],
            name="early",
            health_url="http://127.0.0.1:9/health",
            log=tmp_path / "early.log",
            timeout_s=30,
        )
    assert time.monotonic() - started < 10  # seen as an exit, not waited out
    exc = info.value
    assert exc.code == 3 and exc.name == "early" and not exc.timed_out and not exc.port_taken
    log = tmp_path / "early.log"
    assert str(exc).startswith(f"early: exited with code 3 (log: {log}); last output:\n")
    assert str(exc).endswith("bad flag --x") and "line 29" in str(exc) and "line 20" not in str(exc)
    assert exc.tail[-1] == "bad flag --x" and len(exc.tail) == 20
    assert (tmp_path / "early.log").read_text().startswith("line 0")  # a given log stays


def test_the_tail_through_a_pipe_and_on_line() -> None:
    seen: list[str] = []
    code = "import sys; print('hello'); print('oops', file=sys.stderr); sys.exit(2)"
    with pytest.raises(ProcessError, match=r"exited with code 2; last output:\nhello\noops"):
        procs.start([sys.executable, "-c", code], ready=lambda p: False, on_line=seen.append)
    assert seen == ["hello", "oops"]


def test_a_child_that_ignores_sigterm_is_killed() -> None:
    p = procs.start_on_free_port(server("ignore-term"))
    started = time.monotonic()
    assert p.stop(timeout_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 5


def test_what_the_child_left_behind_is_killed_too() -> None:
    p = procs.start_on_free_port(server("grandchild"))
    line = next(x for x in p.tail() if x.startswith("grandchild"))
    grandchild = int(line.split()[1])
    assert alive(grandchild)
    p.stop()
    assert gone(grandchild)


def test_a_new_session_is_stopped_as_a_group() -> None:
    code = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    p = procs.start([sys.executable, "-c", code], new_session=True)
    assert os.getpgid(p.pid) == p.pid
    deadline = time.monotonic() + 10
    while len(procs.descendants(p.pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    sleeper, *_ = procs.descendants(p.pid)
    p.stop()
    assert gone(sleeper)


def test_a_child_not_ready_in_time_is_stopped() -> None:
    with pytest.raises(ProcessError, match="not healthy after 1s") as info:
        procs.start_on_free_port(server("slow"), timeout_s=1)
    assert info.value.timed_out and info.value.code is None


def test_an_interrupt_ends_the_wait() -> None:
    stop = threading.Event()
    port = procs.free_port()
    p = procs.start(server("slow")(port), port=port)
    threading.Timer(0.3, stop.set).start()
    try:
        with pytest.raises(ProcessError, match="interrupted while starting") as info:
            p.wait_ready(health_url=f"{p.url}/health", timeout_s=30, interrupt=stop)
        assert info.value.interrupted
    finally:
        p.stop()


def test_a_port_taken_before_the_bind_is_retried_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        real = procs.free_port
        monkeypatch.setattr(procs, "free_port", lambda: next(picks, None) or real())
        with procs.start_on_free_port(server(), name="racer") as p:
            assert p.port not in (None, busy) and procs.http_ok(f"{p.url}/health")


def test_a_lost_race_is_not_retried_forever() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        argv = server()
        with pytest.raises(ProcessError, match="in use") as info:
            procs.start_on_free_port(lambda _port: argv(busy), attempts=2)
        assert info.value.port_taken


def test_a_missing_program_cannot_start() -> None:
    with pytest.raises(ProcessError, match="cannot start"):
        procs.start(["/nonexistent/agentkv-no-such-program"])


def test_the_child_dies_with_its_parent(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    code = textwrap.dedent(
        f"""
        import pathlib, sys, time
        from agentkv import procs
        p = procs.start([sys.executable, "-c", "import time; time.sleep(60)"])
        pathlib.Path({str(pidfile)!r}).write_text(str(p.pid))
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        child = int(pidfile.read_text())
        assert alive(child)
        parent.kill()  # SIGKILL: no cleanup of its own runs
        parent.wait()
        assert gone(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
