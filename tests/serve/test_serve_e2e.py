"""`agentkv serve` and `agentkv demo` as real subprocesses on free loopback ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import agentkv
from agentkv import procs
from agentkv.procs import free_port

pytestmark = pytest.mark.e2e


def profile_file(tmp: Path) -> Path:
    """The local profile on free ports, with no simulated delays."""
    path = tmp / "test-local.toml"
    path.write_text(
        f"""
extends = "local"
name = "test-local"
[prefill]
base_port = {free_port()}
kv_events_base_port = {free_port()}
[decode]
base_port = {free_port()}
[router.http]
port = {free_port()}
[sim]
time_scale = 0
"""
    )
    return path


def start_serve(profile: Path) -> procs.Process:
    """``agentkv serve PROFILE``, its output in ``serve.log`` next to the profile."""
    argv = [sys.executable, "-m", "agentkv", "serve", str(profile)]
    log = profile.with_name("serve.log")
    return procs.start(argv, name="agentkv serve", log=log, env={"COLUMNS": "200"})


def stop(proc: procs.Process) -> None:
    """SIGTERM lets serve stop its children; kill only if it does not."""
    proc.stop(30)


def wait_ready(proc: procs.Process, timeout: float = 90) -> list[str]:
    """Its output so far, once it says it is ready."""
    proc.wait_ready(ready=procs.log_contains("ready: OpenAI base URL"), timeout_s=timeout)
    return proc.log_text().splitlines(keepends=True)


def finish(proc: procs.Process, timeout: float = 60) -> str:
    """Its whole output, once it has exited."""
    proc.process.wait(timeout)
    return proc.log_text()


def base_url(lines: list[str]) -> str:
    ready = next(line for line in lines if "base URL" in line)
    return ready.split("base URL", 1)[1].split()[0]


def test_dry_run_prints_every_process(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "agentkv", "serve", str(profile_file(tmp_path)), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    for name in ("prefill-0", "decode-0", "router"):
        assert name in out
    assert "agentkv sim --role prefill" in out and "router.json" in out


def test_serve_runs_a_conversation_and_stops_cleanly(tmp_path):
    proc = start_serve(profile_file(tmp_path))
    try:
        lines = wait_ready(proc)
        url = base_url(lines)
        with agentkv.Client(base_url=url, api_key="k") as c:
            conv = c.conversation(model="agentkv-sim", system="You are terse. " * 30)
            for i in range(3):
                conv.add_user(f"question {i}")
                conv.create(max_tokens=80)
        # the router's default paths.mode, choose: the short follow-ups decode on D in place
        assert [r.decision for r in conv.receipts] == ["miss", "decode", "decode"]
        assert all((r.cached_tokens or 0) > 0 for r in conv.receipts[1:]), conv.receipts
        proc.process.send_signal(signal.SIGTERM)
        out = finish(proc)
        assert proc.returncode == 0, out
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.removesuffix("/v1") + "/health", timeout=1)
    finally:
        stop(proc)


def test_a_dead_child_stops_serve_with_its_name(tmp_path):
    proc = start_serve(profile_file(tmp_path))
    try:
        lines = wait_ready(proc)
        decode_port = next(
            line.split("127.0.0.1:")[1].split("/")[0] for line in lines if "decode-0 is up" in line
        )
        pid = next(
            int(p)
            for p in subprocess.run(
                ["pgrep", "-f", "--", f"--port {decode_port}"], capture_output=True, text=True
            ).stdout.split()
        )
        os.kill(pid, signal.SIGKILL)
        out = finish(proc)
        assert proc.returncode != 0
        assert "decode-0" in out and "exited" in out
    finally:
        stop(proc)


def test_demo_runs_and_shows_the_hazard(tmp_path):
    port = free_port()
    argv = ["demo", "--profile", str(profile_file(tmp_path)), "--port", str(port)]
    r = subprocess.run(
        [sys.executable, "-m", "agentkv", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reuse without verification" in r.stdout and "agentkv (verified)" in r.stdout
    assert f"started the local backend at http://127.0.0.1:{port}/v1" in r.stdout
    # modelled TTFT saved per turn and in total, the rewrite turns trimmed (decoded in place:
    # the default paths.mode, choose) and what survived them found in D's prefix cache, the
    # unverified turns on wrong KV named, the legend of what appears
    assert "TTFT saved" in r.stdout and r.stdout.count("decode (trimmed)") == 2
    assert "prompt tokens found in D's prefix cache: the system prompt" in r.stdout
    assert "turn 6 (summary): " in r.stdout and "the system prompt with the tools" in r.stdout
    assert "reuse without verification: turns 4, 5 and 6 ran on KV computed" in r.stdout
    for term in ("miss =", "decode =", "wrong KV ="):
        assert term in r.stdout, term
    assert "stale =" not in r.stdout  # no turn was stale: nothing to explain
    assert "Traceback" not in r.stderr


def test_unknown_profile_is_a_clear_error():
    r = subprocess.run(
        [sys.executable, "-m", "agentkv", "serve", "no-such-profile"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no-such-profile" in r.stderr and "Traceback" not in r.stderr


def test_profiles_commands():
    def run(*a: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "agentkv", "profiles", *a]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    listed = run("list")
    assert listed.returncode == 0 and "qwen3-32b-1p1d" in listed.stdout
    assert run("validate", "local").returncode == 0
    k8s = run("render", "llama-3.1-8b-2p4d", "--format", "k8s")
    assert k8s.returncode == 0 and "Deployment" in k8s.stdout
    assert "nvidia.com/gpu" in k8s.stdout
