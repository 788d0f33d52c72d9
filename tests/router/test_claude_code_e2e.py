"""Claude Code itself (``claude -p``, headless) against the router and simulator P and D on
loopback: the agent people run, unmodified, over the Messages API (issue 22).

Claude Code is installed from npm once into ``~/.cache/agentkv/harness/claude-code`` and reused;
the test is skipped only when npm cannot reach its registry. Claude Code sends no body field of
ours, so the simulators run with ``--prompt-scripts``: the prompt carries the script of the
model's answers (two Bash tool calls, then a text answer), and Claude Code really runs the tools.
Nothing names the conversation but Claude Code itself: its ``X-Claude-Code-Session-Id`` (and the
``session_id`` in its ``metadata.user_id``), which the router reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from agentkv.protocol.promtext import parse_metrics
from tests._support.stack import stack

# paths.mode = "pull" (tests/_support/router_config.py): these tests check P's reads of
# D's KV (decision `pull`, X-AgentKV-Reused-Tokens, P's counters), which the default
# `choose` skips for a short turn by decoding it on D in place (test_paths_e2e.py)
pytestmark = [pytest.mark.e2e, pytest.mark.paths_pull]

HARNESS = Path.home() / ".cache" / "agentkv" / "harness" / "claude-code"
PACKAGE = HARNESS / "node_modules" / "@anthropic-ai" / "claude-code"
_OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "ENETUNREACH")


def _version(binary: Path) -> str | None:
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def claude_code() -> Path:
    """The ``claude`` binary, installed from npm on first use."""
    binary = PACKAGE / "bin" / "claude.exe"
    if binary.exists() and _version(binary):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: Claude Code comes from the npm registry")
    HARNESS.mkdir(parents=True, exist_ok=True)
    manifest = HARNESS / "package.json"
    if not manifest.exists():  # else npm installs into the nearest parent that has one
        manifest.write_text('{"private": true}\n')
    r = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "@anthropic-ai/claude-code"],
        cwd=HARNESS,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        if any(code in r.stderr for code in _OFFLINE):
            pytest.skip(f"npm cannot reach its registry: {' / '.join(tail)}")
        pytest.fail(f"npm install @anthropic-ai/claude-code failed: {' / '.join(tail)}")
    if not _version(binary):
        # the native binary comes in an optional dependency, put in place by this script
        subprocess.run(["node", "install.cjs"], cwd=PACKAGE, check=True, timeout=300)
    assert _version(binary), f"{binary} does not run"
    return binary


def test_claude_code_runs_a_three_turn_tool_session_with_reuse(tmp_path):
    binary = claude_code()
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    script = [
        {
            "tool_calls": [
                {"name": "Bash", "arguments": {"command": "touch one", "description": "1"}}
            ]
        },
        {
            "tool_calls": [
                {"name": "Bash", "arguments": {"command": "touch two", "description": "2"}}
            ]
        },
        {"content": "All done."},
    ]
    common = ("--time-scale", "0", "--block-size", "16", "--prompt-scripts")
    with stack(tmp_path, common=common) as s:
        env = {
            **os.environ,
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": s.router.url,
            "ANTHROPIC_API_KEY": "sk-local",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        prompt = "Make two files. agentkv_sim: " + json.dumps(script)
        argv = [binary, "-p", prompt, "--model", "agentkv-sim", "--allowedTools", "Bash"]
        r = subprocess.run(
            [*argv, "--output-format", "json"],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:], s.router.log_text()[-2000:])
        result = json.loads(r.stdout)
        text = httpx.get(f"{s.router.url}/metrics", timeout=10).text
        requests = {
            k: v for k, v in parse_metrics(text, by="decision").items() if "requests_total" in k
        }
        sources = parse_metrics(text, by="source")
        wrong = s.wrong_kv()
    assert result["is_error"] is False and result["result"] == "All done.", result
    assert result["num_turns"] == 3 and result["stop_reason"] == "end_turn"
    assert (work / "one").exists() and (work / "two").exists()  # Claude Code ran both calls
    assert result["usage"]["cache_read_input_tokens"] > 0
    assert requests == {
        "agentkv_router_requests_total[miss]": 1,
        "agentkv_router_requests_total[pull]": 2,
    }, requests
    assert sources["agentkv_router_conversation_sources_total[claude-code]"] == 3, sources
    assert wrong == 0
